"""The one rule that decides what ships, and why.

The cache stage asks it which configuration to keep (no timing yet: the work each skips stands for
its speed); the benchmark asks it again with every candidate timed beside the baseline (each cache
configuration that passed on held-out seeds, and its compiled and fp8 forms); the verdict,
``result.md`` and the report show its answer. Nothing else decides.

A candidate is eligible when it passes the quality gates on held-out seeds and every check it
carries (its images in the benchmark against the gates, the fresh-process rerun, the compiled
check). Among the eligible:

- measured (``timed``): the timings must be stable (the baseline re-timed at the end within its
  bound); a candidate whose median speed-up is below ``MIN_USEFUL_SPEEDUP`` or whose timings allow
  a slowdown (its range reaches below 1.0x) is not shipped. Of the rest, those another one beats on
  both median speed-up and held-out PSNR drop out; the fastest remaining one ships — unless another
  one's timings overlap its own and it is better on held-out seeds: within the measured spread the
  better quality wins. So no shipped configuration is beaten by another eligible one on both
  measured speed and held-out quality.
- not measured: the work skipped (block evaluations) stands for speed, the held-out PSNR breaks ties.

Every other eligible candidate is a runner-up with the reason it was not chosen; every ineligible
one says what it failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import MIN_USEFUL_SPEEDUP


@dataclass
class Candidate:
    """One configuration the rule may ship, with its evidence."""

    name: str
    family: str = ""
    config: dict = field(default_factory=dict)
    technique: str = ""  # the cache technique it is a form of
    form: str = "plain"  # plain, compiled, fp8, fp8+compiled
    psnr: float | None = None  # held-out worst image (videos: worst frame)
    ssim: float | None = None
    n: int | None = None  # held-out cases
    skipped_fraction: float | None = None
    speedup: float | None = None  # median, against the baseline in the same process
    speedup_range: list[float] | None = None  # [min, max] the timings allow
    e2e_ms: float | None = None
    failed: list[str] = field(default_factory=list)  # the checks it failed, each named

    def passes(self, gates) -> bool:
        return self.psnr is not None and self.ssim is not None and self.psnr > gates.psnr and self.ssim > gates.ssim


@dataclass
class Decision:
    """What ships (``name`` None: the baseline) and why; the other candidates with their reasons."""

    name: str | None
    reason: str
    rule: str
    timed: bool
    ship: bool = False
    chosen: Candidate | None = None
    runner_ups: list[dict] = field(default_factory=list)  # eligible, not chosen: {name, speedup, psnr, why_not}
    refused: list[dict] = field(default_factory=list)  # not eligible: {name, why_not}

    def to_dict(self) -> dict:
        from .records import encode

        return {k: encode(v) for k, v in self.__dict__.items()}


RULE_TIMED = ("the fastest configuration that passes the gates on held-out seeds and every check, timed stable "
              "against the baseline; among those whose timings overlap the fastest's, the best on held-out seeds")
RULE_UNTIMED = "the most work skipped among the configurations passing the gates on held-out seeds; then held-out PSNR"


def _overlaps(a: Candidate, b: Candidate) -> bool:
    ra = a.speedup_range or [a.speedup, a.speedup]
    rb = b.speedup_range or [b.speedup, b.speedup]
    return ra[0] <= rb[1] and rb[0] <= ra[1]


def _ineligible(c: Candidate, gates) -> str | None:
    if c.psnr is None or c.ssim is None:
        return "no held-out quality record"
    if not c.passes(gates):
        return (f"held-out worst PSNR {c.psnr:.2f} dB / SSIM {c.ssim:.4f} does not pass the gates "
                f"(PSNR > {gates.psnr:g}, SSIM > {gates.ssim:g})")
    if c.failed:
        return "; ".join(c.failed)
    return None


def _too_slow(c: Candidate) -> str | None:
    if c.speedup is None:
        return "not timed"
    if c.speedup < MIN_USEFUL_SPEEDUP:
        return (f"{c.speedup:.2f}× does not beat the baseline by the {MIN_USEFUL_SPEEDUP:g}× a change must gain "
                "over the timing noise")
    if c.speedup_range and c.speedup_range[0] < 1.0:
        lo, hi = c.speedup_range
        return f"{c.speedup:.2f}× by the medians, but the timings allow {lo:.2f}–{hi:.2f}×, a slowdown among them"
    return None


def decide(candidates: list[Candidate], gates, *, timed: bool, timing_unstable: str | None = None) -> Decision:
    """The one ship rule (module docstring). ``timed``: the candidates carry measured speed-ups;
    ``timing_unstable``: why the timings cannot be read (then nothing ships on speed)."""
    rule = RULE_TIMED if timed else RULE_UNTIMED
    refused, eligible = [], []
    for c in candidates:
        why = _ineligible(c, gates)
        (refused.append({"name": c.name, "why_not": why}) if why else eligible.append(c))
    if timed and timing_unstable:
        return Decision(None, f"timing unstable: {timing_unstable}, so no speed-up is reported", rule, timed,
                        refused=refused + [{"name": c.name, "why_not": "not timed" if c.speedup is None else
                                            "timing unstable"} for c in eligible])
    if timed:
        useful = []
        for c in eligible:
            why = _too_slow(c)
            (refused.append({"name": c.name, "why_not": why}) if why else useful.append(c))
        if not useful:
            reason = ("no configuration passed the gates on held-out seeds and every check" if not eligible else
                      "no configuration that passes is measurably faster than the baseline: " + refused[-1]["why_not"])
            return Decision(None, reason, rule, timed, refused=refused)
        # never one another beats on both: the candidates no other one is faster than and better than
        front = [c for c in useful if not any(o.speedup > c.speedup and o.psnr > c.psnr for o in useful)]
        fastest = max(front, key=lambda c: c.speedup)
        ties = [c for c in front if _overlaps(c, fastest)]
        best = max(ties, key=lambda c: (c.psnr, c.speedup))
        why = (f"the fastest ({best.speedup:.2f}×) that passes on held-out seeds" if best is fastest else
               f"as fast as the fastest within the measured spread ({best.speedup:.2f}× against {fastest.speedup:.2f}×) "
               f"and better on held-out seeds ({best.psnr:.2f} dB against {fastest.psnr:.2f} dB)")
        others = [c for c in useful if c is not best]
    else:
        if not eligible:
            return Decision(None, "no configuration passed the gates on held-out seeds", rule, timed, refused=refused)
        best = max(eligible, key=lambda c: (c.skipped_fraction or 0.0, c.psnr))
        why = f"skips the most work ({best.skipped_fraction or 0.0:.3f} of block evaluations) and passes on held-out seeds"
        others = [c for c in eligible if c is not best]
    ups = [{"name": c.name, "speedup": c.speedup, "psnr": c.psnr, "ssim": c.ssim,
            "skipped_fraction": c.skipped_fraction, "why_not": _why_not(c, best, timed)} for c in others]
    ups.sort(key=lambda r: -((r["speedup"] if timed else r["skipped_fraction"]) or 0.0))
    return Decision(best.name, why, rule, timed, ship=timed, chosen=best, runner_ups=ups, refused=refused)


def _why_not(c: Candidate, best: Candidate, timed: bool) -> str:
    if timed:
        if c.speedup < best.speedup and not _overlaps(c, best):
            return f"slower ({c.speedup:.2f}× against {best.speedup:.2f}×, outside the measured spread)"
        if c.psnr < best.psnr:
            return f"as fast within the measured spread, worse on held-out seeds ({c.psnr:.2f} dB against {best.psnr:.2f} dB)"
        return f"slower by the medians ({c.speedup:.2f}× against {best.speedup:.2f}×) at no better held-out quality"
    if (c.skipped_fraction or 0.0) < (best.skipped_fraction or 0.0):
        return f"skips less work ({c.skipped_fraction or 0.0:.3f} of block evaluations against {best.skipped_fraction:.3f})"
    return f"skips as much work, worse on held-out seeds ({c.psnr:.2f} dB against {best.psnr:.2f} dB)"


__all__ = ["Candidate", "Decision", "RULE_TIMED", "RULE_UNTIMED", "decide"]
