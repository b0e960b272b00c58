"""What the report shows per configuration, decided once for the page, the plot and ``result.md``.

- **One quality figure per configuration.** A configuration the cache stage confirmed on
  held-out seeds is shown with that held-out figure (``quality_on: "held-out"``) wherever it
  appears; the benchmark's own re-measurement on the card's seeds (the calibration seeds) is not
  shown beside it. A configuration with no held-out record (a parallel plan, an attention
  backend, a card hook) is shown with its figure on the card's seeds, labelled
  ``"calibration"``. The summary's two column pairs never mix: held-out figures in one pair,
  calibration figures in the other.
- **No CPU processes on the speed axis.** Parallel plans (``nproc`` > 1) run on a CPU host are
  parity results (PSNR/SSIM, sharding verified) only: their speed-up is not shown and they are
  left off the speed plot. On GPUs their speed-up is the parallel stage's, against the
  single-process run on the same device, labelled with the device count.
- **Speed figures carry their spread**: the speed-up range from the end-to-end timings' min and
  max (``baseline.min / config.max`` to ``baseline.max / config.min``).
- **Timing stable**: the benchmark's timing record (``verdict.timing_state``: the baseline
  re-timed at the end against the start, within the card's ``benchmark.timing_drift``).
"""

from __future__ import annotations

from ..configuration import fp8_suffix, row_name

HELD_OUT = "held-out"
CALIBRATION = "calibration"


def is_cpu_run(benchmark: dict | None) -> bool:
    """The benchmark ran on a CPU host (its ``device``): multi-process plans there share cores."""
    return str((benchmark or {}).get("device") or "").startswith("cpu")


def is_parallel(row: dict) -> bool:
    return str(row.get("family") or "").endswith("parallel") and int(row.get("nproc") or 1) > 1


def fp8_row_name(cache: dict | None) -> str | None:
    """The benchmark row of the cache stage's fp8 composition (``cache.fp8_tune``), or None: the
    name ``cache.benchmark_configs`` gives it."""
    f8 = ((cache or {}).get("fp8") or {}).get("chosen")
    if not f8:
        return None
    return row_name(f8["name"], f8.get("config")) + fp8_suffix(f8)


def chosen_row_name(chosen: dict) -> str:
    """The benchmark row of the cache stage's chosen configuration (``cache.benchmark_configs``)."""
    return row_name(chosen["name"], chosen.get("config"))


def holdout_records(cache: dict | None) -> dict[str, dict]:
    """``{benchmark row name: {psnr_min, ssim_min, n, passed, skipped_fraction}}`` of every
    configuration the cache stage ran on held-out seeds (the chosen one's own record last, so it
    wins), and the fp8 composition's (``cache.fp8``) under its own row name."""
    out: dict[str, dict] = {}
    for e in (cache or {}).get("strategies") or []:
        if not isinstance(e, dict) or e.get("split") != "holdout":
            continue
        name = row_name(str(e.get("name")), e.get("config"))
        q = e.get("quality") or {}
        out[name] = {"psnr_min": q.get("psnr_min", e.get("psnr_min")), "ssim_min": q.get("ssim_min", e.get("ssim_min")),
                     "n": q.get("n"), "passed": e.get("passed"), "skipped_fraction": e.get("skipped_fraction")}
    chosen, detail = (cache or {}).get("chosen"), (cache or {}).get("chosen_detail") or {}
    hq = detail.get("holdout_quality") or {}
    if chosen and hq:
        out[chosen_row_name(chosen)] = {"psnr_min": hq.get("psnr_min"), "ssim_min": hq.get("ssim_min"),
                                        "n": hq.get("n"), "passed": True, "skipped_fraction": detail.get("skipped_fraction")}
    f8 = ((cache or {}).get("fp8") or {}).get("chosen")
    if f8 and f8.get("holdout_quality"):  # the fp8 composition's own held-out record (cache.fp8)
        q = f8["holdout_quality"]
        out[fp8_row_name(cache)] = {"psnr_min": q.get("psnr_min"), "ssim_min": q.get("ssim_min"), "n": q.get("n"),
                                    "passed": True, "skipped_fraction": f8.get("skipped_fraction")}
    return out


def speed_spread(benchmark: dict | None) -> dict[str, tuple[float, float]]:
    """``{row name: (low, high)}``: the speed-up range the end-to-end timings allow (baseline
    min / configuration max, baseline max / configuration min), for rows measured here."""
    res = benchmark or {}
    base = ((res.get("baseline") or {}).get("timing") or {}).get("end_to_end") or {}
    out: dict[str, tuple[float, float]] = {}
    if not base.get("min") or not base.get("max"):
        return out
    for c in res.get("configs") or []:
        t = ((c or {}).get("timing") or {}).get("end_to_end") or {}
        if t.get("min") and t.get("max"):
            out[str(c.get("name"))] = (base["min"] / t["max"], base["max"] / t["min"])
    return out


def shown_rows(rows: list[dict], benchmark: dict | None, cache: dict | None) -> list[dict]:
    """Each summary row with the figures the report shows: ``psnr_holdout``/``ssim_holdout`` or
    ``psnr_calibration``/``ssim_calibration`` (never both), ``quality_on``, ``psnr``/``ssim`` (the
    one figure), ``passed_shown`` (the gate result on the seeds of that figure), ``speedup_shown``
    (None for a parallel plan on a CPU host), ``speedup_range``, ``parity_only`` and ``devices``."""
    held = holdout_records(cache)
    spread = speed_spread(benchmark)
    cpu = is_cpu_run(benchmark)
    out = []
    for r in rows:
        s = dict(r)
        name = str(r.get("name"))
        rec = held.get(name)
        if rec is None and name.endswith("+compile") and ((cache or {}).get("compiled") or {}).get("ok") is True:
            # the cache stage's compiled check found compiling leaves the images as they were: the
            # compiled twin's held-out figure is its uncompiled configuration's
            rec = held.get(name.removesuffix("+compile"))
        if rec is None and r.get("quality_on") == HELD_OUT:  # a recorded cache row taken from the held-out split
            rec = {"psnr_min": r.get("psnr_min"), "ssim_min": r.get("ssim_min"), "passed": r.get("passed")}
        if rec is not None and r.get("family") != "baseline":
            s.update(quality_on=HELD_OUT, psnr=rec.get("psnr_min"), ssim=rec.get("ssim_min"),
                     psnr_holdout=rec.get("psnr_min"), ssim_holdout=rec.get("ssim_min"),
                     passed_shown=rec.get("passed") if not r.get("error") else False)
        else:
            s.update(quality_on=CALIBRATION, psnr=r.get("psnr_min"), ssim=r.get("ssim_min"),
                     psnr_calibration=r.get("psnr_min"), ssim_calibration=r.get("ssim_min"),
                     passed_shown=r.get("passed"))
        par = is_parallel(r)
        s["parity_only"] = bool(cpu and par)
        s["speedup_shown"] = None if s["parity_only"] else r.get("speedup")
        s["speedup_range"] = spread.get(name)
        s["devices"] = (f"{int(r.get('nproc'))} {'CPU processes' if cpu else 'GPUs'}" if par else None)
        out.append(s)
    return out


def speed_text(row: dict) -> str:
    """The speed figure as the report writes it: ``1.31× (1.25–1.36)``; ``parity only`` for a
    parallel plan on a CPU host; ``-`` when not measured."""
    if row.get("parity_only"):
        return "parity only (CPU processes)"
    sp = row.get("speedup_shown", row.get("speedup"))
    if sp is None:
        return "-"
    lo_hi = row.get("speedup_range")
    vs = " vs 1 GPU" if row.get("devices") else ""  # a plan's speed-up is against its own single-process run
    return f"{sp:.2f}×{vs}" + (f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f})" if lo_hi else "")


def display_name(row: dict) -> str:
    """A row's name as the report's tables write it: a parallel plan with its device count
    (``ulysses (2 GPUs)``, ``ulysses (2 CPU processes)``)."""
    return f"{row.get('name')} ({row['devices']})" if row.get("devices") else str(row.get("name"))


__all__ = ["HELD_OUT", "CALIBRATION", "is_cpu_run", "is_parallel", "holdout_records",
           "speed_spread", "shown_rows", "speed_text", "display_name"]
