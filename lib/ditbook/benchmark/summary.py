"""The summary table of a benchmark and the readout of which configuration to ship."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..settings import FAMILY_SECTION, MIN_USEFUL_SPEEDUP, SECTIONS, Gates

COLUMNS = ("name", "family", "source", "nproc", "speedup", "e2e_ms", "psnr_min", "ssim_min", "passed")


def family_gates(card=None) -> dict[str, Gates]:
    """The gates of each benchmark family, from the card's sections that judge quality (the
    settings' defaults without a card): cache and cache+parallel rows by ``cache.gates``,
    parallel rows by ``parallel.gates``."""
    return {fam: (getattr(card, sec) if card is not None else SECTIONS[sec]()).gates
            for fam, sec in FAMILY_SECTION.items()}


def gates_for_family(family: str, gates: dict | None = None) -> Gates:
    """A family's gates from ``family_gates`` (or a mapping like it, whose values may be Gates
    or ``{psnr, ssim}`` mappings over the defaults); a sub-family (``cache/dbcache``) takes its
    family's gates."""
    fam = family.split("/")[0]
    defaults = family_gates()
    base = defaults.get(fam, defaults["cache"])
    g = (gates or {}).get(fam)
    if g is None:
        return base
    return g if isinstance(g, Gates) else Gates.from_dict(g, **base.to_dict())


def gates_dict(gates: dict | None = None) -> dict:
    """``{family: {psnr, ssim, tile_margin_db}}`` of the gates in force (for results.json)."""
    return {fam: gates_for_family(fam, gates).to_dict() for fam in FAMILY_SECTION}


def _gates_text(gates: dict | None) -> str:
    return "; ".join(f"{fam} {gates_for_family(fam, gates).describe()}" for fam in FAMILY_SECTION)


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
            "error": c.get("error"), "quality_on": "calibration",  # the benchmark renders the card's seeds
        })
    measured = {r["name"] for r in rows}
    recorded = results.get("recorded") or {}
    cpu = str(results.get("device") or "").startswith("cpu")
    for r in list(recorded.get("cache") or []) + list(recorded.get("parallel") or []):
        if r.get("name") in measured:
            continue
        plan = r.get("source") == "parallel stage"
        rows.append({"name": r.get("name"), "family": r.get("family"), "source": r.get("source"),
                     "nproc": r.get("nproc", 1), "speedup": r.get("speedup"), "e2e_ms": None,
                     "psnr_min": r.get("psnr_min"), "ssim_min": r.get("ssim_min"),
                     "passed": r.get("passed"), "error": r.get("error"),
                     # a plan's figures are its parity against one process (the card's seeds)
                     "quality_on": "parity" if plan else r.get("quality_on", "calibration")})
        if plan and cpu and int(r.get("nproc") or 1) > 1:
            rows[-1]["parity_only"] = True  # CPU processes share the cores: no speed-up to show
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


def recommend(rows: list[dict], gates: dict | None = None) -> Recommendation:
    """The fastest configuration that passes its family's gates (``family_gates(card)``; the
    settings' defaults when None) and beats the baseline by more than the noise; the baseline
    otherwise. Faster ones that were rejected are listed with why. The reason names the gates."""
    candidates, rejected = [], []
    for r in rows:
        if r.get("family") == "baseline" or r.get("speedup") is None:
            continue
        g = gates_for_family(str(r.get("family")), gates)
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
        g = gates_for_family(best["family"], gates)
        src = "measured in this process against the same-process baseline" if best.get("source") == "measured here" \
            else f"as recorded by the {best.get('source')}"
        reason = (f"{best['name']} ({best['family']}) is the fastest configuration that meets its gates: "
                  f"{best['speedup']:.2f}× end to end {src}, worst-image PSNR {_fmt(best.get('psnr_min'), 2)} dB "
                  f"(gate > {g.psnr:g}) and SSIM {_fmt(best.get('ssim_min'), 4)} (gate > {g.ssim:g})")
        if (best.get("nproc") or 1) > 1:
            reason += f", on {best['nproc']} processes"
        choice = (best["name"], best["family"], best["speedup"])
        faster = [(r, w) for r, w in rejected if (r.get("speedup") or 0) > best["speedup"]]
    reason += f" (gates: {_gates_text(gates)})"
    rej = [f"{r['name']} ({_fmt(r.get('speedup'), 2)}×): {w}" for r, w in faster]
    return Recommendation(choice[0], choice[1], choice[2], reason, rej)


__all__ = ["family_gates", "gates_for_family", "gates_dict", "summary_rows", "markdown_table", "Recommendation", "recommend",
           "MIN_USEFUL_SPEEDUP"]
