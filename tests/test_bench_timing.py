"""The timing harness on a fake pipeline (fast) and on a tiny random diffusers FluxPipeline."""

import math

import numpy as np
import pytest

from synthetic_run import FakePipeline, failing_config, noise_config
from ditbook.benchmark.measure import benchmark, count_transformer_flops
from ditbook.configuration import Config
from ditbook.timing import Stat, time_pipeline
from ditbook.render import make_generator, to_image


def fake_render(pipe, steps=3):
    return lambda prompt, seed: to_image(pipe(prompt=prompt, generator=make_generator(seed), num_inference_steps=steps))


CASES = [("p0_s0", "a red circle", 0), ("p1_s0", "a blue square", 0)]


def test_stat_median_min_max():
    s = Stat.of([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.spread == pytest.approx(1.0)
    assert Stat.of([]) is None


def test_time_pipeline_measures_every_part_and_restores_the_instance():
    pipe = FakePipeline()
    call = lambda: pipe(prompt="x", generator=make_generator(0), num_inference_steps=4)  # noqa: E731
    t = time_pipeline(pipe, call, warmup=1, repeats=3)
    assert t.end_to_end.n == 3
    assert t.parts["transformer_step"].n == 12  # 4 steps x 3 repeats
    assert t.transformer_calls == 4
    for part in ("text_encoding", "denoising", "vae_decode"):
        assert t.parts[part].n == 3 and t.parts[part].median > 0
    assert t.parts["denoising"].median <= t.end_to_end.median
    assert t.peak_memory_bytes > 0 and t.memory_kind == "rss_peak"
    # wrappers were per instance and are gone
    assert "encode_prompt" not in vars(pipe) and "decode" not in vars(pipe.vae)
    assert not pipe.transformer._forward_hooks and not pipe.transformer._forward_pre_hooks


def test_benchmark_ratios_quality_errors_and_undo():
    pipe = FakePipeline()
    configs = [noise_config("gentle", 1e-4), noise_config("rough", 0.3), failing_config("raises")]
    rep = benchmark(pipe, configs, fake_render(pipe), CASES, warmup=1, repeats=2, steps=3)
    assert rep.baseline.speedup == 1.0 and rep.baseline.quality["passed"]
    by = {c.name: c for c in rep.configs}
    assert by["gentle"].quality["passed"] and by["gentle"].speedup > 0
    assert math.isclose(by["gentle"].speedup,
                        rep.baseline.timing.end_to_end.median / by["gentle"].timing.end_to_end.median)
    assert not by["rough"].quality["passed"]
    assert by["raises"].error.startswith("RuntimeError") and by["raises"].timing is None
    assert pipe.noise == 0.0  # every configuration was undone
    assert rep.flops is not None and rep.flops.flops_per_call > 0 and rep.flops.calls_per_step == 1.0
    assert rep.baseline.efficiency.achieved_tflops > 0
    assert rep.noise_floor["psnr_min"] == 100.0
    d = rep.to_dict()
    assert d["configs"][0]["timing"]["parts"]["transformer_step"]["n"] == 6
    assert {r["config"] for r in rep.table()} == {"baseline", "gentle", "rough", "raises"}


def test_benchmark_efficiency_uses_peak_knob():
    pipe = FakePipeline()
    rep = benchmark(pipe, [], fake_render(pipe), CASES[:1], warmup=0, repeats=2, steps=3, peak_tflops=1.0)
    eff = rep.baseline.efficiency
    assert eff.peak_tflops == 1.0 and eff.share_of_peak == pytest.approx(eff.achieved_tflops)


def test_flops_of_linear_layers_are_counted_exactly():
    pipe = FakePipeline()
    call = lambda: pipe(prompt="x", generator=make_generator(0), num_inference_steps=2)  # noqa: E731
    est = count_transformer_flops(pipe, call, steps=2)
    # 3 Linear(16, 16) on 64 tokens: 2 * 64 * 16 * 16 each
    assert est.flops_per_call == 3 * 2 * 64 * 16 * 16
    assert est.calls_per_step == 1.0


@pytest.fixture(scope="module")
def tiny_flux():
    pytest.importorskip("transformers")
    from ditbook.zoo.flux import build_pipeline

    pipe = build_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_flux_parts_flops_and_diffusers_hook_config(tiny_flux):
    from ditbook.benchmark.inputs import hook_config
    from ditbook.benchmark.residuals import residual_changes

    pipe = tiny_flux
    kw = dict(num_inference_steps=3, height=32, width=32, guidance_scale=3.5, max_sequence_length=16,
              output_type="np")
    render = lambda p, s: to_image(pipe(prompt=p, generator=make_generator(s), **kw))  # noqa: E731
    cfg = hook_config({"hook": "first_block_cache", "threshold": 0.05})
    assert isinstance(cfg, Config) and cfg.family == "cache/first_block_cache"
    rep = benchmark(pipe, [cfg], render, CASES[:1], warmup=1, repeats=2, steps=3)
    base = rep.baseline.timing
    assert base.transformer_calls == 3
    for part in ("text_encoding", "denoising", "transformer_step", "vae_decode"):
        assert base.parts[part] is not None and base.parts[part].median > 0
    # matmul FLOPs counted on a real transformer call, grouped by operator
    assert rep.flops.flops_per_call > 0 and any("mm" in op for op in rep.flops.by_operator)
    res = rep.configs[0]
    assert res.error is None and res.timing is not None and res.quality is not None
    # the hook was removed again, and the baseline renders as before (within the CPU noise floor)
    assert not pipe.transformer.is_cache_enabled
    from ditbook.quality import psnr

    assert psnr(render(*CASES[0][1:]), rep.baseline.images["p0_s0"]) > 40
    assert "encode_prompt" not in vars(pipe) and "decode" not in vars(pipe.vae)
    rc = residual_changes(pipe, lambda: pipe(prompt="a red circle", generator=make_generator(0), **kw))
    assert rc["block"] == "transformer_blocks.0" and len(rc["changes"]) == 2
    assert all(c > 0 for c in rc["changes"])
