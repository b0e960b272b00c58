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
    assert res["refused"] == s.refused and res["chosen"] is None

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
    v = out["verdict"]
    assert v["name"] == "baseline" and not v["ship"]
    assert "refused caching" in v["reason"] and "no cache configuration passed" in v["reason"]
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
    assert r.quality["passed"] and not r.passed  # the images agree exactly: parity alone would pass it
    assert r.error.startswith("CacheSkippedNothing") and "ulysses2+cache" in r.error
    assert any("CacheSkippedNothing" in x for x in r.quality["reasons"])
    # a cache that skipped steps is not failed by this check
    from ditbook.parallel.launch import cache_skip_failure
    from ditbook.parallel.plans import parse_plan

    assert cache_skip_failure(parse_plan("cfg2+cache"), result.worker["plans"]["cfg2+cache"]) is None
    assert cache_skip_failure(parse_plan("ulysses2+cache"), {"cache_agreement": {"skips": 3}}) is None
    assert cache_skip_failure(parse_plan("ulysses2"), {}) is None
