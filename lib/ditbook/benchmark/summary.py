"""The summary table of a benchmark and the readout of which configuration to ship."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..quality import Gates

# peers' gates (DESIGN.md): cache against the baseline, parallel against one process
DEFAULT_GATES = {"cache": Gates(psnr=30.0, ssim=0.90), "parallel": Gates(psnr=35.0, ssim=0.90),
                 "cache+parallel": Gates(psnr=30.0, ssim=0.90)}
# a speedup below this is within the run-to-run spread of a CPU benchmark: not worth shipping
MIN_USEFUL_SPEEDUP = 1.05

COLUMNS = ("name", "family", "source", "nproc", "speedup", "e2e_ms", "psnr_min", "ssim_min", "passed")


def gates_for_family(family: str, overrides: dict | None = None) -> Gates:
    fam = family.split("/")[0]
    base = DEFAULT_GATES.get(fam, DEFAULT_GATES["cache"])
    return Gates.from_dict((overrides or {}).get(fam), psnr=base.psnr, ssim=base.ssim)


def summary_rows(results: dict) -> list[dict]:
    """One row per configuration from ``benchmark/results.json``: measured here first, then the
    figures recorded by the cache and parallel stages that were not re-measured here."""
    rows = []
    for c in [results.get("baseline")] + list(results.get("configs") or []):
        if not c:
            continue
        t = c.get("timing") or {}
        e2e = (t.get("end_to_end") or {}).get("median")
        rows.append({
            "name": c["name"], "family": c["family"], "source": "measured here", "nproc": 1,
            "speedup": c.get("speedup"), "e2e_ms": None if e2e is None else round(e2e * 1e3, 2),
            "psnr_min": c.get("psnr_min"), "ssim_min": c.get("ssim_min"),
            "passed": c.get("passed") if not c.get("error") else False,
            "error": c.get("error"),
        })
    measured = {r["name"] for r in rows}
    recorded = results.get("recorded") or {}
    for r in list(recorded.get("cache") or []) + list(recorded.get("parallel") or []):
        if r.get("name") in measured:
            continue
        rows.append({"name": r.get("name"), "family": r.get("family"), "source": r.get("source"),
                     "nproc": r.get("nproc", 1), "speedup": r.get("speedup"), "e2e_ms": None,
                     "psnr_min": r.get("psnr_min"), "ssim_min": r.get("ssim_min"),
                     "passed": r.get("passed"), "error": r.get("error")})
    return rows


def _fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.{nd}f}".rstrip("0").rstrip(".") if nd else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    from ..display import Table

    return Table.from_dicts([{c: _fmt(r.get(c)) for c in columns} for r in rows], columns).markdown()


@dataclass
class Recommendation:
    name: str
    family: str
    speedup: float | None
    reason: str
    rejected: list[str]

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "speedup": self.speedup, "reason": self.reason,
                "rejected": self.rejected}


def recommend(rows: list[dict], gate_overrides: dict | None = None) -> Recommendation:
    """The fastest configuration that passes its family's gates and beats the baseline by more
    than the noise; the baseline otherwise. Faster ones that were rejected are listed with why."""
    candidates, rejected = [], []
    for r in rows:
        if r.get("family") == "baseline" or r.get("speedup") is None:
            continue
        g = gates_for_family(str(r.get("family")), gate_overrides)
        p, s = r.get("psnr_min"), r.get("ssim_min")
        why = []
        if r.get("error"):
            why.append(f"error: {r['error']}")
        if r.get("passed") is False:
            why.append("failed its quality checks")
        if p is None or not p > g.psnr:
            why.append(f"worst PSNR {_fmt(p, 2)} dB not above {g.psnr:g}")
        if s is None or not s > g.ssim:
            why.append(f"worst SSIM {_fmt(s, 4)} not above {g.ssim:g}")
        if why:
            rejected.append((r, "; ".join(why)))
        else:
            candidates.append(r)
    candidates.sort(key=lambda r: r["speedup"], reverse=True)
    best = candidates[0] if candidates else None
    if best is None or best["speedup"] < MIN_USEFUL_SPEEDUP:
        reason = ("no configuration both meets its quality gates and beats the baseline by "
                  f"{MIN_USEFUL_SPEEDUP:g}× or more" + (f" (best passing: {best['name']} at {best['speedup']:.2f}×)"
                                                        if best else "") + "; ship the baseline")
        choice = ("baseline", "baseline", 1.0)
        faster = [(r, w) for r, w in rejected]
    else:
        g = gates_for_family(best["family"], gate_overrides)
        src = "measured in this process against the same-process baseline" if best.get("source") == "measured here" \
            else f"as recorded by the {best.get('source')}"
        reason = (f"{best['name']} ({best['family']}) is the fastest configuration that meets its gates: "
                  f"{best['speedup']:.2f}× end to end {src}, worst-image PSNR {_fmt(best.get('psnr_min'), 2)} dB "
                  f"(gate > {g.psnr:g}) and SSIM {_fmt(best.get('ssim_min'), 4)} (gate > {g.ssim:g})")
        if (best.get("nproc") or 1) > 1:
            reason += f", on {best['nproc']} processes"
        choice = (best["name"], best["family"], best["speedup"])
        faster = [(r, w) for r, w in rejected if (r.get("speedup") or 0) > best["speedup"]]
    rej = [f"{r['name']} ({_fmt(r.get('speedup'), 2)}×): {w}" for r, w in faster]
    return Recommendation(choice[0], choice[1], choice[2], reason, rej)


__all__ = ["DEFAULT_GATES", "gates_for_family", "summary_rows", "markdown_table", "Recommendation", "recommend",
           "MIN_USEFUL_SPEEDUP"]
