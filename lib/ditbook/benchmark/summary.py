"""The summary table of a benchmark, and the gates each family of rows is judged by (what ships is
``ditbook.ship``'s to decide, read by ``verdict``)."""

from __future__ import annotations

import math
from ..settings import FAMILY_SECTION, SECTIONS, Gates

COLUMNS = ("name", "family", "source", "nproc", "speedup", "e2e_ms", "psnr_min", "ssim_min", "passed")


def family_gates(card=None) -> dict[str, Gates]:
    """The gates of each benchmark family from the card's sections (the defaults without a card)."""
    return {fam: (getattr(card, sec) if card is not None else SECTIONS[sec]()).gates
            for fam, sec in FAMILY_SECTION.items()}


def gates_for_family(family: str, gates: dict | None = None) -> Gates:
    """A family's gates from ``family_gates`` or a mapping like it (values Gates or ``{psnr, ssim}``
    over the defaults); a sub-family (``cache/dbcache``) takes its family's gates."""
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


def summary_rows(results) -> list[dict]:
    """One row per configuration: measured here first, then the earlier stages' recorded rows."""
    rows = []
    for c in [results.baseline, *results.configs]:
        e2e = c.timing["end_to_end"]["median"] if c.timing else None
        rows.append({
            "name": c.name, "family": c.family, "source": "measured here", "nproc": 1,
            "speedup": c.speedup, "e2e_ms": None if e2e is None else round(e2e * 1e3, 2),
            "psnr_min": c.psnr_min, "ssim_min": c.ssim_min, "passed": c.passed if not c.error else False,
            "error": c.error, "quality_on": "calibration",  # the benchmark renders the card's seeds
        })
    measured = {r["name"] for r in rows}
    cpu = results.device.startswith("cpu")
    for r in results.recorded.get("cache", []) + results.recorded.get("parallel", []):
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


__all__ = ["family_gates", "gates_for_family", "gates_dict", "summary_rows", "markdown_table"]
