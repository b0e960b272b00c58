"""The technique registry finds its modules itself, and each technique's ``check`` fails when its
record shows it did nothing."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from ditbook import accel
from ditbook.accel.technique import KINDS, NothingDone


def test_a_module_dropped_into_the_package_is_listed(tmp_path, monkeypatch):
    """No list to edit: a module on ``accel``'s path that registers a technique is found."""
    (tmp_path / "dropped_in.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from ditbook.accel import register
        from ditbook.accel.technique import CacheTechnique

        @dataclass
        class DroppedSettings:
            every: int = 2

        @register
        class DroppedIn(CacheTechnique):
            name = "dropped_in"
            family = "a test's step cache"
            Settings = DroppedSettings
    '''))
    monkeypatch.setattr(accel, "__path__", [*accel.__path__, str(tmp_path)])
    try:
        assert "dropped_in" in accel.names("cache")
        assert accel.get("dropped_in").Settings().every == 2
    finally:
        accel._REGISTRY.pop("dropped_in", None)
        sys.modules.pop("ditbook.accel.dropped_in", None)
        monkeypatch.undo()
    assert "dropped_in" not in accel.names()


def test_every_technique_has_a_known_kind_settings_and_a_family():
    found = accel.techniques()
    kinds = {t.kind for t in found}
    assert {"cache", "parallel", "compile", "quantize", "graphs", "attention"} <= kinds <= set(KINDS)
    for t in found:
        assert t.family and t.Settings is not None, t
        t.Settings()  # every setting has a default


def test_a_name_taken_by_another_module_is_refused():
    from ditbook.accel.technique import CacheTechnique

    class Clash(CacheTechnique):
        name = accel.names("cache")[0]
        family = "clash"
        Settings = object

    with pytest.raises(ValueError, match="is taken by"):
        accel.register(Clash)


def test_graphs_and_gqa_checks_fail_on_records_of_nothing():
    from ditbook.accel.gqa import GqaPath, GqaRecord
    from ditbook.accel.graphs import CudaGraphs, GraphsRecord

    with pytest.raises(NothingDone, match="no call was replayed .eager."):
        CudaGraphs.check(GraphsRecord("cuda_graphs", captured=1, replays=0, disabled="eager"))
    CudaGraphs.check(GraphsRecord("cuda_graphs", captured=1, replays=3))
    with pytest.raises(NothingDone):
        GqaPath.check(GqaRecord("gqa_path", calls=8, gqa_calls=0))
    GqaPath.check(GqaRecord("gqa_path", calls=8, gqa_calls=8))


class GroupedAttention(torch.nn.Module):
    """Four query heads over two key/value heads, handed to SDPA as they are (``enable_gqa``)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, 2, 4).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(b, n, 16)


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = GroupedAttention()

    def forward(self, x):
        return self.attn(x)


@pytest.mark.parametrize("path", ["enable_gqa", "repeat_interleave"])
def test_the_gqa_route_keeps_the_output_counts_the_grouped_calls_and_is_undone(path):
    from types import SimpleNamespace

    from ditbook.accel.gqa import GqaPath, GqaSettings

    pipe = SimpleNamespace(transformer=Holder())
    x = torch.randn(1, 6, 16)
    ref = pipe.transformer(x)
    h = GqaPath.apply(pipe, GqaSettings(path))
    got = pipe.transformer(x)
    rec = h.record()
    GqaPath.check(rec)
    assert rec.patched_modules == ["attn"] and rec.calls == rec.gqa_calls == 1 and rec.gqa_path == path, rec
    torch.testing.assert_close(got, ref)
    h.undo()
    assert not any("forward" in m.__dict__ for m in pipe.transformer.modules())
    with pytest.raises(ValueError, match="not one of"):
        GqaPath.apply(pipe, GqaSettings("fast"))


def test_the_contracts_technique_table_is_generated_from_the_registry():
    """docs/CONTRACTS.md's technique -> module -> record -> check table is the registry's own."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md").read_text()
    m = re.search(r"<!-- techniques: python -m ditbook.accel -->\n(.*?)\n<!-- /techniques -->", text, re.S)
    assert m, "docs/CONTRACTS.md lost its generated technique table"
    assert m.group(1) == accel.table_markdown(), "paste python -m ditbook.accel into docs/CONTRACTS.md"
    assert all(f"`{name}`" in m.group(1) or name in m.group(1) for name in accel.names())


def test_every_cache_technique_applied_then_undone_without_a_run_leaves_the_model_as_it_was():
    """Apply and undo with no call between (as ``cache.upstream`` records a cache-dit call): the
    diffusers block hooks sit on the blocks only, with no registry on the transformer until a call
    sets a context; their undo must still take them off (batchcfg's cache stage failed on it)."""
    import contextlib
    import io

    from cache_harness import StepsPipeline
    from novel.batchcfg.transformer import RegisterDiT  # blocks called as they are: nothing folded

    from ditbook.adapter.build import build_cache_adapter
    from ditbook.arch.static import inspect_transformer
    from ditbook.arch.trace import trace_calls

    def built():
        torch.manual_seed(0)
        model = RegisterDiT().eval()
        kwargs = {"hidden_states": torch.randn(1, 4, 8, 8), "encoder_hidden_states": torch.arange(8)[None],
                  "timestep": torch.tensor([0.5]), "return_dict": False}
        with contextlib.redirect_stdout(io.StringIO()):
            report = trace_calls(model, lambda: model(**kwargs), report=inspect_transformer(model, None, support=False))
        pipe = type("StepsUndoCheck", (StepsPipeline,), {})(model, kwargs)
        return model, pipe, build_cache_adapter(pipe, report, "undo_check")

    def state(model):
        return [(name, sorted(k for k in vars(m) if k in ("forward", "_diffusers_hook"))) for name, m in model.named_modules()]

    tried = []
    for t in accel.techniques("cache"):
        model, pipe, adapter = built()  # a fresh model each: no earlier technique leaves a registry behind
        if t.applicable(adapter):
            continue
        before = state(model)
        t.apply(pipe, t.Settings(), adapter=adapter, steps=6).undo()
        assert state(model) == before, t.name
        tried.append(t.name)
    assert {"diffusers_fbc", "diffusers_magcache", "dbcache"} <= set(tried), tried
