"""The CPU part of the equal-quality comparison: the peers and ditbook's candidates on the shipped
reference model, PSNR (floating point) and SSIM against the uncached 28-step images on the
calibration seeds and on held-out seeds, and what each really computed (counted).

    python3 benchmarks/pareto.py [--out docs/pareto_quality.json]

Peers (``speedsuite.pareto``): cache-dit SCM slow / medium / fast, diffusers FirstBlockCache
(threshold 0.2) and MagCache (ratios calibrated on the reference model, and diffusers'
FLUX_MAG_RATIOS). ditbook's candidates are static step masks (cache-dit DBCache, Fn 1, static
policy), with TaylorSeer order 0, 1 or 2: spaced masks (a warm-up run, then computed steps spread
with a growing gap) and each peer's own recorded full-compute pattern as a static mask.

Selection, per peer: among the candidates whose predicted work is at most the peer's least
measured work, the least-computed one of each family that is at least as good as the peer on the
*calibration* images (PSNR and SSIM, mean and min over the images) is found (bisection over the
computed-step count); those are then confirmed on the *held-out* images in order of work, at most
``--holdout-tries`` of them. The first confirmed one is the peer's ditbook point; its measured
work must also be at most the peer's. The output lists every point to time on the GPU
(``to_time``: each peer in its timing form and each chosen ditbook point).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .pareto import (AGGREGATES, SCM_POLICIES, STEPS, apply_point, calibrate_magcache, fbc_peer, flux_mag_ratios,
                     magcache_peer, pattern_of, pattern_summary, quality_ge, scm_peer, static_point, timing_form,
                     transformer_blocks, work_of)
from .schedules import spaced_mask

REPO = Path(__file__).resolve().parents[2]
FAMILIES = tuple((w, o) for w in (2, 3, 4, 6) for o in (0, 1, 2))  # (warm-up, TaylorSeer order)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _q(q) -> dict:
    return {k: v for k, v in q.to_dict().items() if k not in ("per_image", "reasons", "passed")}


class Bench:
    """The reference pipeline, its uncached images, and a block counter installed before any cache."""

    def __init__(self, card_path: str, steps: int, calib: list[int], hold: list[int], prompts: int | None = None):
        from ditbook.adapter.counting import EvalCounter
        from ditbook.card import gate_check
        from ditbook.loading import load_pipeline

        self.card = gate_check(card_path, {"device": "cpu", "dtype": "float32"})
        self.pipe = load_pipeline(self.card)
        self.steps = steps
        self.prompts = list(self.card.generation.prompts)[:prompts] if prompts else list(self.card.generation.prompts)
        self.seeds = {"calibration": calib, "holdout": hold}
        self.blocks = len(transformer_blocks(self.pipe.transformer))
        self.counter = EvalCounter(self.pipe.transformer, transformer_blocks(self.pipe.transformer))
        self.ref = {s: self.render(s)[0] for s in self.seeds}
        self.results: dict[str, dict] = {}

    def render(self, which: str):
        from ditbook.render import render_all

        patterns, works = {}, {}

        def done(n, total, r):
            patterns[r.key] = pattern_of(self.counter.calls, self.blocks)
            works[r.key] = work_of(self.counter.calls, self.blocks)
            self.counter.reset()

        self.counter.reset()
        with torch.inference_mode():
            rs = render_all(self.pipe, self.card, prompts=self.prompts, seeds=self.seeds[which], progress=done,
                            num_inference_steps=self.steps)
        return {r.key: r.image for r in rs}, patterns, works

    def evaluate(self, point: dict, sets=("calibration", "holdout")) -> dict:
        """Quality on ``sets`` (cached per point name) and the counted patterns over every image."""
        from ditbook.quality import compare_sets

        res = self.results.setdefault(point["name"], {"point": point, "patterns": {}, "works": {}})
        for s in sets:
            if s in res:
                continue
            undo = apply_point(self.pipe, point)
            try:
                imgs, pats, works = self.render(s)
            finally:
                undo()
            res[s] = _q(compare_sets(imgs, self.ref[s]))
            res["patterns"].update({f"{s}:{k}": v for k, v in pats.items()})
            res["works"].update({f"{s}:{k}": v for k, v in works.items()})
        res["counts"] = pattern_summary(res["patterns"], res["works"])
        return res

    def one_run(self):
        """One uncached run (the calibration set's first image), for MagCache's calibration."""
        from ditbook.render import render_all

        with torch.inference_mode():
            render_all(self.pipe, self.card, prompts=self.prompts[:1], seeds=self.seeds["calibration"][:1],
                       num_inference_steps=self.steps)


TOL = 1e-6  # work is a ratio of block counts; compared unrounded


def predicted_work(computed: int, steps: int, blocks: int, fn: int = 1) -> float:
    return computed + (steps - computed) * fn / blocks


def _line(res: dict, sets) -> str:
    parts = []
    for s in sets:
        q = res.get(s)
        if q:
            parts.append(f"{s[:5]} PSNR {q['psnr_mean']:.2f}/{q['psnr_min']:.2f} SSIM {q['ssim_mean']:.4f}/{q['ssim_min']:.4f}")
    c = res["counts"]
    return f"{res['point']['name']:44s} work {c['work_min']:6.2f} full {c['full_min']:2d}-{c['full_max']:2d}  " + "  ".join(parts)


def choose(bench: Bench, peer: dict, aggregates=AGGREGATES, holdout_tries: int = 3, peers: list | None = None) -> dict:
    """ditbook's point for one peer (see the module doc); returns the record of the search."""
    steps, blocks = bench.steps, bench.blocks
    pres = bench.results[peer["name"]]
    budget = pres["counts"]["work_min"]
    tried, winners = [], []

    def ok_calib(pt):
        r = bench.evaluate(pt, ("calibration",))
        tried.append(pt["name"])
        return quality_ge(r["calibration"], pres["calibration"], aggregates)

    for warm, order in FAMILIES:
        cmax = max((c for c in range(warm + 1, steps + 1) if predicted_work(c, steps, blocks) <= budget + TOL),
                   default=None)
        if cmax is None:
            continue
        make = lambda c: static_point(f"ditbook w{warm} c{c}" + (f" +TS{order}" if order else ""),  # noqa: E731
                                      "".join(map(str, spaced_mask(steps, warm, c))), order)
        if not ok_calib(make(cmax)):
            continue
        lo, hi = warm + 1, cmax  # hi passes; find the least c that passes (quality taken as monotone in c)
        while lo < hi:
            mid = (lo + hi) // 2
            if ok_calib(make(mid)):
                hi = mid
            else:
                lo = mid + 1
        winners.append(make(hi))
    for other in peers or []:  # each peer's recorded full-compute pattern as a static mask
        pat = bench.results[other["name"]]["counts"]["least_work_pattern"]
        mask = "".join("1" if c == "F" else "0" for c in pat)
        if mask[0] != "1" or predicted_work(mask.count("1"), steps, blocks) > budget + TOL:
            continue
        for order in (0, 1, 2):
            pt = static_point(f"ditbook mask({other['name']})" + (f" +TS{order}" if order else ""), mask, order)
            if ok_calib(pt):
                winners.append(pt)
                break
    winners.sort(key=lambda pt: (bench.results[pt["name"]]["counts"]["work_min"], pt["name"]))
    confirmed, held_out_tries = None, []
    for pt in winners[:holdout_tries]:
        r = bench.evaluate(pt)
        good = quality_ge(r["holdout"], pres["holdout"], aggregates) and r["counts"]["work_max"] <= budget + TOL
        held_out_tries.append({"name": pt["name"], "confirmed": good})
        _log(f"    held-out try {_line(r, ('holdout',))}  {'confirmed' if good else 'not confirmed'}")
        if good:
            confirmed = pt
            break
    return {"peer": peer["name"], "peer_work": budget, "ditbook": confirmed and confirmed["name"],
            "calibration_winners": [w["name"] for w in winners], "holdout_tries": held_out_tries,
            "calibration_evaluations": len(tried)}


def run(out: Path, *, card: str, steps: int = STEPS, calib=(0,), hold=(100, 101, 102), threads: int = 1,
        holdout_tries: int = 3, prompts: int | None = None, aggregates=AGGREGATES, peers_only: bool = False) -> dict:
    if threads:
        torch.set_num_threads(threads)  # a tiny model: one thread is far faster than two contended ones
    t0 = time.perf_counter()
    bench = Bench(card, steps, list(calib), list(hold), prompts)
    _log(f"reference model: {len(bench.prompts)} prompts, calibration seeds {list(calib)}, held-out {list(hold)}, "
         f"{steps} steps, {bench.blocks} blocks")
    from ditbook.quality import compare_sets

    again, eager_patterns, _ = bench.render("calibration")  # the noise floor: the uncached run again
    floor = {**_q(compare_sets(again, bench.ref["calibration"])), "patterns": sorted(set(eager_patterns.values()))}
    ratios = calibrate_magcache(bench.pipe, bench.one_run, steps)
    peers = [scm_peer(p, steps) for p in SCM_POLICIES] + [fbc_peer()]
    peers += [magcache_peer(ratios, "calibrated on the reference model", steps),
              magcache_peer(flux_mag_ratios(), "FLUX_MAG_RATIOS", steps)]
    for p in peers:
        _log("peer  " + _line(bench.evaluate(p), ("calibration", "holdout")))
    again, eager_patterns, _ = bench.render("calibration")  # every cache off again: eager exactly as before?
    floor_after = _q(compare_sets(again, bench.ref["calibration"]))
    _log(f"eager after the peers: PSNR min {floor_after['psnr_min']}")
    pairs = []
    if not peers_only:
        for p in peers:
            _log(f"search for {p['name']}")
            rec = choose(bench, p, aggregates, holdout_tries, peers)
            _log(f"  -> {rec['ditbook']}  ({rec['calibration_evaluations']} calibration evaluations)")
            pairs.append(rec)
    chosen = []
    for rec in pairs:
        if rec["ditbook"] and rec["ditbook"] not in chosen:
            chosen.append(rec["ditbook"])
    points = []
    for name, res in bench.results.items():
        points.append({**res["point"], "calibration": res.get("calibration"), "holdout": res.get("holdout"),
                       "counts": res["counts"], "role": "peer" if res["point"]["owner"] != "ditbook" else
                       ("chosen" if name in chosen else "candidate")})
    by_name = {p["name"]: p for p in points}
    to_time = [timing_form(by_name[p["name"]]) for p in peers] + [timing_form(by_name[n]) for n in chosen]
    result = {"card": card, "steps": steps, "calibration_seeds": list(calib), "holdout_seeds": list(hold),
              "prompts": bench.prompts, "blocks": bench.blocks, "aggregates": list(aggregates),
              "work_unit": "block evaluations / blocks per transformer call (full-step equivalents, reference model)",
              "noise_floor": floor, "eager_after_peers": floor_after, "magcache_calibrated_ratios": ratios, "points": points, "pairs": pairs,
              "to_time": to_time, "seconds": round(time.perf_counter() - t0, 1),
              "command": " ".join(["python3"] + [Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
              "versions": _versions()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    bench.counter.remove()
    return result


def _versions() -> dict:
    import cache_dit
    import diffusers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "cache_dit": cache_dit.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", default=str(REPO / "models" / "reference.yaml"))
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "pareto_quality.json")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--calib-seeds", default="0")
    ap.add_argument("--holdout-seeds", default="100,101,102")
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts of the card (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    ap.add_argument("--holdout-tries", type=int, default=3)
    ap.add_argument("--aggregates", default=",".join(AGGREGATES), help="mean,min: both must be >= the peer's")
    ap.add_argument("--peers-only", action="store_true", help="measure the peers only (no search)")
    a = ap.parse_args(argv)
    res = run(a.out, card=a.card, steps=a.steps, calib=[int(s) for s in a.calib_seeds.split(",")],
              hold=[int(s) for s in a.holdout_seeds.split(",")], threads=a.threads, holdout_tries=a.holdout_tries,
              prompts=a.prompts, aggregates=tuple(a.aggregates.split(",")), peers_only=a.peers_only)
    for rec in res["pairs"]:
        print(f"{rec['peer']:40s} -> {rec['ditbook']}")
    return 0 if all(r["ditbook"] for r in res["pairs"]) else 1
