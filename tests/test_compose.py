"""Composed plans (issue 16 item 1): a static cache schedule with Ulysses, CFG parallel, compile,
and CUDA graphs of the computed steps.

On the CPU: ``+compile`` runs with the ``aot_eager`` backend (``runtime.compile``: dynamo
traces the same regions through the parallel hooks, no kernels are generated); ``+graph`` needs
CUDA and is refused before launch, with a dynamic cache also on a GPU. The graphs of the computed
steps are checked in one process with a capturer that replays like a graph does."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._pytree import tree_flatten

from ditbook.parallel import run_plans
from ditbook.accel.dbcache import dbcache_config
from ditbook.cp.cache_sync import static_schedule
from ditbook.accel.graphs import GraphUnavailable, cache_graph_refusal, install_cached_step_graphs, static_cache_mask
from ditbook.parallel.launch import PlanRefused

import test_parallel_models as models
from test_graphs import ReplayLikeAGraph

launch_mod = importlib.import_module("ditbook.parallel.launch")
MASK6 = [1, 1, 0, 1, 0, 1]


class StaleReplay(ReplayLikeAGraph):
    """A broken graph: a replay does not recompute, so every computed step returns the captured
    step's output — what a graph that missed its inputs would do."""

    def capture(self, fn):
        self.captures += 1
        out = fn()
        return (lambda: None), out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("compose_models")


def test_static_schedule_is_recognised_and_a_dynamic_one_refused_with_the_reason():
    opts = static_schedule(MASK6)
    assert static_cache_mask(opts) == MASK6 and cache_graph_refusal(opts, 6) is None
    assert static_cache_mask(None) is None
    dynamic = {"residual_diff_threshold": 0.12}
    assert "static cache schedule" in cache_graph_refusal(dynamic, 6)
    assert "static cache schedule" in cache_graph_refusal({**opts, "steps_computation_policy": "dynamic"}, 6)
    assert "6 entries and the generation 8 steps" in cache_graph_refusal(opts, 8)
    assert "computes no step" in cache_graph_refusal(static_schedule([0] * 6), 6)


def _flux(steps=8):
    from speedsuite.fullsize import flux_pipeline

    return flux_pipeline("tiny", "cpu", torch.float32, height=32, width=32, steps=steps, text_tokens=16)


def test_graphs_of_the_computed_steps_replay_the_static_schedule_exactly():
    import cache_dit

    mask = [1, 1, 1, 0, 1, 0, 0, 1]
    opts = static_schedule(mask)
    fp = _flux()
    with torch.inference_mode():
        cache_dit.enable_cache(fp.pipe, cache_config=dbcache_config(opts))
        ref = fp(seed=1).images[0]
        cap = ReplayLikeAGraph()
        g = install_cached_step_graphs(fp.pipe.transformer, opts, steps=8, warmup=1, capturer=cap)
        got = fp(seed=1).images[0]
        again = fp(seed=1).images[0]
        d = g.to_dict()
        g.remove()
        after = fp(seed=1).images[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    # one graph per cached unit, replayed on every computed step after the warm-up: 2 runs x 5 computed
    assert d["captured"] == len(d["units"]) == cap.captures >= 1 and d["disabled"] is None, d
    assert d["eager_calls"] == 1 and d["replays"] == 2 * sum(mask) - 1, d
    assert d["computed_steps"] == 5 and d["steps"] == 8


def test_a_stale_graph_changes_the_image_so_the_check_can_fail():
    import cache_dit

    opts = static_schedule([1, 1, 1, 0, 1, 0, 0, 1])
    fp = _flux()
    with torch.inference_mode():
        cache_dit.enable_cache(fp.pipe, cache_config=dbcache_config(opts))
        ref = fp(seed=1).images[0]
        install_cached_step_graphs(fp.pipe.transformer, opts, steps=8, warmup=1, capturer=StaleReplay())
        got = fp(seed=1).images[0]
    assert (got - ref).abs().max() > 1e-3


def test_graphs_of_cached_steps_are_refused_off_the_gpu_and_with_a_dynamic_cache():
    import cache_dit

    fp = _flux(steps=6)
    with pytest.raises(GraphUnavailable, match="static cache schedule"):
        install_cached_step_graphs(fp.pipe.transformer, {"residual_diff_threshold": 0.1}, steps=6,
                                   capturer=ReplayLikeAGraph())
    cache_dit.enable_cache(fp.pipe, cache_config=dbcache_config(static_schedule(MASK6)))
    with pytest.raises(GraphUnavailable, match=r"\+graph replays CUDA work.*cpu"):
        install_cached_step_graphs(fp.pipe.transformer, static_schedule(MASK6), steps=6)
    plain = _flux(steps=6)  # no cache enabled: no cached unit to graph
    with pytest.raises(GraphUnavailable, match="cached block units were not found"):
        install_cached_step_graphs(plain.pipe.transformer, static_schedule(MASK6), steps=6,
                                   capturer=ReplayLikeAGraph())


def test_cache_graph_plans_are_refused_before_launch(root, tmp_path, monkeypatch):
    card = models.tiny_flux(root)
    launched = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: launched.append(a))
    # a dynamic cache: refused with the reason even where a GPU is present
    monkeypatch.setattr(launch_mod, "_cuda_available", lambda: True)
    with pytest.raises(PlanRefused, match=r"ulysses2\+cache\+compile\+graph.*static cache schedule"):
        run_plans(card, ["ulysses2+cache+compile+graph"], 2, tmp_path,
                  overrides={"parallel.cache": {"residual_diff_threshold": 0.2}})
    # a static schedule on a machine without CUDA: refused for the GPU, naming it
    monkeypatch.setattr(launch_mod, "_cuda_available", lambda: False)
    with pytest.raises(ValueError, match=r"ulysses2\+cache\+compile\+graph.*no CUDA GPU"):
        run_plans(card, ["ulysses2+cache+compile+graph"], 2, tmp_path,
                  overrides={"generation.steps": 6, "parallel.cache": static_schedule(MASK6)})
    assert not launched


@pytest.mark.slow
def test_ulysses_and_cfg_with_a_static_cache_and_compile_pass_parity(root, tmp_path):
    """2 gloo processes: ``ulysses2+cache+compile`` and ``cfg2+cache+compile`` against the one-process
    run of the same static schedule; the schedule's cached steps and the split are recorded."""
    card = models.tiny_flux(root, true_cfg=True)
    ov = {"generation.steps": 6, "parallel.cache": static_schedule(MASK6), "runtime.compile": "aot_eager"}
    plans = ["ulysses2+cache+compile", "cfg2+cache+compile"]
    results, _ = run_plans(card, plans, 2, tmp_path, overrides=ov, timeout=120)
    by = {r.name: r for r in results}
    for name in plans:
        r = by[name]
        assert r.passed, (name, r.quality.reasons)
        assert r.reference == "single+cache"
        assert r.details["compiled"].endswith("(aot_eager)"), r.details["compiled"]
        # the static mask decided: steps 2 and 4 (0-based) reuse the cache, per branch of true CFG
        assert set(r.details["cached_steps"]) == {2, 4}, r.details["cached_steps"]
        assert r.baseline_quality is not None
    assert by["ulysses2+cache+compile"].details["sharding"].check, by["ulysses2+cache+compile"].details["sharding"]
    assert by["cfg2+cache+compile"].details["cfg_stats"]["exchanges"] > 0


@pytest.mark.slow
def test_graphs_of_the_computed_steps_under_ulysses_replay_exactly(tmp_path):
    """cache-dit's Ulysses wraps the transformer's forward in diffusers' hook registry over cache-dit's
    cached forward: the cached units must still be found, and the replayed images equal the plain ones."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    out = tmp_path / "graphs.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent / "lib"), str(here.parent / "benchmarks"),
                                                         str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           str(here / "compose_ulysses_graphs.py"), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["max_diff"] == 0.0, res
    g = res["graphs"]
    assert g["captured"] == 1 and g["disabled"] is None and g["replays"] == 2 * res["computed"] - 2, g
    assert res["agreement"]["disagreements"] == 0 and res["agreement"]["skips"] > 0
