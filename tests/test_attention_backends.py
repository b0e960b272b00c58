"""The attention backend picker: a wrong backend that is fastest is rejected, the pick is undone
exactly, and a model that calls SDPA itself is declared not applicable."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from test_compiled_configs import tiny_flux as tiny_flux_inputs  # noqa: E402

from ditbook.accel.attention_backend import (applicability, apply_backend, backend_config, measure_backends, output_agreement)


def tiny_flux():
    tr, kw = tiny_flux_inputs()  # the same tiny FLUX transformer the compile tests use
    return tr, (lambda: tr(**kw))


@pytest.fixture
def registry(monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return AttentionBackendName, _AttentionBackendRegistry, monkeypatch


def _state(tr):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return [m.processor._attention_backend for m in tr.modules() if hasattr(getattr(m, "processor", None),
                                                                            "_attention_backend")], \
        _AttentionBackendRegistry._active_backend


class VirtualClock:
    now = 0.0

    def mark(self):
        return self.now

    def sync(self):
        pass

    def seconds(self, a, b):
        return b - a


@pytest.mark.parametrize("wrong", ["zeros", "swapped_heads"])
def test_fastest_wrong_backend_is_rejected(registry, wrong):
    names, reg, mp = registry
    real_native = reg._backends[names.NATIVE]
    real_math = reg._backends[names._NATIVE_MATH]

    clock = VirtualClock()  # the shared CPU is too noisy to rank by wall time: costs are declared

    def slow_native(**kw):  # the honest backend, costing 10 units per call
        clock.now += 10
        return real_native(**kw)

    def fake(**kw):  # a "fast" backend (1 unit) whose output is wrong
        clock.now += 1
        if wrong == "zeros":
            return torch.zeros_like(kw["query"])
        return real_math(**kw).flip(2)  # (batch, seq, heads, dim): heads swapped

    mp.setitem(reg._backends, names.NATIVE, slow_native)
    mp.setitem(reg._backends, names._NATIVE_MATH, fake)
    tr, call = tiny_flux()
    before = _state(tr)
    table = measure_backends(tr, call, backends=["native", "_native_math"], warmup=1, repeats=3,
                             clock=clock, log=lambda m: None)
    fake_row, native_row = table.row("_native_math"), table.row("native")
    assert fake_row.median_s < native_row.median_s  # it IS measured fastest ...
    assert fake_row.status == "rejected" and "attention output differs" in fake_row.reason  # ... and refused
    assert fake_row.kernel_psnr < table.min_kernel_psnr
    assert table.pick == "native" and native_row.status == "correct"
    assert table.pick_over_fastest == 1.0 and table.confirmed
    assert _state(tr) == before  # measuring leaves every processor and the registry as it found them


def test_backend_that_raises_is_marked_with_its_reason(registry):
    names, reg, mp = registry

    def broken(**kw):
        raise RuntimeError("kernel exploded")

    mp.setitem(reg._backends, names._NATIVE_MATH, broken)
    tr, call = tiny_flux()
    table = measure_backends(tr, call, backends=["native", "_native_math", "_native_cudnn"], warmup=1, repeats=2,
                             log=lambda m: None)
    assert table.row("_native_math").status == "error" and "kernel exploded" in table.row("_native_math").reason
    # fp32 on the CPU: diffusers' own constraint refuses cuDNN before anything runs
    assert table.row("_native_cudnn").status == "unavailable" and "bfloat16" in table.row("_native_cudnn").reason
    assert table.pick == "native"


def test_pick_is_applied_and_undone_exactly():
    tr, call = tiny_flux()
    with torch.inference_mode():
        ref = call().sample.clone()
    procs, active = _state(tr)
    assert all(p is None for p in procs)
    undo = apply_backend(tr, "_native_math")
    procs_on, active_on = _state(tr)
    assert all(str(getattr(p, "value", p)) == "_native_math" for p in procs_on) and procs_on
    assert str(getattr(active_on, "value", active_on)) == "_native_math"  # diffusers sets it process-wide too
    undo()
    procs_after, active_after = _state(tr)
    assert procs_after == procs and active_after is active
    with torch.inference_mode():
        assert torch.equal(call().sample, ref)
    # the same through the benchmark configuration
    cfg = backend_config("_native_math")
    pipe = type("P", (), {"transformer": tr})()
    undo = cfg.apply(pipe)
    assert _state(tr)[0] != procs
    undo()
    assert _state(tr) == (procs, active)


class DirectSdpaAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class DirectModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([DirectSdpaAttention() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_model_calling_sdpa_directly_is_not_applicable():
    m = DirectModel()
    ok, why = applicability(m)
    assert not ok and why.startswith("not applicable: the model calls SDPA directly")
    x = torch.randn(1, 8, 16)
    calls = []
    table = measure_backends(m, lambda: calls.append(1) or m(x), log=lambda s: None)
    assert not table.applicable and not calls and table.rows == [] and table.pick is None
    with pytest.raises(ValueError, match="not applicable"):
        apply_backend(m, "native")
    tr, _ = tiny_flux()
    assert applicability(tr)[0]


def test_output_agreement_sees_small_and_large_differences():
    ref = torch.linspace(-1, 1, 1000)
    assert output_agreement(ref + 1e-4, ref).passes(30.0)
    assert not output_agreement(torch.zeros_like(ref), ref).passes(30.0)
    assert not output_agreement(ref.flip(0), ref).passes(30.0)
    bad = ref.clone()
    bad[3] = float("nan")
    assert not output_agreement(bad, ref).passes(30.0)


def test_thirdparty_gqa_model_is_declared_not_applicable():
    """The shipped third-party GQA transformer calls SDPA itself: no backend is measured or set."""
    from pathlib import Path

    from ditbook.card import import_class

    src = Path(__file__).resolve().parents[1] / "models" / "thirdparty_gqa" / "transformer_gqa.py"
    third = import_class(str(src), "GQATransformer2DModel")()
    ok, why = applicability(third)
    assert not ok and why.startswith("not applicable: the model calls SDPA directly") and "blocks.0" in why


def test_benchmark_stage_rows_for_the_pick_and_compiled_twins(tmp_path):
    """The stage's derived configurations on the reference model, through the real harness: the
    backend table is written, the compiled baseline twin records its compile cost and passes
    the gates (eager compile changes nothing), and the pipeline is left as it was."""
    from types import SimpleNamespace

    from ditbook.benchmark.measure import benchmark
    from ditbook.accel.attention_backend import BACKENDS_FILE
    from ditbook.benchmark.variants import derived_configs
    from ditbook.card import load_card
    from ditbook.loading import load_pipeline
    from ditbook.render import call_kwargs, cases, make_generator, to_image
    from pathlib import Path

    card = load_card(Path(__file__).resolve().parents[1] / "models" / "reference.yaml",
                     {"generation.steps": 2, "generation.prompts": ["a red circle on the left"], "generation.seeds": [0],
                      "runtime.compile": "eager", "benchmark.attention_backend": "auto"})
    pipe = load_pipeline(card)
    ctx = SimpleNamespace(card=card, run=SimpleNamespace(stage_dir=lambda name: tmp_path / name))
    torch._dynamo.reset()
    before = _state(pipe.transformer)
    configs = derived_configs(ctx, pipe, [], log=lambda m: None, backends=["native", "_native_math"], warmup=1,
                              repeats=2)
    table = json.loads((tmp_path / "benchmark" / BACKENDS_FILE).read_text())
    assert table["applicable"] and table["pick"]
    assert _state(pipe.transformer) == before
    names = [c.name for c in configs]
    assert "baseline+compile" in names
    # a confirmed pick other than the default gets a row and a compiled twin (CPU timings decide
    # which case this is; both are covered deterministically by the tests above)
    adds = table["confirmed"] and table["pick"] != table["default"]
    assert len(names) == (3 if adds else 1)
    assert (f"attention:{table['pick']}" in names) == adds
    kwargs = call_kwargs(pipe, card)
    render = lambda p, s: to_image(pipe(prompt=p, generator=make_generator(s), **kwargs))  # noqa: E731
    rep = benchmark(pipe, [c for c in configs if c.name == "baseline+compile"], render, cases(card), warmup=0,
                    repeats=1, count_flops=False)
    row = rep.configs[0]
    assert row.error is None and row.quality["passed"], row.error
    stats = row.params["compile"]
    assert stats["method"] == "compile_repeated_blocks" and stats["regions"] > 0 and stats["compile_s"] is not None
    assert not any("_compiled_call_impl" in m.__dict__ for m in pipe.transformer.modules())
    assert _state(pipe.transformer) == before


def test_pick_not_confirmed_by_the_second_round_is_not_applied(registry, tmp_path):
    """Selection and confirmation disagree (a device whose timings drift): the pick is marked not
    confirmed, and the benchmark stage adds no backend row, saying why."""
    from types import SimpleNamespace

    from ditbook.accel import attention_backend

    names, reg, mp = registry
    real_native, real_math = reg._backends[names.NATIVE], reg._backends[names._NATIVE_MATH]
    clock, phase = VirtualClock(), {"confirming": False}

    def native(**kw):  # cheap while selecting, 10x dearer while confirming
        clock.now += 100 if phase["confirming"] else 1
        return real_native(**kw)

    def math(**kw):
        clock.now += 10
        return real_math(**kw)

    mp.setitem(reg._backends, names.NATIVE, native)
    mp.setitem(reg._backends, names._NATIVE_MATH, math)
    tr, call = tiny_flux()

    def log(msg):
        if "selection picks" in msg:
            phase["confirming"] = True

    table = measure_backends(tr, call, backends=["native", "_native_math"], warmup=1, repeats=3, clock=clock, log=log)
    assert table.pick == "native" and table.fastest_confirmed == "_native_math"
    assert table.pick_over_fastest > 1.03 and not table.confirmed
    # the stage's wiring refuses to add it
    mp.setattr(attention_backend, "measure_pipeline_backends", lambda pipe, run, **kw: table)
    ctx = SimpleNamespace(card=None, run=SimpleNamespace(stage_dir=lambda name: tmp_path / name))
    mp.setattr("ditbook.render.cases", lambda card: [("k", "p", 0)])
    mp.setattr("ditbook.render.call_kwargs", lambda pipe, card: {})
    said = []
    added = attention_backend.AttentionBackend.variants(ctx, SimpleNamespace(transformer=tr), [],
                                                        attention_backend.AttentionBackendSettings("auto"), log=said.append)
    data = json.loads((tmp_path / "benchmark" / attention_backend.BACKENDS_FILE).read_text())
    assert added == [] and data["confirmed"] is False and "not stable enough" in said[-1]


def test_gqa_shapes_from_the_inspection_reach_the_kernel_check():
    """With the inspection's GQA facts (fewer key/value heads), each backend's attention check runs
    grouped-query inputs, and the GQA paths (enable_gqa vs repeated K/V) are timed beside."""
    from ditbook.arch.report import ArchReport, AttentionFacts

    tr, call = tiny_flux()
    rep = ArchReport("T", None, 0, attention=AttentionFacts(heads=2, kv_heads=1, head_dim=16, image_seq_len=24,
                                                              text_seq_len=8))
    table = measure_backends(tr, call, report=rep, backends=["native"], warmup=1, repeats=1, log=lambda m: None)
    assert (table.heads, table.kv_heads, table.kernel_seq_len) == (2, 1, 32)
    assert table.row("native").kernel_psnr == 200.0  # the default against itself, on GQA inputs
    assert set(table.gqa["seconds"]) == {"enable_gqa", "repeat_interleave"} and table.gqa["seq_len"] == 32


def test_backend_pick_reads_the_cards_gates(registry, tmp_path):
    """The benchmark stage judges another backend by the card's gates, not by the default ones: a
    fast backend a little off the default passes loose gates and is picked; with stricter card gates
    the same measurement rejects it and the default stays."""
    from types import SimpleNamespace

    from ditbook.accel import attention_backend
    from ditbook.settings import Gates, ParallelSettings

    names, reg, mp = registry
    real_native, real_math = reg._backends[names.NATIVE], reg._backends[names._NATIVE_MATH]
    clock = VirtualClock()

    def native(**kw):
        clock.now += 10
        return real_native(**kw)

    def slightly_off(**kw):  # fast, and off by a small relative error (kernel ~70 dB)
        clock.now += 1
        out = real_math(**kw)
        return out + 5e-3 * out.abs().mean() * torch.sign(out)

    mp.setitem(reg._backends, names.NATIVE, native)
    mp.setitem(reg._backends, names._NATIVE_MATH, slightly_off)
    tr, call = tiny_flux()
    mp.setattr(attention_backend, "measure_pipeline_backends", lambda pipe, run, **kw: measure_backends(
        tr, call, backends=["native", "_native_math"], warmup=1, repeats=3, clock=clock, **kw))
    mp.setattr("ditbook.render.cases", lambda card: [("k", "p", 0)])
    mp.setattr("ditbook.render.call_kwargs", lambda pipe, card: {})

    def pick(psnr):
        card = SimpleNamespace(parallel=ParallelSettings(gates=Gates(psnr=psnr)))
        ctx = SimpleNamespace(card=card, run=SimpleNamespace(stage_dir=lambda name: tmp_path / name))
        added = attention_backend.AttentionBackend.variants(
            ctx, SimpleNamespace(transformer=tr), [], attention_backend.AttentionBackendSettings("auto"), log=lambda m: None)
        data = json.loads((tmp_path / "benchmark" / attention_backend.BACKENDS_FILE).read_text())
        return data, [c.name for c in added]

    loose, added = pick(20.0)
    assert loose["min_psnr"] == 20.0 and loose["pick"] == "_native_math" and added == ["attention:_native_math"]
    strict, added = pick(80.0)
    assert strict["min_psnr"] == 80.0 and strict["pick"] == "native" and added == []
    assert next(r for r in strict["rows"] if r["name"] == "_native_math")["status"] == "rejected"
