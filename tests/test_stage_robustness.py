"""Stage robustness (issue 23, items 1, 2, 4-7): a cache refusal lets the remaining stages run,
one failing plan does not sink the parallel stage, cache state does not outlive a generation,
``+cache`` plans that skip nothing fail, a drifting baseline gives "timing unstable", and the
checklist reads the same approval the stages accepted.

Tiny models built here (the pipeline of ``test_cache_models``) and the 2-process gloo runs of
``test_parallel_models``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import DiffusionPipeline, ModelMixin  # noqa: F401 (diffusers' loader looks them up in this module)

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_cache_models import TinyGQATransformer, TinyPipeline  # noqa: E402


class PlainPipeline(TinyPipeline):
    """The tiny flow-matching pipeline, from this file (a card names one source for both classes)."""


class RevisitingTransformer(TinyGQATransformer):
    """After its loop it runs the first block once more: the list is touched outside its loop, so
    a block cache cannot stand in for the list's calls and the adapter refuses (``CacheRefused``),
    while the model runs and its parallel plans apply."""

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        from test_cache_models import TinyOutput

        x = self.proj_in(hidden_states)
        context = self.context_in(encoder_hidden_states)
        temb = self.time_embed(timestep.reshape(-1, 1).to(x.dtype))
        for i, block in enumerate(self.blocks):
            context, x = block(x=x, context=context, temb=temb + self.block_embed[i])
        context, x = self.blocks[0](x=x, context=context, temb=temb)
        out = self.proj_out(self.norm_out(x))
        return (out,) if not return_dict else TinyOutput(sample=out)


def _card(tmp_path: Path, transformer: str, source: Path, **extra) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ditbook.card import import_class

    tcls = import_class(str(source), transformer)
    pcls = import_class(str(source), "PlainPipeline")
    torch.manual_seed(0)
    pcls(tcls(layers=4), FlowMatchEulerDiscreteScheduler()).save_pretrained(tmp_path / "model")
    data = {"name": f"tiny-{transformer.lower()}", "path": "model",
            "pipeline": {"class": "PlainPipeline", "source": str(source)},
            "transformer": {"class": transformer, "source": str(source)},
            "generation": {"prompts": ["a red square"], "seeds": [0], "height": 16, "width": 16, "steps": 4,
                           "holdout_seeds": [7]},
            "runtime": {"device": "cpu", "dtype": "float32"}, **extra}
    card = tmp_path / "card.yaml"
    card.write_text(yaml.safe_dump(data, sort_keys=False))
    return card


# -- item 1: a cache refusal, then the remaining stages ------------------------------------------

def test_cache_refusal_is_recorded_and_the_remaining_stages_run(tmp_path):
    from test_cache import prepared_run, session_for

    from ditbook.benchmark.inputs import discover_configs, read_inputs
    from ditbook.benchmark.stage import measure, save
    from ditbook.benchmark.verdict import headline
    from ditbook.cache.upstream import write_upstream
    from ditbook.context import open_stage
    from ditbook.parallel import feasibility
    from ditbook.parallel.stage import cache_refusal, choose_plans, stage_results

    card = _card(tmp_path, "RevisitingTransformer", Path(__file__))
    run, pipe, report = prepared_run(card, tmp_path / "outputs")
    s = session_for(card, run, pipe, report)
    assert s.refused and s.refused.startswith("CacheRefused") and "outside its loop" in s.refused, s.refused
    s.noise_floor(other_backend=False)
    s.adapter_checks(), s.calibrate(), s.tune(), s.choose(), s.reproduce()
    up = write_upstream(s)  # used to call block_adapter() on the refused adapter (AttributeError)
    assert up.example == "" and any("refused" in n for n in up.notes), up
    res = s.write_results()
    assert res.refused == s.refused and res.chosen is None

    # parallel: the plans without +cache, the +cache ones not run with the refusal as their reason
    ctx = open_stage(str(card), str(run.path), "parallel", {})
    table = feasibility(report, ctx.card)
    wanted, _ = choose_plans(table, 2, with_cache=True)
    assert any("+cache" in p for p in wanted), wanted  # without the refusal a +cache plan would run
    plans, not_run = choose_plans(table, 2, with_cache=True, cache_refused=cache_refusal(ctx))
    assert plans and not any("+cache" in p for p in plans), plans
    assert [n["name"] for n in not_run if "refused caching" in n["reason"]] == [p for p in wanted if "+cache" in p]
    ctx.write_results(stage_results(table, [], None, None, not_run, ctx.dir))

    # benchmark: no cache configuration; the verdict says why
    ctx = open_stage(str(card), str(run.path), "benchmark", {})
    inputs = read_inputs(ctx.run)
    configs = discover_configs(ctx, inputs, [])
    assert not [c for c in configs if c.family == "cache"]
    out = save(ctx, measure(ctx, pipe, configs, warmup=0, repeats=1), inputs)
    v = out.verdict
    assert v.name == "baseline" and not v.ship
    assert "refused caching" in v.reason, v.reason
    assert "refused caching" in headline(v)


# -- item 7: one approval state, read by the stages and the checklist ----------------------------

def test_checklist_reads_the_approval_the_stages_accepted(tmp_path):
    """The run begins unapproved (its card snapshot has no ``approved_plan``), the plan is approved
    afterwards (``ditbook approve --run RUN``), the cache stage accepts it: the checklist says so."""
    from test_cache import prepared_run, tiny_card

    from ditbook.benchmark.verdict import checklist, read_stage_results
    from ditbook.context import open_stage

    card = tiny_card(tmp_path, steps=2, seeds=(0,), prompts=("a red square",))
    run, _, _ = prepared_run(card, tmp_path / "outputs")  # intake, inspect, then approve
    assert not (run.read_meta()["card"] or {}).get("approved_plan")  # the snapshot predates the approval
    ctx = open_stage(str(card), str(run.path), "cache", {})
    plan = ctx.require_approved_plan()  # the stage accepts the approval
    item = {c["item"]: c for c in checklist(run.read_meta(), read_stage_results(run))}["plan approved"]
    assert item["ok"] is True and plan["hash"] in item["figure"], item


# -- item 5: a +cache plan whose cache skipped nothing fails -------------------------------------

def _launch_result(tmp_path, entries: dict):
    import numpy as np

    from ditbook.parallel.launch import LaunchResult

    img = np.full((8, 8, 3), 0.5)
    np.save(tmp_path / "img.npy", img)
    plans = {}
    for name, extra in entries.items():
        plans[name] = {"images": [{"key": "k", "npy": "img.npy"}], "median_seconds": 1.0,
                       "world_size": 1 if name.startswith("single") else 2, **extra}
    return LaunchResult(tmp_path, 2, 1.0, {"plans": plans}, [])


def test_a_cache_plan_that_skipped_nothing_fails_with_its_named_error(tmp_path):
    from ditbook.parallel.launch import judge

    split = {"sharding": {"error": None, "check": {"degree": 2}}}
    result = _launch_result(tmp_path, {
        "single": {}, "single+cache": {"cached_steps": []},
        "ulysses2+cache": {**split, "cached_steps": [], "cache_agreement": {"decisions": 6, "skips": 0}},
        "cfg2+cache": {"cached_steps": [2, 3],
                       "sharding": {"ranks": [{"block_inputs": {}}], "cfg_check": {"per_list": {}}}}})
    by = {r.name: r for r in judge(result, ["ulysses2+cache"])}
    r = by["ulysses2+cache"]
    assert r.quality.passed and not r.passed  # the images agree exactly: parity alone would pass it
    assert r.error.startswith("CacheSkippedNothing") and "ulysses2+cache" in r.error
    assert any("CacheSkippedNothing" in x for x in r.quality.reasons)
    # a cache that skipped steps is not failed by this check
    from ditbook.parallel.launch import cache_skip_failure
    from ditbook.parallel.plans import parse_plan

    assert cache_skip_failure(parse_plan("cfg2+cache"), result.worker["plans"]["cfg2+cache"]) is None
    assert cache_skip_failure(parse_plan("ulysses2+cache"), {"cache_agreement": {"skips": 3}}) is None
    assert cache_skip_failure(parse_plan("ulysses2"), {}) is None


# -- item 6: warm, repeated verdict rows; a drifting baseline gives "timing unstable" ------------

def test_a_drifting_baseline_gives_timing_unstable_instead_of_a_speedup():
    import time

    from ditbook.benchmark.measure import benchmark
    from synthetic_run import FakePipeline
    from ditbook.benchmark.verdict import checklist, headline, verdict
    from ditbook.configuration import Config
    from ditbook.render import make_generator, to_image

    pipe = FakePipeline()
    render = lambda prompt, seed: to_image(pipe(prompt=prompt, generator=make_generator(seed),  # noqa: E731
                                                num_inference_steps=2))
    calls = {"n": 0}

    def slow_from_now_on(pipe):  # the machine gets slower while the benchmark runs (a throttled GPU)
        def slow(module, args):
            time.sleep(0.3)
        pipe.transformer.register_forward_pre_hook(slow)  # never removed: the re-timed baseline is slower
        return lambda: None

    def counted(pipe):
        calls["n"] = 0
        handle = pipe.transformer.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
        return handle.remove

    configs = [Config("chosen[x=1]", "cache", counted), Config("throttle", "cache/fake", slow_from_now_on)]
    rep = benchmark(pipe, configs, render, [("p0_s0", "a", 0)], warmup=0, repeats=1, count_flops=False,
                    verdict_rows={"chosen[x=1]"}, drift_limit=0.10)
    # the card's warmup 0 / repeats 1 are raised for the baseline and the verdict's row, not for the rest
    assert rep.baseline.timing.end_to_end.n == 3
    by = {c.name: c for c in rep.configs}
    assert by["chosen[x=1]"].timing.end_to_end.n == 3 and by["throttle"].timing.end_to_end.n == 1
    assert calls["n"] == 2 * (1 + 1 + 3)  # 2 steps x (quality render + warm-up + 3 repeats)
    t = rep.to_dict()["timing"]
    assert t["stable"] is False and t["drift"] > 2 and (t["warmup"], t["repeats"]) == (1, 3), t

    from records_fixtures import cache_record, holdout_row

    from ditbook.records import BenchmarkResults, ConfigRow, TimingState, decode

    data = rep.to_dict()
    rows = [decode(ConfigRow, c, "configs") for c in data["configs"]]
    for r in rows:
        if r.name == "chosen[x=1]":
            r.speedup, r.psnr_min, r.ssim_min, r.passed = 1.9, 40.0, 0.99, True
    bench = BenchmarkResults(device="cpu", warmup=0, repeats=1, baseline=decode(ConfigRow, data["baseline"], "b"),
                             configs=rows, timing=decode(TimingState, data["timing"], "timing"))
    # skipping 0.9 of the block work is consistent with the 1.9x claimed below (half of it could not
    # give 1.9x at this baseline's denoising share)
    row = holdout_row("chosen", {"x": 1}, 40.0, 0.99, 0.9)
    cache = cache_record([row], chosen=row)
    v = verdict(bench, cache)
    assert not v.ship and v.speedup is None and "timing unstable" in v.reason
    assert "timing unstable" in headline(v) and "1.90" not in headline(v)
    assert f"{t['drift']:.3f}" in headline(v)
    item = {c["item"]: c for c in checklist({}, {"benchmark": bench, "cache": cache}, v)}["timing stable"]
    assert item["ok"] is False and "timing unstable" in item["figure"] and f"{t['drift']:.3f}" in item["figure"]
    # the same record within the bound, and the chosen row's timings as fast as its 1.9x says (here the
    # stand-in row does nothing, so its real timings would allow a slowdown): reported, the row green
    bench.timing.drift, bench.timing.stable = 1.02, True
    base = bench.baseline.timing["end_to_end"]
    base.update(min=base["median"], max=base["median"])  # a steady baseline, its row 1.9x as fast
    bench.row("chosen[x=1]").timing["end_to_end"].update(min=base["median"] / 1.9, max=base["median"] / 1.9)
    v = verdict(bench, cache)
    assert v.ship and v.speedup == 1.9
    assert {c["item"]: c for c in checklist({}, {"benchmark": bench, "cache": cache}, v)}["timing stable"]["ok"]


# -- item 2: one plan failing in the ranks does not sink the others ------------------------------

@pytest.mark.slow
def test_a_plan_failing_in_one_rank_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    """2 gloo processes, plans cfg2, ulysses2, ring2: rank 1 raises inside ulysses2's renders while
    rank 0 waits in a collective. cfg2 (finished before) is kept, ulysses2 is recorded as failed with
    its named error, ring2 runs in the next launch; parallel/results.json can be written."""
    import test_parallel_models as models

    from ditbook.parallel import run_plans

    card = models.tiny_thirdparty(tmp_path)
    monkeypatch.setenv("DITBOOK_PARALLEL_RAISE", "1:2:ulysses2")
    results, launch = run_plans(card, ["cfg2", "ulysses2", "ring2"], 2, tmp_path / "run", timeout=60)
    by = {r.name: r for r in results}
    assert list(by) == ["cfg2", "ulysses2", "ring2"]
    assert by["cfg2"].passed and by["ring2"].passed, (by["cfg2"].error, by["ring2"].error)
    bad = by["ulysses2"]
    assert not bad.passed and bad.error.startswith("InjectedFault") and "(rank 1)" in bad.error, bad.error
    assert bad.quality is None and bad.seconds is None  # no figures: its named error says why
    assert [a["failed"] for a in launch.attempts] == ["ulysses2", None]
    assert launch.attempts[1]["plans"] == ["single", "ring2"]  # the rest, with its reference again
    assert (tmp_path / "run" / "launch.1.log").is_file() and (tmp_path / "run" / "launch.log").is_file()


# -- item 4: no cache state outlives a generation; order dependence is caught --------------------

@pytest.fixture(scope="module")
def fbc_setup(tmp_path_factory):
    """The tiny GQA model (a transformer without diffusers' CacheMixin, a pipeline that sets no
    cache context) with ditbook's adapter; two seeds of one prompt."""
    from test_cache import tiny_card

    from ditbook.adapter.build import build_cache_adapter
    from ditbook.card import load_card
    from ditbook.inspect.stage import run_inspection
    from ditbook.loading import choose_placement, load_pipeline

    tmp = tmp_path_factory.mktemp("fbc")
    card = load_card(tiny_card(tmp, steps=6, seeds=(0, 1), prompts=("a red square",)))
    pipe = load_pipeline(card, choose_placement(card))
    assert not hasattr(pipe.transformer, "_reset_stateful_cache")  # no CacheMixin: nobody resets its hooks
    adapter = build_cache_adapter(pipe, run_inspection(pipe, card, steps=2).report, card.name)
    return card, pipe, adapter


def _fbc_renders(card, pipe, adapter, seeds):
    from ditbook import accel
    from ditbook.cache.verify import render_set

    strat = accel.get("diffusers_fbc")
    undo = strat.apply(pipe, strat.settings(threshold=0.5), adapter=adapter, steps=card.generation.steps)
    try:
        return render_set(pipe, card, card.generation.prompts, seeds)
    finally:
        undo()


def test_first_block_cache_on_a_transformer_without_cachemixin_is_order_independent(fbc_setup):
    import numpy as np

    from ditbook.cache.verify import render_set

    card, pipe, adapter = fbc_setup
    cls = type(pipe)
    plain = render_set(pipe, card, card.generation.prompts, [1])["p0_s1"]
    after = _fbc_renders(card, pipe, adapter, [0, 1])["p0_s1"]  # seed 1 rendered after seed 0
    alone = _fbc_renders(card, pipe, adapter, [1])["p0_s1"]  # seed 1 rendered alone
    assert np.abs(alone - plain).max() > 1e-4  # the cache skipped something: the test can see a leak
    assert np.array_equal(after, alone)  # used to differ: video 2's first step reused video 1's residual
    assert type(pipe) is cls and "__call__" not in vars(pipe)  # the per-call reset came off exactly


def test_an_order_dependent_cache_stops_with_a_named_error(fbc_setup, monkeypatch):
    from ditbook import accel
    from ditbook.accel import _diffusers_hooks
    from ditbook.cache.verify import OrderDependentCache, order_check

    card, pipe, adapter = fbc_setup
    strat = accel.get("diffusers_fbc")
    cfg = strat.settings(threshold=0.5)
    in_order = _fbc_renders(card, pipe, adapter, [0, 1])
    rec = order_check(pipe, card, adapter, "diffusers_fbc", cfg, in_order, card.generation.prompts, [0, 1])
    assert rec["order_independent"] and rec["case"] == "p0_s1" and rec["rendered_after"] == "p0_s0"
    # one case: rendered alone, and after the next seed's in one application
    one = order_check(pipe, card, adapter, "diffusers_fbc", cfg, {"p0_s0": in_order["p0_s0"]},
                      card.generation.prompts, [0])
    assert one["order_independent"] and one["rendered_after"] == "seed 1" and one["max_abs"] == 0.0
    # the same cache with its state kept from one generation to the next (no reset per call)
    monkeypatch.setattr(_diffusers_hooks, "reset_hook_states", lambda transformer: None)
    leaky = _fbc_renders(card, pipe, adapter, [0, 1])
    with pytest.raises(OrderDependentCache, match="differently alone than after p0_s0"):
        order_check(pipe, card, adapter, "diffusers_fbc", cfg, leaky, card.generation.prompts, [0, 1])


def test_wrap_call_runs_on_instance_calls_only_and_comes_off_exactly():
    import inspect

    from ditbook import hooks

    class Pipe:
        def __call__(self, prompt: str = "", steps: int = 2):
            return prompt, steps

    a, b, seen = Pipe(), Pipe(), []
    first = hooks.wrap_call(a, "one", lambda original, *args, **kw: (seen.append(1), original(*args, **kw))[1])
    second = hooks.wrap_call(a, "two", lambda original, *args, **kw: (seen.append(2), original(*args, **kw))[1])
    assert a("x") == ("x", 2) and b("y") == ("y", 2) and seen == [2, 1]  # a(...) runs them; b is untouched
    assert isinstance(a, Pipe) and type(a).__name__ == "Pipe" and type(b) is Pipe
    assert list(inspect.signature(a.__call__).parameters) == ["prompt", "steps"]
    first.remove()
    assert a("z") == ("z", 2) and seen == [2, 1, 2] and type(a) is not Pipe
    second.remove()
    assert type(a) is Pipe and "__call__" not in vars(a) and not hooks.is_wrapped(a, None, "__call__")



def test_a_pipeline_named_like_a_registered_one_does_not_get_its_cfg_guess():
    """cache-dit guesses ``enable_separate_cfg``, when a config leaves it unset, from its adapters
    matched by pipeline-class-name prefix: a third-party ``FluxReference...Pipeline`` got cache-dit's
    FLUX adapter built on a model without ``transformer_blocks`` (AttributeError in the cache stage's
    upstream example; tests/novel ``fluxref`` end to end). ditbook's BlockAdapter states its own CFG
    style on the config, so the registry is never asked."""
    import cache_dit
    import torch
    from cache_dit.caching.block_adapters.block_registers import BlockAdapterRegister
    from diffusers import DiffusionPipeline

    from ditbook.accel.dbcache import cfg_from_adapter

    class FluxLookalikePipeline(DiffusionPipeline):  # a name the prefix registry matches ("Flux")
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    with pytest.raises(AttributeError, match="transformer_blocks"):  # what cache-dit does unasked
        BlockAdapterRegister.has_separate_cfg(FluxLookalikePipeline(torch.nn.Linear(2, 2)))

    def block_adapter(separate: bool):
        ba = cache_dit.BlockAdapter.__new__(cache_dit.BlockAdapter)
        ba.has_separate_cfg = separate
        return ba

    assert cfg_from_adapter(cache_dit.DBCacheConfig(), block_adapter(False)).enable_separate_cfg is False
    assert cfg_from_adapter(cache_dit.DBCacheConfig(), block_adapter(True)).enable_separate_cfg is True
    given = cache_dit.DBCacheConfig(enable_separate_cfg=True)
    assert cfg_from_adapter(given, block_adapter(False)).enable_separate_cfg is True  # a set value stays
    assert cfg_from_adapter(cache_dit.DBCacheConfig(), object()).enable_separate_cfg is None  # a pipe: cache-dit's
