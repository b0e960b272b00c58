"""What the report shows per configuration, decided once for the page, the plot and ``result.md``.

- One quality figure per configuration: the cache stage's held-out figure where it has one, else
  the benchmark's on the calibration seeds; a parallel plan also its parity against one process.
  Every figure says what it is measured on (:data:`ON_TEXT`).
- Parallel plans run as CPU processes are parity results only: no speed-up, off the speed plot.
- Speed figures carry their range from the end-to-end timings' min and max.
- Names in words (:func:`config_words`), the full key kept beside them.
"""

from __future__ import annotations

import re

from ..configuration import row_name
from ..records import BenchmarkResults, CacheResults, ParallelResults
from .verdict import chosen_row_name, fp8_row_name, speed_range

HELD_OUT = "held-out"
CALIBRATION = "calibration"
PARITY = "parity"
# what a figure is measured on, as every table, caption and line writes it
ON_TEXT = {HELD_OUT: "held-out seeds", CALIBRATION: "calibration seeds",
           PARITY: "parity against one process, calibration seeds"}


def is_cpu_run(benchmark: BenchmarkResults | None) -> bool:
    """The benchmark ran on a CPU host (its ``device``): multi-process plans there share cores."""
    return benchmark is not None and benchmark.device.startswith("cpu")


def is_parallel(row: dict) -> bool:
    return str(row.get("family") or "").endswith("parallel") and int(row.get("nproc") or 1) > 1


def holdout_records(cache: CacheResults | None) -> dict[str, dict]:
    """``{benchmark row name: {psnr_min, ssim_min, n, passed, skipped_fraction}}`` of every
    configuration the cache stage ran on held-out seeds (the chosen one's record wins), and the fp8
    composition's under its own row name."""
    out: dict[str, dict] = {}

    def put(name, q, passed, skipped):
        out[name] = {"psnr_min": q and q.psnr_min, "ssim_min": q and q.ssim_min, "n": q and q.n, "passed": passed,
                     "skipped_fraction": skipped}

    for e in cache.holdout_rows(passed_only=False) if cache is not None else []:
        put(row_name(e.name, e.config), e.quality, e.passed, e.skipped_fraction)
    if cache is not None and cache.chosen is not None and cache.chosen.holdout_quality is not None:
        put(chosen_row_name(cache.chosen), cache.chosen.holdout_quality, True, cache.chosen.skipped_fraction)
    f8 = cache.fp8.chosen if cache is not None else None
    if f8 is not None and f8.holdout_quality is not None:  # the fp8 composition's own held-out record
        put(fp8_row_name(cache), f8.holdout_quality, True, f8.skipped_fraction)
    return out


def plan_quality(row: dict, plan) -> dict:
    """A parallel plan's two figures: ``baseline`` (against the uncached baseline, None when not
    recorded; a plan without cache: its parity) and ``parity`` (against one process)."""
    parity = {"psnr": row.get("psnr_min"), "ssim": row.get("ssim_min")}
    bq = plan.baseline_quality if plan is not None else None
    if bq is not None:
        base = {"psnr": bq.psnr_min, "ssim": bq.ssim_min}
    elif not row.get("cache") and (plan is None or (plan.reference or "single") == "single") \
            and "cache" not in str(row.get("family")).split("+")[0]:
        base = dict(parity)
    else:
        base = None
    return {"baseline": base, "parity": parity}


def _timing_extras(config) -> dict:
    """A measured row's repeats, per-part speed-ups (transformer step, decode) and peak memory."""
    if config is None or not config.timing:
        return {}
    t, parts = config.timing, config.part_speedups
    base = config.family == "baseline"
    return {"repeats": t["end_to_end"].get("n"),
            "step_speedup": 1.0 if base else parts.get("transformer_step"),
            "decode_speedup": 1.0 if base else parts.get("vae_decode"),
            "peak_mb": t.get("peak_memory_mb"), "memory_kind": t.get("memory_kind")}


def shown_rows(rows: list[dict], benchmark: BenchmarkResults | None, cache: CacheResults | None,
               parallel: ParallelResults | None = None) -> list[dict]:
    """Each summary row with the figures the report shows: the one quality figure (``psnr``/``ssim``,
    ``quality_on``, held-out or calibration columns, never both), ``passed_shown``, ``speedup_shown``,
    ``speedup_range``, ``parity_only``, ``devices``, a parallel plan's parity, the names in words,
    and the measured rows' timing extras."""
    # long: one pass over the rows, each figure decided once (quality, parity, speed, names, timings)
    held = holdout_records(cache)
    cpu = is_cpu_run(benchmark)
    plans = {(p.name, p.world_size): p for p in parallel.plans} if parallel is not None else {}
    out = []
    for r in rows:
        s = dict(r)
        name = str(r.get("name"))
        rec = held.get(name)
        if rec is None and name.endswith("+compile") and cache is not None and cache.compiled.ok is True:
            # compiling leaves the images as they were: the twin's held-out figure is the uncompiled one's
            rec = held.get(name.removesuffix("+compile"))
        if rec is None and r.get("quality_on") == HELD_OUT:  # a recorded cache row taken from the held-out split
            rec = {"psnr_min": r.get("psnr_min"), "ssim_min": r.get("ssim_min"), "passed": r.get("passed")}
        par = is_parallel(r)
        if par:
            q = plan_quality(r, plans.get((name, int(r.get("nproc") or 1))))
            psnr, ssim = (q["baseline"]["psnr"], q["baseline"]["ssim"]) if q["baseline"] else (None, None)
            s.update(quality_on=CALIBRATION, psnr=psnr, ssim=ssim, psnr_calibration=psnr, ssim_calibration=ssim,
                     psnr_parity=q["parity"]["psnr"], ssim_parity=q["parity"]["ssim"], passed_shown=r.get("passed"))
        elif rec is not None and r.get("family") != "baseline":
            s.update(quality_on=HELD_OUT, psnr=rec.get("psnr_min"), ssim=rec.get("ssim_min"),
                     psnr_holdout=rec.get("psnr_min"), ssim_holdout=rec.get("ssim_min"),
                     passed_shown=rec.get("passed") if not r.get("error") else False)
        else:
            s.update(quality_on=CALIBRATION, psnr=r.get("psnr_min"), ssim=r.get("ssim_min"),
                     psnr_calibration=r.get("psnr_min"), ssim_calibration=r.get("ssim_min"),
                     passed_shown=r.get("passed"))
        s["parity_only"] = bool(cpu and par)
        s["speedup_shown"] = None if s["parity_only"] else r.get("speedup")
        s["speedup_range"] = speed_range(benchmark, name) if r.get("source") == "measured here" else None
        s["devices"] = (f"{int(r.get('nproc'))} {'CPU processes' if cpu else 'GPUs'}" if par else None)
        s["words"] = config_words(name, cache)
        s["family_shown"] = family_name(r, cache)
        if r.get("source") == "measured here" and benchmark is not None:
            s.update(_timing_extras(benchmark.row(name)))
        out.append(s)
    return out


# -- names in words ---------------------------------------------------------------------------
_SUFFIX = re.compile(r"^(?P<base>.*?)(?P<fp8>\+fp8\[(?P<q>\d+)/(?P<n>[^\]]*)\])?(?P<compile>\+compile)?$")


def _entries(cache: CacheResults | None) -> list:
    """Every configuration the cache stage recorded (rows and its choice): ``name``, ``family``, ``config``."""
    return [] if cache is None else [*cache.strategies, *([cache.chosen] if cache.chosen else [])]


def strategy_families(cache: CacheResults | None) -> dict[str, str]:
    """``{strategy: family}`` as the cache stage names them (one family name per strategy)."""
    out: dict[str, str] = {}
    for e in _entries(cache):
        out.setdefault(e.name, e.family.removeprefix("cache/"))
    return out


def tuned_settings(cache: CacheResults | None) -> dict[str, list[str]]:
    """``{strategy: [setting, ...]}``: the scalar settings the cache stage's search varied."""
    values: dict[str, dict[str, set]] = {}
    for e in _entries(cache):
        for k, v in e.config.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                values.setdefault(e.name, {}).setdefault(k, set()).add(repr(v))
    return {n: [k for k, vs in keys.items() if len(vs) > 1] for n, keys in values.items()}


def _config_of(base: str, cache: CacheResults | None) -> dict:
    """The configuration of row ``base``: the cache stage's record, else its name's ``k=v`` settings."""
    for e in _entries(cache):
        if row_name(e.name, e.config) == base:
            return dict(e.config)
    inner = base[base.index("[") + 1:-1] if "[" in base and base.endswith("]") else ""
    return dict(kv.split("=", 1) for kv in inner.split(",") if "=" in kv)


def config_words(name, cache: CacheResults | None) -> str:
    """A configuration as a reviewer reads it: its family and the settings its search varied, e.g.
    ``cache-dit DBCache+TaylorSeer, threshold 0.24`` (``, compiled``, ``, 12 of 42 block linears in
    fp8`` for the twins); a name that is not a cache stage configuration is its own words."""
    m = _SUFFIX.match(str(name))
    base = m.group("base")
    strategy = base.split("[", 1)[0]
    families = strategy_families(cache)
    family = families.get(strategy)
    if family is None:
        return str(name)
    if list(families.values()).count(family) > 1:  # two strategies of one family: say which
        family = f"{family} {strategy}"
    cfg = _config_of(base, cache)
    keys = [k for k in tuned_settings(cache).get(strategy, []) if k in cfg]
    text = family + "".join(f", {k.replace('_', ' ')} {cfg[k]}" for k in keys)
    if m.group("fp8"):
        text += f", {m.group('q')} of {m.group('n')} block linears in fp8"
    if m.group("compile"):
        text += ", compiled"
    return text


def family_name(row: dict, cache: CacheResults | None) -> str:
    """One family name per strategy: the cache stage's, for measured and recorded rows alike."""
    fam = str(row.get("family") or "-")
    strategy = str(row.get("name") or "").split("[", 1)[0]
    if fam.startswith("cache/"):
        return strategy_families(cache).get(strategy) or fam.removeprefix("cache/")
    return fam


def quality_text(psnr, ssim, on: str | None, unit: bool = True) -> str:
    """``33.31 dB / 0.9875 (held-out seeds)``; ``-`` when neither was recorded."""
    if not _is_num(psnr) and not _is_num(ssim):
        return "-"
    p = f"{psnr:.2f}{' dB' if unit else ''}" if _is_num(psnr) else "-"
    q = f"{ssim:.4f}" if _is_num(ssim) else "-"
    return f"{p} / {q} ({ON_TEXT.get(on, on)})"


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def timing_counts(benchmark: BenchmarkResults) -> str:
    """How the speed figures were timed, in one phrase that agrees with every row."""
    t = benchmark.timing
    w, n = benchmark.warmup, benchmark.repeats
    if t is None or t.repeats is None:
        return f"{w} warm-up call(s), {n} timed repeats per configuration (benchmark.warmup / benchmark.repeats)"
    text = (f"the baseline and every configuration the verdict compares: {t.warmup} warm-up call(s), "
            f"{t.repeats} timed repeats each")
    if (t.warmup, t.repeats) != (w, n):
        text += f"; the other rows: {w} warm-up, {n} repeats (benchmark.warmup / benchmark.repeats)"
    return text


def speed_text(row: dict) -> str:
    """``1.31× (1.25–1.36)``; ``parity only`` for a CPU parallel plan; ``-`` when not measured."""
    if row.get("parity_only"):
        return "parity only (CPU processes)"
    sp = row.get("speedup_shown", row.get("speedup"))
    if sp is None:
        return "-"
    lo_hi = row.get("speedup_range")
    vs = " vs 1 GPU" if row.get("devices") else ""  # a plan's speed-up is against its own single-process run
    return f"{sp:.2f}×{vs}" + (f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f})" if lo_hi else "")


def display_name(row: dict) -> str:
    """A row's name with a parallel plan's device count (``ulysses (2 GPUs)``)."""
    return f"{row.get('name')} ({row['devices']})" if row.get("devices") else str(row.get("name"))

# -- how to use the result --------------------------------------------------------------------
LPIPS_NOTE = ("No perceptual figure (LPIPS) beside PSNR/SSIM: the lpips package ships only its linear heads; its "
              "AlexNet/VGG backbone weights are downloaded by torchvision on first use, and runs load nothing "
              "from the network.")


def holdout_meaning(card: dict) -> str:
    """What "held-out" means for this run's card (its snapshot in ``run.json``)."""
    from ..settings import CacheSettings, Generation

    gen = {**Generation().__dict__, **card.get("generation", {})}
    shift = card.get("cache", {}).get("holdout_shift", CacheSettings().holdout_shift)
    seeds = list(gen["holdout_seeds"] or [s + shift for s in gen["seeds"]])
    prompts = gen["holdout_prompts"]
    what = (f"{len(prompts)} other prompts (generation.holdout_prompts)" if prompts
            else "the same prompts (generation.holdout_prompts is not set)")
    return (f"Held-out: seeds the cache stage did not tune on ({', '.join(map(str, seeds)) or '-'}), with {what}; "
            f"calibration: the card's seeds ({', '.join(map(str, gen['seeds'])) or '-'}), on which it tuned.")


def _example_lines(path) -> list[str]:
    """The adapter import and the ``cache_dit.enable_cache(...)`` call of the example file."""
    lines = ["import cache_dit"]
    text = path.read_text() if path.is_file() else ""
    for ln in text.splitlines():
        t = ln.strip()
        if re.match(r"^from \S+_adapter import \S+", t):
            lines.append(t.split("  #")[0] + "  # registers the adapter with cache-dit")
    for ln in text.splitlines():
        if ln.strip().startswith("cache_dit.enable_cache("):
            lines.append(ln.strip())
    return lines if len(lines) == 3 else []


def usage(run, v, results: dict) -> dict | None:
    """How to use the verdict's configuration: ``files``, ``how`` and the ``lines`` to paste, what to
    ``expect`` and ``notes``; None when nothing was chosen. ``results``: every stage's record."""
    # long: one box's facts gathered from the cache stage's files and the benchmark's figures
    cache, bench = results.get("cache"), results.get("benchmark")
    if v.name in ("baseline", "none") or cache is None or cache.chosen is None:
        return None
    cdir = run.stage_dir("cache", create=False)
    up: dict = {}
    if (cdir / "upstream" / "upstream.json").is_file():
        import json

        up = json.loads((cdir / "upstream" / "upstream.json").read_text())
    files = {"adapter module (the file the cache stage ran)": f"cache/{cache.adapter_module}"}
    if up.get("adapter_module"):
        files["the same module, named for import"] = f"cache/upstream/{up['adapter_module']}"
    if up.get("example"):
        files["example script (renders the card's prompts with it)"] = f"cache/upstream/{up['example']}"
    lines = _example_lines(cdir / "upstream" / str(up["example"])) if up.get("example") else []
    notes = [f"From the cache stage: {n}." for n in up.get("notes", [])]
    how = (f"Put cache/upstream/{up['adapter_module']} on your path (copy it beside your code), load the pipeline "
           "as usual, then paste:" if up.get("adapter_module") else "")
    ex = up.get("example_strategy")
    if ex and row_name(ex["name"], ex["config"]) != row_name(v.short, v.config):
        notes.append(f"The example applies {config_words(row_name(ex['name'], ex['config']), cache)} "
                     f"({ex.get('why')}); the shipped configuration does not go through it as written.")
        lines, how = [], ""
    if "compiled" in v.form:
        notes.append("Shipped compiled: after enable_cache, ditbook.accel.compile.compile_regions(pipe.transformer) "
                     "(regional torch.compile); its one-time compile cost is in the verdict.")
    if "fp8" in v.form:
        notes.append("Shipped with block linears in fp8: the layers are listed in cache/results.json fp8.chosen.layers.")
    row = next((r for r in shown_rows(bench.summary, bench, cache) if r["name"] == v.name), {}) if bench else {}
    expect = []
    if v.speedup is not None:
        lo_hi = v.speedup_range
        expect.append(f"{v.speedup:.2f}× end to end" + (f" (timings allow {lo_hi[0]:.2f}–{lo_hi[1]:.2f}×)" if lo_hi else "")
                      + f" on {bench.device}")
    else:
        expect.append("speed-up not established by this run (" + (v.reason or "not timed") + ")")
    parts = [f"{label} {row[k]:.2f}×" for k, label in (("step_speedup", "transformer step"),
                                                      ("decode_speedup", "decode")) if _is_num(row.get(k))]
    if parts and v.timing_unstable:  # the same timings: no per-part figure either
        expect.append("per-part speed-ups not reliable either (the same timings)")
    elif parts:
        expect.append("per part: " + ", ".join(parts))
    if _is_num(row.get("peak_mb")):
        base = bench.baseline.timing.get("peak_memory_mb") if bench.baseline.timing else None
        expect.append(f"peak memory {row['peak_mb']:.0f} MB" + (f" (baseline {base:.0f} MB)" if _is_num(base) else ""))
    if v.holdout is not None:
        expect.append("worst image " + quality_text(v.holdout.psnr_min, v.holdout.ssim_min, HELD_OUT)
                      + (f" over {v.holdout.n} cases" if v.holdout.n else ""))
    return {"files": files, "how": how if lines else "", "lines": lines, "expect": expect, "notes": notes}


__all__ = ["HELD_OUT", "CALIBRATION", "PARITY", "ON_TEXT", "is_cpu_run", "is_parallel", "holdout_records", "shown_rows",
           "speed_text", "display_name", "config_words", "family_name",
           "strategy_families", "tuned_settings", "quality_text", "plan_quality", "timing_counts",
           "usage", "holdout_meaning", "LPIPS_NOTE"]
