"""The GPU speed suite's pieces that need no GPU: schedules and the report over recorded runs."""

from pathlib import Path

import pytest

from speedsuite.schedules import Schedule, cache_dit_policy, candidates, ditbook_schedule, spaced_mask
from speedsuite.report import speed_rows, write_speed_report

ROOT = Path(__file__).resolve().parent.parent
RUNS = sorted((ROOT / "docs" / "benchmarks").glob("h200-*"))


@pytest.mark.parametrize("steps,warmup,computed", [(28, 3, 8), (28, 4, 10), (20, 2, 6), (28, 5, 12)])
def test_spaced_mask(steps, warmup, computed):
    mask = spaced_mask(steps, warmup, computed)
    assert len(mask) == steps and sum(mask) == computed
    assert mask[:warmup] == (1,) * warmup and mask[-1] == 1
    # gaps between computed steps after the warm-up never shrink by more than one step
    ones = [i for i, m in enumerate(mask) if m]
    gaps = [b - a for a, b in zip(ones[warmup - 1:], ones[warmup:])]
    assert all(b >= a - 1 for a, b in zip(gaps, gaps[1:]))


def test_bad_budget_rejected():
    with pytest.raises(ValueError):
        spaced_mask(10, 5, 4)


def test_schedule_configs_are_static_and_named():
    s = ditbook_schedule(28, 3, 8, 1)
    cfg = s.cache_config()
    assert cfg.steps_computation_policy == "static" and cfg.steps_computation_mask == list(s.mask)
    assert s.calibrator_config().taylorseer_order == 1
    fast = cache_dit_policy("fast", 28)
    assert fast.computed == 11 and fast.owner == "cache-dit"
    names = [c.name for c in candidates(28)]
    assert len(names) == len(set(names))


def test_candidates_skip_a_warm_up_as_long_as_the_budget_and_keep_the_last_step():
    got = candidates(20, budgets=(4, 7), warmups=(2, 4, 5), orders=(0, 2))
    ours = [s for s in got if s.owner == "ditbook"]
    # a 4-step budget has no room after a 4- or 5-step warm-up: only w2c4 (twice: orders 0 and 2)
    assert sorted(s.name for s in ours if s.computed == 4) == ["ditbook-w2c4", "ditbook-w2c4+TS2"]
    assert sorted(s.name for s in ours if s.computed == 7) == ["ditbook-w2c7", "ditbook-w2c7+TS2", "ditbook-w4c7",
                                                                "ditbook-w4c7+TS2", "ditbook-w5c7", "ditbook-w5c7+TS2"]
    for s in ours:
        warm = int(s.name.split("-w")[1].split("c")[0])
        assert s.steps == 20 and s.mask[-1] == 1 and s.mask[:warm] == (1,) * warm and s.computed < 20
    assert {s.name for s in got if s.owner == "cache-dit"} >= {"cache-dit-slow", "cache-dit-medium"}


@pytest.mark.skipif(not RUNS, reason="no recorded GPU runs")
def test_report_of_recorded_runs(tmp_path):
    rows = speed_rows(RUNS[0])
    base = next(r for r in rows if r["name"] == "baseline")
    assert base["speedup"] == 1.0
    for r in rows:
        if r["seconds"]:
            ref = base if r["shape"] == base["shape"] else next(x for x in rows if x["name"] == "qwen-baseline")
            assert r["speedup"] == pytest.approx(ref["seconds"] / r["seconds"], rel=1e-2)
    for run in RUNS:
        copy = tmp_path / run.name
        copy.mkdir()
        for f in run.glob("*.json"):
            (copy / f.name).write_text(f.read_text())
        md = write_speed_report(copy).read_text()
        assert "| configuration |" in md and (copy / "speed.png").stat().st_size > 0


def test_a_schedule_file_is_used_or_refused_never_replaced_by_a_default(tmp_path):
    import json

    from speedsuite.suite import NoSchedule, chosen_schedule, schedule_from_choice

    path = tmp_path / "sq.json"
    path.write_text(json.dumps({"chosen": {"name": "ditbook-w2c3+TS2", "mask": "110001", "taylorseer_order": 2}}))
    s = chosen_schedule(6, path)
    assert s.mask == (1, 1, 0, 0, 0, 1) and s.taylorseer_order == 2 and s.name == "ditbook-w2c3+TS2"
    with pytest.raises(NoSchedule, match="has 6 steps, this run 8") as other:
        chosen_schedule(8, path)
    assert other.value.chose_none is False
    path.write_text(json.dumps({"chosen": None, "steps": 6, "gates": {"psnr": 30}, "card": "c.yaml",
                                "schedules": [{"name": "a", "computed": 3, "calibration": {"psnr_min": 27.5}},
                                              {"name": "b", "computed": 4, "calibration": {"psnr_min": 29.1}}]}))
    with pytest.raises(NoSchedule, match=r"chose no schedule: none of its 2 .* the closest, b \(4/6 computed\), gave 29.10 dB") as none:
        schedule_from_choice(path, 6)
    assert none.value.chose_none is True
    assert chosen_schedule(28, tmp_path / "missing.json").name == "ditbook-w4c10+TS1"  # no file: the documented default
