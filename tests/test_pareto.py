"""The equal-quality comparison against the peers (issue 16): the GPU timing code on a tiny FLUX
shape on the CPU (every point kind, the counted pattern check), and the dominance table, which
must be able to say ``not dominated``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from speedsuite import pareto  # noqa: E402
from speedsuite.pareto_report import dominance, markdown_table  # noqa: E402

STEPS = 8


def _points() -> list[dict]:
    """One point of each kind in its timing form, with the pattern each must produce (F: every
    block ran, P: some, S: none) worked out from the configuration by hand."""
    static = pareto.static_point("ditbook static +TS1", "11100101", 1)
    scm = pareto.scm_peer("fast", STEPS)
    scm["params"].update(policy="static", mask="11110001")  # a dynamic peer's recorded full steps, as timed
    fbc = pareto.fbc_peer()
    fbc["params"]["forced"] = [1, 1, 0, 0, 1, 0, 0, 1]
    # ratios all 1: no error accumulates, so after the retained steps (int(0.2 * 8 + 0.5) = 2) MagCache
    # skips up to max_skip_steps (3) in a row, then computes one
    mag = pareto.magcache_peer([1.0] * STEPS, "test", STEPS)
    expected = {static["name"]: "FFFPPFPF", scm["name"]: "FFFFPPPF", fbc["name"]: "FFPPFPPF",
                mag["name"]: "FFSSSFSS"}
    out = []
    for p in (scm, fbc, static, mag):  # a cache-dit point before the diffusers hooks: its leftovers must be undone
        out.append({**p, "expected_pattern": expected[p["name"]], "how": "test"})
    return out


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared CPU: one thread is many times faster than contended ones."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _quality_file(tmp_path: Path, points: list[dict]) -> Path:
    f = tmp_path / "q.json"
    f.write_text(json.dumps({"steps": STEPS, "to_time": points}))
    return f


def test_speed_part_runs_every_kind_and_checks_patterns(tmp_path):
    from speedsuite.pareto_speed import run

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    points = _points()
    res = run(tmp_path, quality_file=_quality_file(tmp_path, points), tiny=True, device="cpu", size=32, repeats=1)
    rows = {r["name"]: r for r in res["rows"] if r["mode"] == "eager"}
    assert set(rows) == {"eager", "eager-again"} | {p["name"] for p in points}
    for r in rows.values():
        assert r["status"] == "measured" and r["median_s"] > 0, r
        assert r["pattern_ok"], (r["name"], r["pattern"], r["expected_pattern"])
    assert rows["eager"]["pattern"] == "F" * STEPS
    assert (tmp_path / "pareto_speed.md").read_text().count("| eager") >= 2


def test_speed_part_reports_a_pattern_that_differs(tmp_path):
    """The check can fail: a recorded pattern the timed form does not reproduce is marked."""
    from speedsuite.pareto_speed import main

    pytest.importorskip("torch")
    wrong = _points()[2]  # the static mask 11100101 ...
    wrong["expected_pattern"] = "FFFFFFFF"  # ... claimed to compute every step
    bogus = {"name": "bogus", "owner": "ditbook", "kind": "no-such-kind", "params": {}, "expected_pattern": "F" * STEPS}
    rc = main(["--out", str(tmp_path), "--quality", str(_quality_file(tmp_path, [wrong, bogus])), "--tiny",
               "--device", "cpu", "--size", "32", "--repeats", "1"])
    rows = {r["name"]: r for r in json.loads((tmp_path / "pareto_speed.json").read_text())["rows"]}
    assert not rows[wrong["name"]]["pattern_ok"] and rows[wrong["name"]]["pattern"] == "FFFPPFPF"
    # a point that cannot run is a failed row with its reason; the points after it still run
    assert rows["bogus"]["status"] == "failed" and "no-such-kind" in rows["bogus"]["reason"]
    assert rows["eager-again"]["status"] == "measured"
    assert rc == 1


# --- the dominance table -----------------------------------------------------------------------------
def _q(psnr, ssim):
    return {"psnr_mean": psnr, "psnr_min": psnr - 3, "ssim_mean": ssim, "ssim_min": ssim - 0.001}


def _fixture(ours_psnr=40.0, ours_ssim=0.995, ours_time=1.5, ours_work=12.0):
    peer = {"name": "peer A", "owner": "cache-dit", "kind": "dbcache", "role": "peer", "params": {},
            "holdout": _q(39.0, 0.994), "calibration": _q(39.0, 0.994), "counts": {"work_min": 14.0, "work_max": 14.0, "full_min": 12, "full_max": 13}}
    ours = {"name": "ditbook X", "owner": "ditbook", "kind": "dbcache", "role": "chosen", "params": {},
            "holdout": _q(ours_psnr, ours_ssim), "calibration": _q(40.0, 0.995),
            "counts": {"work_min": ours_work, "work_max": ours_work, "full_min": 10, "full_max": 10}}
    quality = {"points": [peer, ours], "pairs": [{"peer": "peer A", "ditbook": "ditbook X"}],
               "aggregates": ["mean", "min"], "holdout_seeds": [100], "steps": 28}
    speed = {"rows": [{"name": n, "mode": "eager", "status": "measured", "median_s": t, "pattern_ok": True}
                      for n, t in (("eager", 5.0), ("peer A", 2.0), ("ditbook X", ours_time))]}
    return quality, speed


def test_dominance_marks_a_dominated_peer():
    rows = dominance(*_fixture())
    assert rows[0]["verdict"] == "dominated", rows


@pytest.mark.parametrize("kw, why", [({"ours_time": 2.5}, "slower"), ({"ours_psnr": 38.5}, "psnr"),
                                     ({"ours_ssim": 0.990}, "ssim"), ({"ours_work": 15.0}, "work")])
def test_dominance_can_fail(kw, why):
    """A ditbook point slower, lower in PSNR or SSIM, or with more work than the peer: not dominated."""
    quality, speed = _fixture(**kw)
    rows = dominance(quality, speed)
    assert rows[0]["verdict"].startswith("not dominated") and why in rows[0]["verdict"], rows
    assert "not dominated" in markdown_table(quality, speed)


def test_dominance_without_a_point_or_a_time():
    quality, speed = _fixture()
    quality["pairs"][0]["ditbook"] = None
    assert dominance(quality, speed)[0]["verdict"].startswith("not dominated")
    quality, speed = _fixture()
    speed["rows"] = [r for r in speed["rows"] if r["name"] != "ditbook X"]
    assert dominance(quality, speed)[0]["verdict"].startswith("not dominated")
    quality, speed = _fixture()
    speed["rows"][2]["pattern_ok"] = False  # timed work differs from the measured one: no claim
    assert dominance(quality, speed)[0]["verdict"].startswith("not dominated")


# --- the search: held-out confirms, calibration alone does not choose ----------------------------------
class _FakeBench:
    """Quality of a static point from its computed steps and TaylorSeer order; TaylorSeer 2 looks 5 dB
    better on the calibration images than it is on the held-out ones (a point that fits calibration)."""

    steps, blocks = 28, 6

    def __init__(self, peer):
        self.results = {peer["name"]: peer}

    def evaluate(self, pt, sets=("calibration", "holdout")):
        c, order = pt["params"]["mask"].count("1"), pt["params"]["taylorseer_order"]
        calib = 30.0 + c + 2 * order
        work = c + (self.steps - c) / self.blocks
        res = {"point": pt, "calibration": _q(calib, 0.99), "holdout": _q(calib - (5 if order == 2 else 0), 0.99),
               "counts": {"work_min": work, "work_max": work, "full_min": c, "full_max": c}}
        self.results[pt["name"]] = res
        return res


def _peer(work=14.0):
    return {"name": "peer", "calibration": _q(40.0, 0.99), "holdout": _q(40.0, 0.99),
            "counts": {"work_min": work, "work_max": work, "least_work_pattern": "F" * 28}}


def test_search_confirms_on_held_out_and_keeps_the_work_budget():
    from speedsuite.pareto_quality import choose

    peer = _peer()
    bench = _FakeBench(peer)
    rec = choose(bench, peer, holdout_tries=12)
    chosen = bench.results[rec["ditbook"]]
    # the TS2 points pass calibration with fewer steps but fail held-out; the first that holds is TS1, 8 computed
    assert chosen["point"]["params"]["taylorseer_order"] == 1 and chosen["point"]["params"]["mask"].count("1") == 8
    assert any(not t["confirmed"] for t in rec["holdout_tries"])
    assert all(bench.results[n]["counts"]["work_min"] <= peer["counts"]["work_min"] for n in bench.results if n != "peer")


def test_search_can_come_back_empty():
    from speedsuite.pareto_quality import choose

    peer = _peer()
    assert choose(_FakeBench(peer), peer, holdout_tries=3)["ditbook"] is None  # only overfitted TS2 tried
    peer = _peer(work=9.0)  # too little work for anything at 40 dB
    assert choose(_FakeBench(peer), peer, holdout_tries=12)["ditbook"] is None


def test_magcache_calibration_reads_the_ratios_diffusers_prints():
    """diffusers' documented calibration run: one uncached run, the printed ratios parsed back."""
    import torch
    from speedsuite.fullsize import flux_pipeline

    fp = flux_pipeline("tiny", "cpu", torch.float32, height=32, width=32, steps=STEPS, text_tokens=8)
    with torch.inference_mode():
        ratios = pareto.calibrate_magcache(fp.pipe, fp, STEPS)
    assert len(ratios) == STEPS and ratios[0] == 1.0 and all(r > 0 for r in ratios)
    assert not getattr(fp.pipe.transformer, "_cache_config", None)  # the calibration hooks are off again
    with pytest.raises(RuntimeError, match="ratios"):
        pareto.calibrate_magcache(fp.pipe, fp, STEPS + 1)  # a run of another length: refused, not mis-read
