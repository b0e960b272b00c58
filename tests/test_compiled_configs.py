"""Compiled configurations: the repeated blocks really are compiled (a counting torch.compile
backend sees them), the undo removes every compiled region, the inner configuration is applied
and undone with it, and the one-time compile cost is recorded."""

from __future__ import annotations

import pytest
import torch

from ditbook.accel.compile import CompileSettings, compile_regions, compile_settings, compiled_config
from ditbook.configuration import Config, baseline_config


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                                guidance_embeds=False, axes_dims_rope=(4, 6, 6)).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 64, 16, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
              pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
              img_ids=torch.zeros(64, 3), txt_ids=torch.zeros(8, 3))
    return tr, kw


class CountingBackend:
    """A torch.compile backend that runs the traced graph as is and counts compilations."""

    def __init__(self):
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


def _compiled_modules(module):
    return [n for n, m in module.named_modules() if m.__dict__.get("_compiled_call_impl") is not None]


def test_repeated_blocks_are_compiled_and_undone_exactly():
    torch._dynamo.reset()
    tr, kw = tiny_flux()
    with torch.inference_mode():
        ref = tr(**kw).sample.clone()
    backend = CountingBackend()
    undo, method, regions = compile_regions(tr, backend=backend)
    assert method == "compile_repeated_blocks" and regions == 2
    assert _compiled_modules(tr) == ["transformer_blocks.0", "single_transformer_blocks.0"]
    with torch.inference_mode():
        out = tr(**kw).sample
    assert backend.graphs >= 2 and backend.runs >= 2  # both blocks went through the compiler
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    undo()
    assert _compiled_modules(tr) == [] and not any("_compiled_call_impl" in m.__dict__ for m in tr.modules())
    runs = backend.runs
    with torch.inference_mode():
        assert torch.equal(tr(**kw).sample, ref)
    assert backend.runs == runs  # after the undo nothing runs compiled


class AttnBlock(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ff = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.ff(self.attn(x, x, x, need_weights=False)[0])


class NoRepeatedBlocks(torch.nn.Module):  # third-party: no _repeated_blocks, no compile_repeated_blocks
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([AttnBlock(), AttnBlock()])
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_block_lists_of_the_inspection_are_compiled_without_repeated_blocks():
    torch._dynamo.reset()
    m = NoRepeatedBlocks().eval()
    undo, method, regions = compile_regions(m, backend="eager")
    assert method == "block lists: layers" and regions == 2
    assert _compiled_modules(m) == ["layers.0", "layers.1"]
    undo()
    assert _compiled_modules(m) == []


def test_model_without_blocks_is_refused_and_left_as_it_was():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no block lists"):
        compile_regions(m, backend="eager")
    assert _compiled_modules(m) == []


def test_parallel_compile_is_the_same_regional_helper(monkeypatch):
    # the parallel stage's +compile and the benchmark's compiled rows compile through one helper
    from ditbook.accel import compile as regional
    from ditbook.parallel.worker import compile_repeated_blocks

    torch._dynamo.reset()
    calls = []
    real = regional.compile_regions
    monkeypatch.setattr(regional, "compile_regions", lambda tr, **kw: calls.append(kw) or real(tr, **kw))
    m = NoRepeatedBlocks().eval()
    assert compile_repeated_blocks(m, backend="eager") == "block lists: layers (eager)"
    assert calls == [{"backend": "eager"}] and _compiled_modules(m) == ["layers.0", "layers.1"]
    with pytest.raises(RuntimeError, match=r"\+compile: .*no block lists"):
        compile_repeated_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend="eager")


def test_compiled_config_applies_the_inner_config_and_records_the_compile_cost():
    torch._dynamo.reset()
    tr, kw = tiny_flux()
    pipe = type("Pipe", (), {})()
    pipe.transformer = tr
    log = []

    def inner_apply(p):
        log.append("on")
        return lambda: log.append("off")

    backend = CountingBackend()
    cfg = compiled_config(Config("cache-x", "cache/x", inner_apply, params={"k": 1}), backend=backend, probe_calls=3)
    assert cfg.name == "cache-x+compile" and cfg.family == "cache/x" and cfg.params["k"] == 1
    row_params = dict(cfg.params)  # what the benchmark harness copies before applying
    undo = cfg.apply(pipe)
    assert log == ["on"] and _compiled_modules(tr)
    with torch.inference_mode():
        for _ in range(4):
            tr(**kw)
    undo()
    assert log == ["on", "off"] and _compiled_modules(tr) == []
    assert "_ditbook_wraps" not in tr.__dict__ or not tr.__dict__["_ditbook_wraps"]
    stats = row_params["compile"]  # filled in place: the result row carries it
    assert stats["method"] == "compile_repeated_blocks" and stats["regions"] == 2
    assert stats["probe_calls"] == 3 and stats["compile_s"] >= 0 and stats["first_call_s"] >= stats["steady_call_s"]
    assert backend.graphs >= 2
    base = compiled_config(baseline_config(), backend="eager")
    # compiling must not change the result: the "compile" family is judged by the parallel gates
    from ditbook.benchmark.summary import gates_for_family
    from ditbook.settings import ParallelSettings
    assert base.family == "compile" and base.gates is None
    assert gates_for_family(base.family) == ParallelSettings().gates


def test_the_one_compile_setting_is_read_and_checked():
    assert compile_settings(None) is None and compile_settings(False) is None
    assert compile_settings(True) == CompileSettings() and compile_settings("eager") == CompileSettings(backend="eager")
    assert compile_settings({"backend": "aot_eager", "decoder": True}) == CompileSettings(backend="aot_eager", decoder=True)
    with pytest.raises(ValueError, match=r"runtime.compile.turbo: unknown key"):
        compile_settings({"backend": "eager", "turbo": 1})
    with pytest.raises(ValueError, match=r"runtime.compile.probe_calls: must be an integer"):
        compile_settings({"probe_calls": "many"})
    with pytest.raises(ValueError):
        compile_settings(3)


def test_cache_stage_measures_the_chosen_configuration_compiled(tmp_path):
    """The cache stage's compiled check on the third-party tiny model (its block lists, no
    ``_repeated_blocks``): same images as uncompiled, times and compile cost recorded, everything
    undone; with no chosen configuration it says so instead."""
    from ditbook import accel
    from test_cache import prepared_run, session_for, tiny_card

    card = tiny_card(tmp_path)
    run, pipe, report = prepared_run(card, tmp_path / "outputs")
    s = session_for(card, run, pipe, report)
    from ditbook.records import Chosen, CompiledCheck

    assert s.compiled_check("eager") == CompiledCheck(reason="no configuration passed on held-out cases")
    strat = accel.get("dbcache")
    s.chosen = Chosen("dbcache", strat.family, strat.settings_dict(strat.Settings(Fn=1, threshold=0.08, max_warmup_steps=1)))
    counting = CountingBackend()
    out = s.compiled_check(CompileSettings(backend=counting))
    assert counting.graphs >= 1 and counting.runs > 0  # the blocks really ran compiled
    assert out.ok and out.quality["passed"] and out.method == "block lists: blocks" and out.regions > 0
    assert out.compiled_s > 0 and out.eager_s > 0 and out.compile_s >= 0
    assert not any("_compiled_call_impl" in m.__dict__ for m in pipe.transformer.modules())
    assert "forward" not in pipe.transformer.__dict__
    assert s.write_results().compiled.ok


def test_compile_cost_estimate_is_not_fooled_by_cheap_cached_steps():
    from ditbook.accel.compile import CompileProbe

    probe = CompileProbe(calls=7, cuda=False)
    probe.times = [5.0, 1.0, 0.1, 1.0, 0.1, 1.0, 10.0]  # compile, computed/cached steps, one recompile
    s = probe.summary()
    assert s["compile_s"] == 4.0 and s["steady_call_s"] == 1.0 and s["slow_later_calls"] == 1
    assert CompileProbe(calls=3, cuda=False).summary()["compile_s"] is None
