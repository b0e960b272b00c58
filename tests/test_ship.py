"""The one ship rule (``ditbook.ship.decide``): what the cache stage keeps before timing, what the
verdict ships after it, and the property that matters: no shipped configuration is beaten by another
eligible one on both measured speed and held-out quality."""

from __future__ import annotations

import random

import pytest

from ditbook.settings import Gates
from ditbook.ship import Candidate, decide

GATES = Gates(psnr=30.0, ssim=0.9)


def cand(name, speed=None, psnr=35.0, ssim=0.95, skipped=0.5, spread=0.02, failed=()):
    rng = None if speed is None else [round(speed * (1 - spread), 4), round(speed * (1 + spread), 4)]
    return Candidate(name, psnr=psnr, ssim=ssim, skipped_fraction=skipped, speedup=speed, speedup_range=rng,
                     failed=list(failed))


def test_untimed_the_most_work_skipped_then_the_better_held_out_quality():
    d = decide([cand("a", skipped=0.5, psnr=33), cand("b", skipped=0.6, psnr=31), cand("c", skipped=0.6, psnr=32)],
               GATES, timed=False)
    assert d.name == "c" and not d.ship and [u["name"] for u in d.runner_ups] == ["b", "a"]
    assert d.runner_ups[0]["why_not"].startswith("skips as much work, worse on held-out seeds")


def test_timed_the_fastest_passing_one_ships_and_every_other_one_says_why_not():
    d = decide([cand("fast-bad", 4.0, psnr=25), cand("fast", 3.0), cand("slow", 1.5), cand("broken", 5.0,
               failed=["its rerun in a fresh process differs"]), cand("untimed")], GATES, timed=True)
    assert d.ship and d.name == "fast" and d.chosen.speedup == 3.0
    why = {r["name"]: r["why_not"] for r in d.refused}
    assert why["fast-bad"].startswith("held-out worst PSNR 25.00 dB") and why["broken"] == "its rerun in a fresh process differs"
    assert why["untimed"] == "not timed" and d.runner_ups[0]["why_not"].startswith("slower (1.50×")


@pytest.mark.parametrize("speed,spread,why", [(1.02, 0.01, "does not beat the baseline"),
                                              (1.3, 0.4, "a slowdown among them")])
def test_nothing_ships_on_a_speed_up_within_the_noise(speed, spread, why):
    d = decide([cand("a", speed, spread=spread)], GATES, timed=True)
    assert d.name is None and not d.ship and why in d.reason


def test_unstable_timings_ship_nothing():
    d = decide([cand("a", 3.0)], GATES, timed=True, timing_unstable="the baseline drifted 40%")
    assert d.name is None and d.reason.startswith("timing unstable") and d.refused[0]["why_not"] == "timing unstable"


def test_no_shipped_configuration_is_beaten_on_both_speed_and_quality():
    """Random candidates: whatever ships, no other eligible candidate is faster outside the measured
    spread and better on held-out seeds at once."""
    rng = random.Random(0)
    for trial in range(300):
        cs = [cand(f"c{i}", round(rng.uniform(1.0, 4.0), 3), psnr=round(rng.uniform(28, 45), 2),
                   spread=rng.choice([0.01, 0.05, 0.2])) for i in range(rng.randint(1, 6))]
        d = decide(cs, GATES, timed=True)
        if d.chosen is None:
            continue
        s = d.chosen
        for c in cs:
            eligible = c.passes(GATES) and c.speedup >= 1.05 and c.speedup_range[0] >= 1.0
            assert not (eligible and c.speedup_range[0] > s.speedup_range[1] and c.psnr > s.psnr), (trial, s, c)
            assert not (eligible and c.speedup > s.speedup and c.psnr > s.psnr), (trial, s, c)
