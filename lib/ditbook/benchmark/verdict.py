"""The verdict of a run and its acceptance checklist, read from the stages' records.

What ships is decided by one rule, ``ditbook.ship.decide``, over every configuration the cache stage
confirmed on held-out seeds, in every form the benchmark timed (plain, compiled, fp8), with its
checks. An item of the checklist a stage does not record is ``None`` ("not recorded").
"""

from __future__ import annotations

from ..configuration import fp8_suffix, row_name
from ..records import BenchmarkResults, CacheResults, Holdout, ParallelResults, StrategyRow, Verdict
from ..settings import CacheSettings
from ..ship import Candidate, decide

NOT_RECORDED = "not recorded"


def _f(v, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def chosen_row_name(chosen) -> str:
    """The benchmark row of a cache stage configuration (``inputs.cache_configs``)."""
    return row_name(chosen.name, chosen.config)


def fp8_row_name(cache: CacheResults | None) -> str | None:
    """The benchmark row of the cache stage's fp8 composition, or None."""
    f8 = cache.fp8.chosen if cache is not None else None
    return None if f8 is None else row_name(f8.name, f8.config) + fp8_suffix({"layers": f8.layers,
                                                                             "candidates": f8.candidates})


def speed_range(bench: BenchmarkResults | None, name: str) -> list[float] | None:
    """``[low, high]``: the speed-up range ``name``'s end-to-end min/max timings allow."""
    row = bench.row(name) if bench is not None else None
    base = bench.baseline.timing["end_to_end"] if bench is not None and bench.baseline.timing else None
    t = row.timing["end_to_end"] if row is not None and row.timing else None
    if not base or not t or not base.get("min") or not t.get("min"):
        return None
    return [round(base["min"] / t["max"], 3), round(base["max"] / t["min"], 3)]


def timing_unstable(bench: BenchmarkResults | None) -> dict | None:
    """``{drift, limit}`` when the baseline re-timed at the end moved beyond its bound, else None."""
    t = bench.timing if bench is not None else None
    return {"drift": t.drift, "limit": t.limit} if t is not None and t.stable is False else None


def drift_text(t: dict) -> str:
    return (f"the baseline re-timed at the end took {t['drift']:.3f}× its first timing "
            f"(the bound is ±{t['limit']:.0%}, benchmark.timing_drift)")


def _holdout(q) -> Holdout | None:
    return None if q is None else Holdout(q.psnr_min, q.ssim_min, q.n, q.frame_reduce)


def candidates(bench: BenchmarkResults | None, cache: CacheResults) -> list[Candidate]:
    """Every configuration the cache stage ran on held-out seeds, in every form the benchmark timed."""
    out = []
    forms: list[tuple[str, str, StrategyRow | None, object]] = [
        (row_name(r.name, r.config), "plain", r, r.quality) for r in cache.holdout_rows(passed_only=False)]
    f8, f8_row = cache.fp8.chosen, fp8_row_name(cache)
    if f8 is not None:
        forms.append((f8_row, "fp8", None, f8.holdout_quality))
    seen = set()
    for name, form, rec, q in forms:
        for row_n, f in ((name, form), (f"{name}+compile", "fp8+compiled" if form == "fp8" else "compiled")):
            if row_n in seen or (f != form and (bench is None or bench.row(row_n) is None)):
                continue
            seen.add(row_n)
            src = rec if rec is not None else f8
            c = Candidate(row_n, src.family, src.config, technique=src.name, form=f, psnr=q and q.psnr_min,
                          ssim=q and q.ssim_min, n=q and q.n, skipped_fraction=src.skipped_fraction)
            _measured(c, bench, cache)
            if rec is not None and rec.stopped:
                c.failed.append(f"stopped on held-out seeds: {rec.stopped}")
            out.append(c)
    return out


def _measured(c: Candidate, bench: BenchmarkResults | None, cache: CacheResults) -> None:
    """``c``'s timing from the benchmark, and the checks its form carries."""
    row = bench.row(c.name) if bench is not None else None
    if row is not None:
        c.speedup, c.speedup_range = row.speedup, speed_range(bench, c.name)
        c.e2e_ms = round(row.timing["end_to_end"]["median"] * 1e3, 2) if row.timing else None
        if row.error:
            c.failed.append(f"it failed in the benchmark: {row.error}")
        elif row.passed is False:
            c.failed.append("its images in the benchmark do not pass the gates")
    chosen = cache.chosen
    if "compiled" in c.form and chosen is not None and c.name.startswith(chosen_row_name(chosen)):
        check = cache.compiled
        if check.ran and check.ok is not True:
            c.failed.append("the cache stage's compiled check found the compiled images differ" if check.quality
                            else f"the cache stage's compiled check failed: {check.error}")
    if "fp8" in c.form:
        rerun = cache.reproduction.fp8
        if not rerun or rerun.get("ok") is not True:
            c.failed.append("its rerun in a fresh process " + (f"failed: {rerun['error']}" if rerun and rerun.get("error")
                            else "differs" if rerun else "did not run"))


def verdict(bench: BenchmarkResults | None, cache: CacheResults | None) -> Verdict:
    """The ship rule over the measured candidates, as the pages show it."""
    gates = bench.gates.get("cache") if bench is not None and bench.gates.get("cache") else \
        cache.gates if cache is not None else CacheSettings().gates
    unstable = timing_unstable(bench)
    if cache is None:
        return Verdict("none", False, "the cache stage recorded no results, so no configuration was chosen", "", gates)
    decision = decide(candidates(bench, cache), gates, timed=bench is not None,
                      timing_unstable=drift_text(unstable) if unstable else None)
    c = decision.chosen
    if c is None:
        c = next((x for x in candidates(bench, cache) if cache.chosen and x.name == chosen_row_name(cache.chosen)), None)
    if c is None:
        why = f"the cache stage refused caching ({cache.refused})" if cache.refused else decision.reason
        return Verdict("baseline", False, f"{why}; ship the baseline", decision.rule, gates, refused=decision.refused)
    own = next((r["why_not"] for r in decision.refused if r["name"] == c.name), None)
    reason = decision.reason if decision.ship else (
        "the benchmark has not timed it; speed-up unknown" if bench is None else
        decision.reason if unstable or own is None else f"{own}; ship the baseline")
    v = Verdict(c.name, decision.ship and decision.chosen is c, reason, decision.rule, gates, short=c.technique,
                family=c.family, config=c.config, form=c.form, speedup=None if unstable else c.speedup,
                speedup_range=None if unstable else c.speedup_range, e2e_ms=c.e2e_ms,
                holdout=Holdout(c.psnr, c.ssim, c.n) if c.psnr is not None else None,
                passes_gates=c.passes(gates) if c.psnr is not None else None, skipped_fraction=c.skipped_fraction,
                timing_unstable=unstable, runner_ups=decision.runner_ups, refused=decision.refused)
    row = bench.row(c.name) if bench is not None else None
    if row is not None:
        v.measured_psnr_min, v.measured_ssim_min = row.psnr_min, row.ssim_min
        if "compiled" in c.form:
            v.compile = {k: row.params.get("compile", {}).get(k) for k in ("compile_s", "first_call_s", "steady_call_s")}
    f8 = cache.fp8.chosen
    if "fp8" in c.form and f8 is not None:
        v.fp8 = {"layers": len(f8.layers), "candidates": f8.candidates, "kept": len(f8.kept)}
        v.holdout = _holdout(f8.holdout_quality)
    elif cache.chosen and c.name.removesuffix("+compile") == chosen_row_name(cache.chosen):
        v.holdout = _holdout(cache.chosen.holdout_quality) or v.holdout  # with frame_reduce for videos
    return v


def _cases(h: Holdout) -> str:
    """What the held-out figures were taken over: images, or videos judged by their worst frame."""
    return "videos (worst frame of each)" if h.frame_reduce else "images"


def runner_up_text(v: Verdict, shown: int = 3) -> str:
    """One sentence: the rule, and the (``shown`` first) runners-up with why they were not chosen."""
    ups = v.runner_ups
    text = f"Chosen by the ship rule: {v.rule}."
    if not ups:
        return text + " No other configuration passes on held-out seeds and every check."
    parts = []
    for r in ups[:shown]:
        sp = f"{r['speedup']:.2f}×" if r.get("speedup") is not None else "speed-up not measured"
        parts.append(f"{r['name']} ({sp}, held-out worst PSNR {_f(r.get('psnr'))} dB): {r['why_not']}")
    more = f"; {len(ups) - shown} more in benchmark/results.json (verdict.runner_ups)" if len(ups) > shown else ""
    return text + (" Runners-up" if len(ups) > 1 else " Runner-up") + ": " + "; ".join(parts) + more + "."


def headline(v: Verdict, words: str | None = None) -> str:
    """One sentence: what to ship, how much faster, at what held-out quality against the gates
    (``words``: the configuration in words, in place of its key)."""
    g, h = v.gates, v.holdout
    name = words or v.name
    q = (f"held-out worst PSNR {_f(h.psnr_min)} dB (gate > {g.psnr:g}), SSIM {_f(h.ssim_min, 4)} (gate > {g.ssim:g})"
         + (f" on {h.n} {_cases(h)}" if h.n else "") if h else "no held-out quality recorded")
    sp = f"{v.speedup:.2f}× end to end" if v.speedup is not None else "speed-up not measured"
    if v.timing_unstable:  # the reason after the colon says by how much
        sp = "timing unstable"
    if v.speedup is not None and v.speedup_range:
        sp += f" (timings allow {v.speedup_range[0]:.2f}–{v.speedup_range[1]:.2f}×)"
    if v.compile and v.compile.get("compile_s") is not None:
        sp += f" (one-time compile {v.compile['compile_s']:.1f} s)"
    if v.ship:
        return f"Ship {name}: {sp}, {q}."
    if v.name == "none":
        return f"No verdict: {v.reason}."
    if v.name == "baseline":
        return f"Ship the baseline: {v.reason.removesuffix('; ship the baseline')}."
    return f"Do not ship {name} ({sp}, {q}): {v.reason}."


def fp8_text(v: Verdict, cache: CacheResults | None) -> str:
    """One sentence on fp8 (card ``cache.fp8``): shipped, or why not; "" when not asked for."""
    rec = cache.fp8 if cache is not None else None
    if v.fp8:
        return (f"fp8: shipped with {v.fp8['layers']} of {v.fp8['candidates']} block linears in fp8 "
                f"({v.fp8['kept']} kept in the model's dtype), the schedule tuned with them.")
    if rec is None:
        return ""
    if rec.refused:
        return f"fp8: refused: {rec.refused}."
    if rec.ran and rec.chosen is None:
        return f"fp8: no composition: {rec.reason or 'none passed on held-out seeds'}."
    if rec.chosen is not None:
        name = fp8_row_name(cache)
        why = next((r["why_not"] for r in v.runner_ups + v.refused if r["name"].startswith(name)), v.reason)
        return f"fp8: the composition {name} was not shipped: {why}."
    return ""


# -- the acceptance checklist -----------------------------------------------------------------
def _item(item: str, ok: bool | None, figure: str) -> dict:
    return {"item": item, "ok": ok, "figure": figure}


def _stage(meta: dict, stage: str) -> dict:
    return meta.get("stages", {}).get(stage, {})


def _gate_item(meta: dict, intake) -> dict:
    st = _stage(meta, "intake")
    if st.get("status") == "failed":
        return _item("gate check", False, str(st.get("error") or "intake failed"))
    if st.get("status") != "passed" or intake is None:
        return _item("gate check", None, NOT_RECORDED)
    what = "videos" if any(r.frames for r in intake.images) else "images"
    return _item("gate check", True, f"card complete; intake loaded the model offline and rendered "
                                     f"{len(intake.images)} baseline {what}")


def _plan_item(meta: dict, inspect) -> dict:
    from ..runs import approval_state

    state = approval_state(meta, inspect.plan_hash if inspect is not None else None)  # what the stages accepted
    made, approved = state["plan_hash"], state["approved"]
    if state["ok"] is None:
        return _item("plan approved", None, NOT_RECORDED)
    if state["ok"]:
        return _item("plan approved", True, f"plan {made} approved ({state['source']})")
    return _item("plan approved", False, f"the card approves {approved or 'nothing'}, the inspection made {made}")


def _caching_off_item(cache: CacheResults | None) -> dict:
    name = "caching off reproduces the baseline"
    checked = [c for c in cache.adapter_checks if c.get("checked")] if cache is not None else []
    if cache is None or not cache.adapter_checks:
        return _item(name, None, NOT_RECORDED)
    if not checked:
        return _item(name, None, "no strategy could be checked")
    failed = [f"{c['name']} could not run with caching off ({c['error']})" for c in checked if c.get("error")]
    bad = [c for c in checked if not c.get("reproduces") and not c.get("error")]
    if failed or bad:  # a check that raised has no difference to show: it is named with its error
        worst = max(c.get("max_abs") or 0.0 for c in bad) if bad else None
        differs = [f"differs for {', '.join(c['name'] for c in bad)} (max abs diff {worst:.3g})"] if bad else []
        return _item(name, False, "; ".join(differs + failed))
    worst = max(c.get("max_abs") or 0.0 for c in checked)
    cases = {c.get("cases") for c in checked} - {None}
    on = f" on {min(cases)} cases each" if cases else ""
    return _item(name, True, f"{len(checked)} strategies{on}, max abs diff {worst:.3g}")


def sharding_verified(parallel: ParallelResults, plan: str) -> bool | None:
    """Whether every split of ``plan`` was checked on every rank (``records.Sharding.verified``)."""
    rec = parallel.sharding.get(plan)
    return None if rec is None else rec.verified


def _parity_item(parallel: ParallelResults | None, meta: dict) -> dict:
    name = "parity per plan, sharding verified"
    st = _stage(meta, "parallel")
    if st.get("status") == "failed":
        return _item(name, False, str(st.get("error")))
    if parallel is None:
        return _item(name, None, NOT_RECORDED)
    tail = ("; not run: " + "; ".join(f"{n.name} ({n.reason})" for n in parallel.not_run)) if parallel.not_run else ""
    if not parallel.plans:
        return _item(name, None, "no plan was run" + tail)
    failed = [p.name for p in parallel.plans if not p.passed]
    q = [p.quality.psnr_min for p in parallel.plans if p.quality is not None and p.quality.psnr_min is not None]
    parity = (f"{len(parallel.plans) - len(failed)}/{len(parallel.plans)} plans run pass parity"
              + (f" (worst PSNR {min(q):.1f} dB)" if q else ""))
    sharding = {p.name: sharding_verified(parallel, p.name) for p in parallel.plans}
    if failed:
        return _item(name, False, f"{parity}; failing: {', '.join(failed)}{tail}")
    if any(s is False for s in sharding.values()):
        return _item(name, False, f"{parity}; sharding not as planned: "
                                  f"{', '.join(n for n, s in sharding.items() if s is False)}{tail}")
    if any(s is None for s in sharding.values()):
        return _item(name, None, f"{parity}; sharding {NOT_RECORDED}{tail}")
    return _item(name, True, f"{parity}; sharding verified on every plan{tail}")


def _noise_item(cache: CacheResults | None, bench: BenchmarkResults | None) -> dict:
    nf = cache.noise_floor if cache is not None else {}
    g = cache.gates if cache is not None else CacheSettings().gates
    parts, floors = [], []
    if nf.get("rerun_vs_intake"):
        p = nf["rerun_vs_intake"].get("psnr_min")
        floors.append(p)
        diff = nf.get("rerun_max_abs")  # None where the cache stage refused before its re-run
        parts.append(f"re-run vs intake {_f(p, 1)} dB (max abs diff {'-' if diff is None else f'{diff:.3g}'})")
    if nf.get("backend_vs_rerun"):
        p = nf["backend_vs_rerun"].get("psnr_min")
        floors.append(p)
        parts.append(f"backend {nf.get('other_backend')} {_f(p, 1)} dB")
    if bench is not None and bench.noise_floor and bench.noise_floor.get("psnr_min") is not None:
        floors.append(bench.noise_floor["psnr_min"])
        parts.append(f"benchmark re-render {_f(bench.noise_floor['psnr_min'], 1)} dB")
    if not parts:
        return _item("noise floor", None, NOT_RECORDED)
    floors = [f for f in floors if f is not None]
    ok = bool(floors) and min(floors) > g.psnr
    return _item("noise floor", ok, "calibration seeds rendered twice: " + ", ".join(parts) +
                 (f" — above the {g.psnr:g} dB gate" if ok else f" — not above the {g.psnr:g} dB gate"))


def _holdout_item(v: Verdict, cache: CacheResults | None) -> dict:
    if cache is None:
        return _item("held-out confirmation", None, NOT_RECORDED)
    if v.name in ("baseline", "none"):
        return _item("held-out confirmation", False, "no configuration passed on held-out seeds")
    h, g = v.holdout, v.gates
    if h is None:
        return _item("held-out confirmation", None, NOT_RECORDED)
    return _item("held-out confirmation", bool(v.passes_gates),
                 f"{v.short} on held-out seeds: worst PSNR {_f(h.psnr_min)} dB (> {g.psnr:g}), "
                 f"SSIM {_f(h.ssim_min, 4)} (> {g.ssim:g})" + (f", {h.n} {_cases(h)}" if h.n else ""))


def _timing_item(bench: BenchmarkResults | None) -> dict:
    """Whether the baseline's speed held through the benchmark (re-timed at the end against the start)."""
    t = bench.timing if bench is not None else None
    if t is None or t.drift is None:
        return _item("timing stable", None, NOT_RECORDED if bench is None else "baseline drift " + NOT_RECORDED)
    figure = drift_text({"drift": t.drift, "limit": t.limit})
    firm = f"; baseline and verdict rows: {t.warmup} warm-up, {t.repeats} repeats" if t.warmup is not None else ""
    if not t.stable:
        return _item("timing stable", False, f"timing unstable: {figure}{firm}; the speed-ups of this run are not reliable")
    return _item("timing stable", True, f"{figure}{firm}")


def checklist(meta: dict, results: dict, v: Verdict | None = None) -> list[dict]:
    """The acceptance checklist ``[{item, ok (True/False/None), figure}]`` from each stage's record."""
    v = v or verdict(results.get("benchmark"), results.get("cache"))
    return [
        _gate_item(meta, results.get("intake")),
        _plan_item(meta, results.get("inspect")),
        _caching_off_item(results.get("cache")),
        _parity_item(results.get("parallel"), meta),
        _noise_item(results.get("cache"), results.get("benchmark")),
        _holdout_item(v, results.get("cache")),
        _timing_item(results.get("benchmark")),
    ]


def read_stage_results(run) -> dict:
    """Every stage's record of ``run`` (None where a stage wrote none)."""
    return {s: run.results_or_none(s) for s in ("intake", "inspect", "cache", "parallel", "benchmark")}


__all__ = ["verdict", "candidates", "chosen_row_name", "fp8_row_name", "speed_range", "timing_unstable",
           "runner_up_text", "headline", "checklist", "read_stage_results", "fp8_text", "drift_text", "NOT_RECORDED"]
