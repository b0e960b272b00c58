"""The verdict of a run and its acceptance checklist, read from the stages' results.

One decision, made once: the cache stage chooses the configuration (``cache/results.json``
``chosen``, confirmed on held-out seeds). The benchmark stage does not choose again; it times
that configuration beside the baseline. The verdict is that configuration, its measured
speed-up and its held-out quality against the cache gates, and whether it is worth shipping.

Compiled (card ``benchmark.compile``, and ``cache.compile`` for the cache stage's own check): the
benchmark also times ``<chosen>+compile``. The verdict ships that twin instead when it was measured
here, passed its gates on the benchmark's images, the cache stage's compiled check (when it ran)
found compiling does not change the chosen configuration's images, and it is faster — so the
shipped configuration is the fastest correct one of the two, and its one-time compile cost is
reported beside it (``compile``: ``compile_s``, ``first_call_s``, ``steady_call_s``,
``uncompiled_speedup``). A faster twin that fails a check is not shipped and ``compile`` says why.

fp8 (card ``cache.fp8``): the cache stage also tunes the chosen strategy with the block linears in
fp8 and confirms it on held-out seeds (``cache.fp8_tune``); the benchmark times that composition
(and its compiled twin). The verdict ships it instead when it is faster than the choice so far,
passed on held-out seeds, reproduced in the fresh process and passed its gates on the
benchmark's images (``fp8``: ``shipped`` or ``why_not``, ``plain`` the configuration without fp8).

The checklist reads what each stage recorded; an item a stage does not record is ``None``
("not recorded"), never a green check.
"""

from __future__ import annotations

from ..quality import Gates
from ..settings import CacheSettings
from .shown import chosen_row_name, fp8_row_name
from .summary import MIN_USEFUL_SPEEDUP

NOT_RECORDED = "not recorded"


def _f(v, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def cache_gates(cache: dict | None) -> Gates:
    g = (cache or {}).get("gates") or {}
    return Gates.from_dict(g) if g else CacheSettings().gates


def verdict(benchmark: dict | None, cache: dict | None) -> dict:
    """The configuration to ship (the cache stage's choice), its speed-up measured by the
    benchmark and its held-out quality against the gates in force (the benchmark's record of the
    card's ``cache.gates``, else the cache stage's); ``ship`` False names why not."""
    bench_gates = ((benchmark or {}).get("gates") or {}).get("cache")
    gates = Gates.from_dict(bench_gates) if bench_gates else cache_gates(cache)
    out = {"name": "baseline", "short": "baseline", "family": "baseline", "config": None, "ship": False,
           "speedup": None, "e2e_ms": None, "holdout": None, "gates": {"psnr": gates.psnr, "ssim": gates.ssim},
           "passes_gates": None, "chosen_by": "cache stage", "reason": ""}
    if not cache:
        out["name"] = out["short"] = "none"
        out["reason"] = "the cache stage recorded no results, so no configuration was chosen"
        return out
    chosen = cache.get("chosen")
    if not chosen:
        out["reason"] = _no_choice_reason(cache)
        return out
    detail = cache.get("chosen_detail") or {}
    hq = detail.get("holdout_quality") or {}
    name = chosen_row_name(chosen)
    out.update(name=name, short=str(chosen["name"]), family=str(chosen.get("family")), config=chosen.get("config"),
               skipped_fraction=detail.get("skipped_fraction"))
    if hq:
        out["holdout"] = {"psnr_min": hq.get("psnr_min"), "ssim_min": hq.get("ssim_min"), "n": hq.get("n")}
        if hq.get("frame_reduce"):  # videos: each one's figures are its worst frame's
            out["holdout"]["frame_reduce"] = hq["frame_reduce"]
        p, s = hq.get("psnr_min"), hq.get("ssim_min")
        out["passes_gates"] = bool(p is not None and s is not None and p > gates.psnr and s > gates.ssim)
    rows = {r.get("name"): r for r in ((benchmark or {}).get("summary") or [])}
    row = rows.get(name)
    if row is not None and row.get("source") == "measured here":
        out["speedup"], out["e2e_ms"] = row.get("speedup"), row.get("e2e_ms")
        out["measured_psnr_min"], out["measured_ssim_min"] = row.get("psnr_min"), row.get("ssim_min")
    _mark_unstable(out, benchmark)
    twin = compiled_twin(benchmark, cache, name, out["speedup"]) if "timing_unstable" not in out else None
    if twin is not None:
        out["compile"] = twin
        if twin.get("shipped") and out["passes_gates"] is True:
            out.update(name=twin["name"], speedup=twin["speedup"], e2e_ms=twin["e2e_ms"])
    f8 = fp8_choice(benchmark, cache, out, gates) if "timing_unstable" not in out else None
    if f8 is not None:
        out["fp8"] = f8
        if f8["shipped"]:
            _ship_fp8(out, f8, benchmark, cache)
    out.update(rule_and_runner_ups(benchmark, cache, out))
    out["speedup_range"] = None if "timing_unstable" in out else speedup_range(benchmark, out["name"])
    _decide(out, benchmark, name, bool(hq))
    return out


def fp8_choice(benchmark: dict | None, cache: dict | None, current: dict, gates: Gates) -> dict | None:
    """The cache stage's fp8 composition (``cache.fp8``) beside the verdict so far: ``shipped``
    when it passed on held-out seeds, reproduced in the fresh process, passed its gates on the
    benchmark's images (it or its compiled twin, the faster) and is faster than ``current``;
    else ``why_not``. None when the cache stage found none."""
    f8 = ((cache or {}).get("fp8") or {}).get("chosen")
    if not f8:
        return None
    base = fp8_row_name(cache)
    hq = f8.get("holdout_quality") or {}
    p, s = hq.get("psnr_min"), hq.get("ssim_min")
    out = {"name": base, "layers": len(f8.get("layers") or []), "candidates": f8.get("candidates"),
           "kept": len(f8.get("kept") or []), "config": f8.get("config"), "skipped_fraction": f8.get("skipped_fraction"),
           "holdout": {"psnr_min": p, "ssim_min": s, "n": hq.get("n")}, "speedup": None, "e2e_ms": None,
           "plain": current["name"], "plain_speedup": current.get("speedup"), "shipped": False, "why_not": None}
    rows = {r.get("name"): r for r in ((benchmark or {}).get("summary") or []) if r.get("source") == "measured here"}
    timed = [(n, rows[n]) for n in (base, f"{base}+compile") if n in rows]
    good = [(n, r) for n, r in timed if r.get("passed") and not r.get("error") and r.get("speedup") is not None]
    repro = ((cache or {}).get("reproduction") or {}).get("fp8") or {}
    if not (p is not None and s is not None and p > gates.psnr and s > gates.ssim):
        out["why_not"] = "it does not meet the gates on held-out seeds"
    elif repro.get("ok") is not True:
        out["why_not"] = ("its rerun in a fresh process " + (f"failed: {repro['error']}" if repro.get("error") else
                          f"differs (max abs {repro['max_abs']:.3g})" if repro.get("max_abs") is not None else "did not run"))
    elif not timed:
        out["why_not"] = "the benchmark did not time it"
    elif not good:
        out["why_not"] = "it did not pass its gates on the benchmark's images"
    else:
        name, row = max(good, key=lambda nr: nr[1]["speedup"])
        out.update(name=name, speedup=row["speedup"], e2e_ms=row.get("e2e_ms"),
                   measured_psnr_min=row.get("psnr_min"), measured_ssim_min=row.get("ssim_min"))
        if current.get("speedup") is not None and row["speedup"] <= current["speedup"]:
            out["why_not"] = f"not faster ({row['speedup']:.2f}× against {current['speedup']:.2f}× without fp8)"
            if not name.endswith("+compile"):
                out["why_not"] += ("; its compiled form was not timed (benchmark.compile is off), and fp8's "
                                   "quantization is fused, and pays off, only compiled")
        elif current.get("passes_gates") is not True:
            out["why_not"] = "the configuration it was tuned from does not pass on held-out seeds"
        else:
            out["shipped"] = True
    return out


def _ship_fp8(out: dict, f8: dict, benchmark: dict | None, cache: dict | None) -> None:
    """The verdict becomes the fp8 composition: its name, speed-up, held-out quality and config."""
    out.update(name=f8["name"], speedup=f8["speedup"], e2e_ms=f8["e2e_ms"], holdout=f8["holdout"],
               skipped_fraction=f8["skipped_fraction"],
               config={**(f8["config"] or {}), "fp8_layers": list(cache["fp8"]["chosen"]["layers"]),
                       "fp8_candidates": f8["candidates"]},
               measured_psnr_min=f8.get("measured_psnr_min"), measured_ssim_min=f8.get("measured_ssim_min"))
    plain = (out.get("compile") or {})
    if f8["name"].endswith("+compile"):
        twin = compiled_twin(benchmark, cache, f8["name"].removesuffix("+compile"), None)
        out["compile"] = {**(twin or {}), "shipped": True, "why_not": None}
    elif plain:
        out["compile"] = {**plain, "shipped": False, "why_not": f"the fp8 composition {f8['name']} is faster"}


def _decide(out: dict, benchmark: dict | None, name: str, has_holdout: bool) -> None:
    """Set ``ship`` and ``reason`` of a verdict whose figures are in place."""
    if out["passes_gates"] is not True:
        out["reason"] = (f"{name} has no held-out quality record" if not has_holdout else
                         f"{name} does not meet the gates on held-out seeds")
    elif "timing_unstable" in out:
        out["reason"] = f"timing unstable: {drift_text(out['timing_unstable'])}, so no speed-up is reported"
    elif benchmark is None:
        out["reason"] = "the benchmark stage has not timed it; speed-up unknown"
    elif out["speedup"] is None:
        out["reason"] = f"the benchmark did not time {name}; speed-up unknown"
    elif out["speedup"] < MIN_USEFUL_SPEEDUP:
        out["reason"] = (f"{out['speedup']:.2f}× does not beat the baseline by the {MIN_USEFUL_SPEEDUP:g}× a change "
                         "must gain over the timing noise; ship the baseline")
    elif out.get("speedup_range") and out["speedup_range"][0] < 1.0:
        lo, hi = out["speedup_range"]
        out["reason"] = (f"{out['speedup']:.2f}× by the medians, but the timings allow {lo:.2f}–{hi:.2f}×, a slowdown "
                         "among them: the speed-up is not shown; ship the baseline (more benchmark.repeats, or a "
                         "quieter host, narrow the range)")
    else:
        out["ship"] = True
        out["reason"] = "chosen by the cache stage, confirmed on held-out seeds, timed by the benchmark"
        f8 = out.get("fp8") or {}
        if f8.get("shipped"):
            out["reason"] += (f"; with {f8['layers']} of {f8['candidates']} block linears in fp8 (the schedule tuned "
                              f"with them, {f8['kept']} most sensitive kept), faster than {f8['plain']}")
        if (out.get("compile") or {}).get("shipped"):
            out["reason"] += "; compiled, the faster of the two correct forms"


def _no_choice_reason(cache: dict) -> str:
    refused = cache.get("refused")
    if refused:
        return f"the cache stage refused caching ({refused}), so no cache configuration passed; ship the baseline"
    return "no cache configuration passed the gates on held-out seeds; ship the baseline"


def _mark_unstable(out: dict, benchmark: dict | None) -> None:
    """A speed-up read against a drifting baseline is noise: ``timing_unstable`` replaces it."""
    timing = timing_state(benchmark)
    if timing and timing["stable"] is False:
        out["timing_unstable"] = {"drift": timing["drift"], "limit": timing["limit"]}
        out["speedup"] = None


def timing_state(benchmark: dict | None) -> dict | None:
    """The benchmark's timing record (``measure.timing_record``: ``drift``, ``limit``, ``stable``),
    or one made from an older record's ``baseline_drift`` and the default limit; None when the
    baseline was not re-timed."""
    from ..settings import BenchmarkSettings

    rec = (benchmark or {}).get("timing")
    if rec and rec.get("drift") is not None:
        return rec
    drift = (benchmark or {}).get("baseline_drift")
    if drift is None:
        return None
    limit = BenchmarkSettings().timing_drift
    return {"drift": drift, "limit": limit, "stable": abs(drift - 1.0) <= limit}


def drift_text(t: dict) -> str:
    return (f"the baseline re-timed at the end took {t['drift']:.3f}× its first timing "
            f"(the bound is ±{t['limit']:.0%}, benchmark.timing_drift)")


def speedup_range(benchmark: dict | None, name: str) -> list[float] | None:
    """The speed-up range the end-to-end timings of ``name`` allow (``benchmark.shown.speed_spread``)."""
    from .shown import speed_spread

    lo_hi = speed_spread(benchmark).get(name)
    return [round(lo_hi[0], 3), round(lo_hi[1], 3)] if lo_hi else None


RULE = "most work skipped among the configurations passing on held-out seeds"


def rule_and_runner_ups(benchmark: dict | None, cache: dict | None, v: dict) -> dict:
    """``{rule, runner_ups}``: the cache stage's rule (:data:`RULE`) and every other configuration
    that passes and is faster here or better on held-out seeds than the chosen one, each with
    ``{name, speedup, psnr_min, ssim_min, quality_on, skipped_fraction, why_not}``. A parallel plan
    run as CPU processes has no speed-up and is no runner-up."""
    from .shown import HELD_OUT, holdout_records, is_cpu_run, is_parallel

    chosen = str(v.get("name")).removesuffix("+compile")  # the shipped twin is the chosen configuration compiled
    f8 = v.get("fp8") or {}
    plain = str(f8.get("plain") or "").removesuffix("+compile") if f8.get("shipped") else None
    if chosen in ("baseline", "none"):
        return {"rule": RULE, "runner_ups": []}
    held = holdout_records(cache)
    sp0, p0, k0 = v.get("speedup"), (v.get("holdout") or {}).get("psnr_min"), v.get("skipped_fraction")
    k0 = k0 if k0 is not None else (held.get(chosen) or {}).get("skipped_fraction")
    rows = {r.get("name"): r for r in ((benchmark or {}).get("summary") or []) if r.get("source") == "measured here"}
    out = []
    names = [n for n in held if n != chosen] + [n for n in rows if n not in held and n != chosen]
    for name in names:
        rec, row = held.get(name), rows.get(name) or {}
        if name == f"{chosen}+compile" or row.get("family") == "baseline" or row.get("error"):
            continue
        if is_cpu_run(benchmark) and is_parallel(row):
            continue
        sp = row.get("speedup")
        p, s = ((rec or {}).get("psnr_min"), (rec or {}).get("ssim_min")) if rec else (row.get("psnr_min"), row.get("ssim_min"))
        passed = (rec or {}).get("passed") if rec else row.get("passed")
        faster = sp is not None and sp0 is not None and sp > sp0
        better = rec is not None and p is not None and p0 is not None and p > p0
        if not passed or not (faster or better):
            continue
        if plain and name in (plain, f"{plain}+compile"):
            why = f"the same strategy without fp8: slower than the fp8 composition ({f8['speedup']:.2f}×)"
        elif rec is None:
            why = "not confirmed on held-out seeds (its figures are on the calibration seeds only)"
        elif k0 is not None and (rec.get("skipped_fraction") or 0) < k0:
            why = f"skips less work ({rec['skipped_fraction']:.3f} of block evaluations against {k0:.3f})"
        else:
            why = "skips as much work; the rule's tie-break is the held-out PSNR"
        out.append({"name": name, "speedup": sp, "psnr_min": p, "ssim_min": s,
                    "quality_on": HELD_OUT if rec else "calibration",
                    "skipped_fraction": (rec or {}).get("skipped_fraction"), "why_not": why})
    out.sort(key=lambda r: -(r["speedup"] or 0))
    return {"rule": RULE, "runner_ups": out}


def runner_up_text(v: dict, shown: int = 3) -> str:
    """One sentence: the rule, and the (``shown`` fastest) runners-up with why they were not chosen
    (the report lists them itself, each in words: ``report.runners_up``)."""
    ups = v.get("runner_ups") or []
    text = f"Chosen by the cache stage's rule: {v.get('rule', RULE)}."
    if not ups:
        return text + " No other passing configuration is faster or better on held-out seeds."
    parts = []
    for r in ups[:shown]:
        sp = f"{r['speedup']:.2f}×" if r.get("speedup") is not None else "speed-up not measured"
        parts.append(f"{r['name']} ({sp}, {r['quality_on']} worst PSNR {_f(r.get('psnr_min'))} dB): {r['why_not']}")
    more = f"; {len(ups) - shown} more in benchmark/results.json (verdict.runner_ups)" if len(ups) > shown else ""
    why = (" — the rule counts work skipped, which does not depend on this host's timing noise"
           if any(str(r.get("why_not", "")).startswith("skips less") for r in ups[:shown]) else "")
    return text + (" Runners-up" if len(ups) > 1 else " Runner-up") + ": " + "; ".join(parts) + more + why + "."


def compiled_twin(benchmark: dict | None, cache: dict | None, name: str, speedup: float | None) -> dict | None:
    """The benchmark's ``<name>+compile`` row beside the chosen configuration (None when it was not
    measured): its speed-up, its compile cost, and ``shipped`` (faster and correct) or ``why_not``."""
    twin_name = f"{name}+compile"
    rows = {r.get("name"): r for r in ((benchmark or {}).get("summary") or [])}
    row = rows.get(twin_name)
    if row is None or row.get("source") != "measured here":
        return None
    configs = {c.get("name"): c for c in ((benchmark or {}).get("configs") or []) if isinstance(c, dict)}
    cost = ((configs.get(twin_name) or {}).get("params") or {}).get("compile") or {}
    out = {"name": twin_name, "speedup": row.get("speedup"), "e2e_ms": row.get("e2e_ms"),
           "uncompiled_speedup": speedup, "psnr_min": row.get("psnr_min"), "ssim_min": row.get("ssim_min"),
           "compile_s": cost.get("compile_s"), "first_call_s": cost.get("first_call_s"),
           "steady_call_s": cost.get("steady_call_s"), "shipped": False, "why_not": None}
    check = (cache or {}).get("compiled") or {}
    if row.get("error") or not row.get("passed"):
        out["why_not"] = f"{twin_name} did not pass its gates on the benchmark's images"
    elif check.get("ran") and check.get("ok") is not True:
        out["why_not"] = ("the cache stage's compiled check found the compiled images differ from the uncompiled "
                          "ones" if check.get("quality") else f"the cache stage's compiled check failed: {check.get('error')}")
    elif out["speedup"] is None or speedup is None:
        out["why_not"] = "speed-up unknown"
    elif out["speedup"] <= speedup:
        out["why_not"] = f"not faster ({out['speedup']:.2f}× compiled against {speedup:.2f}× uncompiled)"
    else:
        out["shipped"] = True
    return out


def _cases(h: dict) -> str:
    """What the held-out figures were taken over: images, or videos judged by their worst frame."""
    return "videos (worst frame of each)" if h.get("frame_reduce") else "images"


def headline(v: dict, words: str | None = None) -> str:
    """One sentence: what to ship, how much faster, at what held-out quality against the gates
    (``words``: the configuration as a reviewer reads it, in place of its key)."""
    g = v["gates"]
    name = words or v["name"]
    h = v.get("holdout") or {}
    q = (f"held-out worst PSNR {_f(h.get('psnr_min'))} dB (gate > {g['psnr']:g}), "
         f"SSIM {_f(h.get('ssim_min'), 4)} (gate > {g['ssim']:g})" + (f" on {h['n']} {_cases(h)}" if h.get("n") else "")
         if h else "no held-out quality recorded")
    sp = f"{v['speedup']:.2f}× end to end" if v.get("speedup") is not None else "speed-up not measured"
    if v.get("timing_unstable"):  # the reason after the colon says by how much
        sp = "timing unstable" if not v["ship"] else f"timing unstable ({drift_text(v['timing_unstable'])})"
    if v.get("speedup") is not None and v.get("speedup_range"):
        sp += f" (timings allow {v['speedup_range'][0]:.2f}–{v['speedup_range'][1]:.2f}×)"
    c = v.get("compile") or {}
    if c.get("shipped") and c.get("compile_s") is not None:
        sp += f" (one-time compile {c['compile_s']:.1f} s)"
    if v["ship"]:
        return f"Ship {name}: {sp}, {q}."
    if v["name"] == "none":
        return f"No verdict: {v['reason']}."
    if v["name"] == "baseline":
        return f"Ship the baseline: {v['reason'].removesuffix('; ship the baseline')}."
    return f"Do not ship {name} ({sp}, {q}): {v['reason']}."


def fp8_text(v: dict, cache: dict | None) -> str:
    """One sentence on the fp8 decision (card ``cache.fp8``): the composition shipped, or why not;
    no composition found, or the search refused, with the stage's reason; "" when the card did not
    ask for fp8."""
    f8 = v.get("fp8") or {}
    if f8:
        what = (f"{f8['name']} ({f8['layers']} of {f8['candidates']} block linears in fp8, {f8['kept']} kept in the "
                f"model's dtype; held-out worst PSNR {_f((f8.get('holdout') or {}).get('psnr_min'))} dB")
        sp = f", {f8['speedup']:.2f}× end to end" if f8.get("speedup") is not None else ""
        if f8.get("shipped"):
            return f"fp8: shipped {what}{sp}), faster than {f8['plain']} without fp8."
        return f"fp8: {what}{sp}) not shipped: {f8.get('why_not') or 'the verdict did not read it'}."
    rec = (cache or {}).get("fp8") or {}
    if rec.get("refused"):
        return f"fp8: refused: {rec['refused']}."
    if rec.get("ran") and not rec.get("chosen"):
        return f"fp8: no composition: {rec.get('reason') or 'none passed on held-out seeds'}."
    if rec.get("chosen") and v.get("timing_unstable"):
        return "fp8: a composition passed on held-out seeds, but the timing was unstable, so no speed is compared."
    return ""


# -- the acceptance checklist -----------------------------------------------------------------
def _item(item: str, ok: bool | None, figure: str) -> dict:
    return {"item": item, "ok": ok, "figure": figure}


def _gate_item(meta: dict, intake: dict | None) -> dict:
    st = ((meta.get("stages") or {}).get("intake") or {})
    if st.get("status") == "failed":
        return _item("gate check", False, str(st.get("error") or "intake failed"))
    if st.get("status") != "passed":
        return _item("gate check", None, NOT_RECORDED)
    rows = (intake or {}).get("images") or []
    what = "videos" if any(isinstance(r, dict) and r.get("frames") for r in rows) else "images"
    return _item("gate check", True, f"card complete; intake loaded the model offline and rendered {len(rows)} baseline {what}")


def _plan_item(meta: dict, inspect: dict | None) -> dict:
    from ..runs import approval_state

    state = approval_state(meta, (inspect or {}).get("plan_hash"))  # the approval the stages accepted
    made, approved = state["plan_hash"], state["approved"]
    if state["ok"] is None:
        return _item("plan approved", None, NOT_RECORDED)
    if state["ok"]:
        return _item("plan approved", True, f"plan {made} approved ({state['source']})")
    return _item("plan approved", False, f"the card approves {approved or 'nothing'}, the inspection made {made}")


def _caching_off_item(cache: dict | None) -> dict:
    checks = (cache or {}).get("adapter_checks")
    if not checks:
        return _item("caching off reproduces the baseline", None, NOT_RECORDED)
    checked = [c for c in checks if c.get("checked")]
    bad = [c["name"] for c in checked if not c.get("reproduces")]
    worst = max((c.get("max_abs") or 0.0 for c in checked), default=None)
    if not checked:
        return _item("caching off reproduces the baseline", None, "no strategy could be checked")
    if bad:
        return _item("caching off reproduces the baseline", False, f"differs for {', '.join(bad)} (max abs diff {worst:.3g})")
    cases = {c.get("cases") for c in checked} - {None}
    on = f" on {min(cases)} cases each" if cases else ""
    return _item("caching off reproduces the baseline", True, f"{len(checked)} strategies{on}, max abs diff {worst:.3g}")


def _sharding_verified(plan: dict) -> bool | None:
    s = (plan.get("details") or {}).get("sharding")
    if s is None:
        return None
    if isinstance(s, bool):
        return s
    if isinstance(s, dict) and ("error" in s or "check" in s):  # parallel.sharding's record
        kinds = [k or {} for k in (s.get("kinds") or {}).values()]  # tp / te / vae / ring: each kind's own record
        if s.get("error") or any(k.get("error") for k in kinds) \
                or ("cfg_check" in s and not s["cfg_check"]):  # CFG split unproven (launch.cfg_split_failure)
            return False
        if s.get("check") or s.get("cfg_check"):  # the sequence split, or the CFG branches
            return True
        return True if kinds and all(k.get("check") for k in kinds) else None  # what each kind split
    if isinstance(s, dict):
        for key in ("verified", "passed", "ok"):
            if isinstance(s.get(key), bool):
                return s[key]
    return None


def _parity_item(parallel: dict | None, meta: dict) -> dict:
    name = "parity per plan, sharding verified"
    st = ((meta.get("stages") or {}).get("parallel") or {}).get("status")
    plans = [p for p in ((parallel or {}).get("plans") or []) if isinstance(p, dict)]
    if st == "failed":
        return _item(name, False, str(((meta.get("stages") or {}).get("parallel") or {}).get("error")))
    not_run = [n for n in ((parallel or {}).get("not_run") or []) if isinstance(n, dict)]
    skipped = "; ".join(f"{n.get('name')} ({n.get('reason')})" for n in not_run)
    if not plans:
        return _item(name, None, NOT_RECORDED if parallel is None else
                     "no plan was run" + (f"; not run: {skipped}" if skipped else ""))
    failed = [str(p.get("name")) for p in plans if not p.get("passed")]
    q = [((p.get("quality") or {}).get("psnr_min", p.get("psnr_min"))) for p in plans]
    q = [x for x in q if x is not None]
    parity = f"{len(plans) - len(failed)}/{len(plans)} plans run pass parity" + (f" (worst PSNR {min(q):.1f} dB)" if q else "")
    sharding = [_sharding_verified(p) for p in plans]
    tail = f"; not run: {skipped}" if skipped else ""  # what was not run, and why, beside what passed
    if failed:
        return _item(name, False, f"{parity}; failing: {', '.join(failed)}{tail}")
    if any(s is False for s in sharding):
        bad = [str(p.get("name")) for p, s in zip(plans, sharding) if s is False]
        return _item(name, False, f"{parity}; sharding not as planned: {', '.join(bad)}{tail}")
    if any(s is None for s in sharding):
        return _item(name, None, f"{parity}; sharding {NOT_RECORDED}{tail}")
    return _item(name, True, f"{parity}; sharding verified on every plan{tail}")


def _noise_item(cache: dict | None, benchmark: dict | None) -> dict:
    nf = (cache or {}).get("noise_floor") or {}
    g = cache_gates(cache)
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
    bnf = (benchmark or {}).get("noise_floor")
    if bnf and bnf.get("psnr_min") is not None:
        floors.append(bnf["psnr_min"])
        parts.append(f"benchmark re-render {_f(bnf['psnr_min'], 1)} dB")
    if not parts:
        return _item("noise floor", None, NOT_RECORDED)
    floors = [f for f in floors if f is not None]
    ok = bool(floors) and min(floors) > g.psnr
    return _item("noise floor", ok, "calibration seeds rendered twice: " + ", ".join(parts) +
                 (f" — above the {g.psnr:g} dB gate" if ok else f" — not above the {g.psnr:g} dB gate"))


def _holdout_item(v: dict, cache: dict | None) -> dict:
    if not cache:
        return _item("held-out confirmation", None, NOT_RECORDED)
    if v["name"] in ("baseline", "none"):
        return _item("held-out confirmation", False, "no configuration passed on held-out seeds")
    h, g = v.get("holdout") or {}, v["gates"]
    if not h:
        return _item("held-out confirmation", None, NOT_RECORDED)
    return _item("held-out confirmation", bool(v.get("passes_gates")),
                 f"{v['short']} on held-out seeds: worst PSNR {_f(h.get('psnr_min'))} dB (> {g['psnr']:g}), "
                 f"SSIM {_f(h.get('ssim_min'), 4)} (> {g['ssim']:g})" + (f", {h['n']} {_cases(h)}" if h.get("n") else ""))


def _timing_item(benchmark: dict | None, meta: dict | None = None) -> dict:
    """Whether the baseline's speed held through the benchmark (re-timed at the end against the
    start), with the drift figure, the bound it was held to and the warm-up / repeats it got."""
    t = timing_state(benchmark)
    if t is None:
        return _item("timing stable", None, NOT_RECORDED if benchmark is None else "baseline drift " + NOT_RECORDED)
    firm = (f"; baseline and verdict rows: {t['warmup']} warm-up, {t['repeats']} repeats"
            if t.get("warmup") is not None else "")
    if not t["stable"]:
        return _item("timing stable", False, f"timing unstable: {drift_text(t)}{firm}; "
                     "the speed-ups of this run are not reliable")
    return _item("timing stable", True, f"{drift_text(t)}{firm}")


def checklist(meta: dict, results: dict[str, dict | None], v: dict | None = None) -> list[dict]:
    """The acceptance checklist: ``[{item, ok (True/False/None), figure}]``. ``results`` maps a
    stage name to its ``results.json`` (None when absent)."""
    v = v or verdict(results.get("benchmark"), results.get("cache"))
    return [
        _gate_item(meta, results.get("intake")),
        _plan_item(meta, results.get("inspect")),
        _caching_off_item(results.get("cache")),
        _parity_item(results.get("parallel"), meta),
        _noise_item(results.get("cache"), results.get("benchmark")),
        _holdout_item(v, results.get("cache")),
        _timing_item(results.get("benchmark"), meta),
    ]


def read_stage_results(run) -> dict[str, dict | None]:
    return {s: (run.read_results(s) if run.has_results(s) else None)
            for s in ("intake", "inspect", "cache", "parallel", "benchmark")}


__all__ = ["verdict", "timing_state", "compiled_twin", "rule_and_runner_ups", "runner_up_text", "RULE", "headline",
           "checklist", "read_stage_results", "chosen_row_name", "fp8_text", "NOT_RECORDED"]
