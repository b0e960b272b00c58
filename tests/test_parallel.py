"""Parallel stage: plans, feasibility, GQA timing, and real 2-process gloo runs with parity.

Multi-process runs go through torchrun with gloo on the CPU; each launch runs the one-process
baseline and several plans in the same processes, so a launch costs one start-up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from ditbook.arch.report import ArchReport, AttentionFacts, CfgFacts, SupportFacts
from ditbook.card import load_card
from ditbook.parallel import ParallelRunError, feasibility, parse_plan, run_plans
from ditbook.cp.attention import time_gqa
from ditbook.cp.plan import load_plan_code
from ditbook.parallel.plans import PlanNameError

import test_parallel_models as models

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "models" / "reference.yaml"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel_models")


def _report(heads=4, kv=4, style="separate", kind="joint", s_img=16, s_txt=8, cp=True) -> ArchReport:
    return ArchReport(transformer_class="X", pipeline_class="Y", param_count=1,
                      attention=AttentionFacts(heads=heads, kv_heads=kv, head_dim=16, gqa_ratio=heads / kv,
                                               kind=kind, image_seq_len=s_img, text_seq_len=s_txt),
                      cfg=CfgFacts(style=style, calls_per_step=2.0 if style == "separate" else 1.0),
                      support=SupportFacts(diffusers_cp_plan=cp))


def _assert_passed(results, names):
    by = {r.name: r for r in results}
    for n in names:
        r = by[n]
        print(f"{n}: PSNR {r.quality.psnr_min} dB, SSIM {r.quality.ssim_min}, "
              f"worst tile {r.quality.worst_tile_psnr}, speedup {r.speedup:.2f}")
        assert r.passed, (n, r.quality.reasons)
        assert r.quality.psnr_min > 35 and r.quality.ssim_min > 0.90
        assert r.quality.worst_tile_psnr > 25
        assert r.seconds and r.seconds > 0 and r.speedup and r.speedup > 0
    return by


# -- pure functions ------------------------------------------------------------------------

def test_plan_names():
    p = parse_plan("cfg2_ulysses2+cache")
    assert (p.cfg, p.ulysses, p.ring, p.cache, p.world_size) == (2, 2, 1, True, 4)
    assert parse_plan("usp2x4").world_size == 8
    with pytest.raises(PlanNameError, match="cfg is 2"):
        parse_plan("cfg4")
    with pytest.raises(PlanNameError, match="cannot read"):
        parse_plan("zigzag2")


def test_feasibility_reasons(root):
    card = load_card(models.tiny_flux(root))
    t = feasibility(_report(heads=6, kv=2, style="none"), card, device="cpu")
    assert not t.get("cfg", 2).feasible and "no second branch" in t.get("cfg", 2).reason
    assert t.get("ulysses", 2).feasible and "KV heads" not in t.get("ulysses", 2).reason
    u4 = t.get("ulysses", 4)
    assert not u4.feasible and "6 query heads not divisible by 4" in u4.reason
    assert t.get("ring", 2).feasible and "ditbook's ring attention" in t.get("ring", 2).reason  # any device
    assert not t.get("ulysses_x_ring", 4).feasible  # cache-dit's ring inside USP: CUDA only
    g = feasibility(_report(heads=8, kv=2), card, device="cuda")
    assert g.get("ulysses", 4).feasible and "KV heads not divisible by 4" in g.get("ulysses", 4).reason
    assert g.get("ring", 2).feasible
    assert g.get("ulysses_x_ring", 8).feasible and g.get("ulysses_x_ring", 8).plan == "usp2x4"
    assert g.get("cfg_x_ulysses", 8).plan == "cfg2_ulysses4"
    tp = g.get("tp", 4)
    assert not tp.feasible and tp.reason.startswith("GQA: 2 KV heads not divisible by 4")
    assert g.get("text_encoder", 2).feasible and g.get("text_encoder", 2).plan == "te2"
    odd = feasibility(_report(s_img=18), card, device="cuda").get("ulysses", 4)
    assert odd.feasible and "18 image tokens" in odd.reason and "split unevenly" in odd.reason  # ulysses_anything


def test_infeasible_plan_is_refused_not_launched(root, tmp_path, capsys, no_launch):
    from ditbook.cli import main

    card = models.tiny_flux(root)
    arch = tmp_path / "arch.json"
    _report(heads=3, kv=3, style="none").save(arch)
    rc = main(["parallel", str(card), "--plan", "ulysses2", "--plan", "cfg2", "--nproc", "2",
               "--arch", str(arch), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 3
    assert "ulysses2: not feasible — 3 query heads not divisible by 2" in err
    assert "cfg2: not feasible" in err and "no second branch" in err
    assert not (tmp_path / "out").exists()


def test_gqa_timing_records_both_paths():
    """Both paths timed, their results equal (a path whose result differed would be in ``errors``,
    not timed), the faster one the one of the smaller median, the ratio slower / faster."""
    t = time_gqa(8, 2, 16, 64, repeats=3, warmup=1)
    assert set(t.seconds) == {"enable_gqa", "repeat_interleave"} and t.errors == {}, t.errors
    assert set(t.spread) == set(t.seconds) and all(s >= 0 for s in t.spread.values())
    assert t.faster == min(t.seconds, key=t.seconds.get)
    assert t.ratio == pytest.approx(max(t.seconds.values()) / min(t.seconds.values()))
    assert t.device == "cpu"


# -- multi-process runs (2 processes, gloo) -----------------------------------------------

def test_flux_ulysses_cfg_and_cache_with_ulysses(root, tmp_path):
    """Tiny Flux with true CFG: Ulysses (registered plan), CFG parallel, cache + Ulysses."""
    card = models.tiny_flux(root, true_cfg=True)
    # a random model changes ~0.4-0.6 between steps: a threshold above that makes skips certain
    ov = {"generation.steps": 6, "parallel.cache": {"residual_diff_threshold": 1.0, "max_warmup_steps": 1}}
    results, launch = run_plans(card, ["ulysses2", "cfg2", "ulysses2+cache"], 2, tmp_path, overrides=ov,
                                timeout=60)
    by = _assert_passed(results, ["ulysses2", "cfg2", "ulysses2+cache"])
    assert by["ulysses2"].details["cp_plan"]["source"] == "diffusers:FluxTransformer2DModel._cp_plan"
    assert by["cfg2"].details["cfg_style"] == "separate" and by["cfg2"].details["cfg_stats"]["exchanges"] > 0
    agree = by["ulysses2+cache"].details["cache_agreement"]
    assert agree["decisions"] > 0 and agree["skips"] > 0 and agree["disagreements"] == 0
    assert by["ulysses2+cache"].reference == "single+cache"
    assert (tmp_path / "ulysses2" / "p0_s0.png").is_file()


def test_qwenimage_cfg_parallel(root, tmp_path):
    results, _ = run_plans(models.tiny_qwenimage(root), ["cfg2"], 2, tmp_path, timeout=60)
    by = _assert_passed(results, ["cfg2"])
    assert by["cfg2"].details["cfg_stats"]["skipped"] > 0


def test_thirdparty_derived_cp_plan(root, tmp_path):
    """No planner exists: the plan is derived, written as code, and runs through the SDPA route."""
    results, launch = run_plans(models.tiny_thirdparty(root), ["ulysses2", "cfg2"], 2, tmp_path, timeout=60)
    by = _assert_passed(results, ["ulysses2", "cfg2"])
    u = by["ulysses2"].details
    assert u["cp_plan"]["source"] == "derived"
    assert u["attention"]["cp_calls"] > 0 and u["attention"]["gqa_calls"] > 0
    code = load_plan_code(u["cp_plan_file"])
    assert set(code.plan) == {"x_embedder", "context_embedder", "rotary", "norm_out"}
    check = u["sharding"].check
    assert check and check["per_rank"] == {"blocks": [[8], [8]]}, u["sharding"]


@pytest.mark.skipif(not REFERENCE.is_file(), reason="the zoo's reference model (models/reference.yaml) is not built")
def test_reference_model(tmp_path):
    ov = {"generation.true_cfg_scale": 4.0, "generation.negative_prompt": "blurry", "generation.steps": 8,
          "generation.seeds": [0], "generation.prompts": ["a red circle on the left", "a blue square in the center"],
          "runtime.device": "cpu", "parallel.cache": {"residual_diff_threshold": 0.3, "max_warmup_steps": 2}}
    results, _ = run_plans(REFERENCE, ["ulysses2", "cfg2", "ulysses2+cache"], 2, tmp_path, overrides=ov, timeout=120)
    by = _assert_passed(results, ["ulysses2", "cfg2", "ulysses2+cache"])
    assert by["ulysses2+cache"].details["cache_agreement"]["disagreements"] == 0


def test_killed_rank_ends_run_with_error(root, tmp_path, monkeypatch):
    card = models.tiny_flux(root)
    start = time.perf_counter()
    with pytest.raises(ParallelRunError) as err:
        run_plans(card, ["ulysses2"], 2, tmp_path, timeout=30, total_timeout=120,
                  env={"DITBOOK_PARALLEL_FAULT": "1:3"})
    took = time.perf_counter() - start
    msg = str(err.value)
    assert "rank 1" in msg and ("signal 9" in msg or "failed" in msg), msg
    assert took < 90, took
    assert not (tmp_path / "worker.json").exists()


def test_sharding_check_reads_each_rank_in_its_own_cp_group():
    """Under cfg x Ulysses the world holds two CP groups: global ranks 2 and 3 are positions 0 and 1
    of the second group, and expect the same shares as ranks 0 and 1 (they were held against
    nothing before, and a correct plan was reported failed)."""
    from ditbook.cp.sharding import ShardingError, check_sharding

    expected = {"blocks": {"full": 9, "argument": "x"}}
    rec = lambda n: {"blocks": {"seq_lens": {"x": [n]}}}  # noqa: E731
    out = check_sharding([rec(5), rec(4), rec(5), rec(4)], expected, 2)
    assert out["per_rank"]["blocks"] == [[5], [4], [5], [4]]
    with pytest.raises(ShardingError, match="rank 3"):
        check_sharding([rec(5), rec(4), rec(5), rec(9)], expected, 2)


def test_four_processes_cfg_x_ulysses(root, tmp_path):
    """Issue 9 on the CPU: the plans are written for any world size; 4 gloo processes."""
    results, launch = run_plans(models.tiny_thirdparty(root), ["cfg2_ulysses2"], 4, tmp_path, timeout=90)
    by = _assert_passed(results, ["cfg2_ulysses2"])
    assert launch.worker["world_size"] == 4
    assert by["cfg2_ulysses2"].details["attention"]["cp_calls"] > 0


def test_failure_names_the_rank_that_died_not_the_peer_that_noticed():
    from ditbook.parallel.launch import _failure_message

    log = ("ditbook parallel: fault injection kills rank 1 at call 3\n"
           "ditbook parallel: rank 0 failed: RuntimeError: Connection closed by peer\n"
           "E1130 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 10) of binary: python\n"
           "Failures:\n  time      : now\n  host      : localhost\n  rank      : 1 (local_rank: 1)\n"
           "  exitcode  : -9 (pid: 11)  (SIGKILL)\n"
           "Root Cause (first observed failure):\n  time      : now\n  host      : localhost\n"
           "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 10)\n")
    msg = _failure_message(log, 1)
    assert msg.startswith("rank 1 ended (killed by signal 9)")
    assert "rank 0 failed" in msg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_groups_on_one_host(root, tmp_path, capsys):
    """Issue 9's multi-node recipe, on one host: the same `ditbook parallel` command on each node
    (here two torchrun node groups of one process), static rendezvous at node 0's address."""
    import subprocess
    import sys

    from ditbook.cli import main

    card = models.tiny_flux(root)
    master = f"127.0.0.1:{_free_port()}"
    common = [str(card), "--plan", "ulysses2", "--nproc", "1", "--nnodes", "2", "--master", master,
              "--timeout", "60", "--total-timeout", "240"]
    node1 = subprocess.Popen([sys.executable, "-m", "ditbook", "parallel", *common, "--node-rank", "1",
                              "--out", str(tmp_path / "node1")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        rc0 = main(["parallel", *common, "--node-rank", "0", "--out", str(tmp_path / "node0")])
        out1, _ = node1.communicate(timeout=240)
    finally:
        node1.kill()
    report = json.loads(capsys.readouterr().out)
    assert rc0 == 0 and node1.returncode == 0, out1[-2000:]
    (plan,) = report["plans"]
    assert plan["name"] == "ulysses2" and plan["world_size"] == 2 and plan["passed"], plan["quality"]["reasons"]
    assert (tmp_path / "node0" / "worker.json").is_file() and not (tmp_path / "node1" / "worker.json").exists()


def test_nodes_need_a_master():
    from ditbook.parallel.launch import Nodes

    with pytest.raises(ValueError, match="master"):
        Nodes(2, 1)
    with pytest.raises(ValueError, match="node rank"):
        Nodes(2, 2, "h:1")
    assert Nodes(2, 1, "h:29500").torchrun_args()[-4:] == ["--master_addr", "h", "--master_port", "29500"]
