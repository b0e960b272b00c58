"""The cache schedule tuned with the block linears in fp8 (card ``cache.fp8``).

fp8's and caching's errors add: a schedule tuned without fp8 can fail the gates once fp8 is on, so
the chosen strategy is tuned again with fp8 applied and every figure is the combined error. Block
linears are ranked by how much each alone changes the transformer's output (measured, only when a
share keeping layers is tried); for each share of ``cache.fp8_keep`` the most sensitive layers stay
in the model's dtype, the grid is searched on calibration cases and confirmed on held-out seeds.
The first share that passes is the fp8 composition (images saved for the fresh-process
reproduction). Speed is the benchmark's to judge. Where fp8 cannot run the search is refused.
"""

from __future__ import annotations

from typing import Callable

from ..records import Fp8Search, decode

Quantize = Callable[[object, list], Callable[[], None]]  # (transformer, layer names) -> undo

FP8_IMAGES = "images/chosen_fp8"


def torchao_fp8(transformer, layers: list) -> Callable[[], None]:
    """The shipped quantization: torchao float8 (per-row scales, e4m3) on ``layers``."""
    from ..accel.fp8 import apply_fp8

    return apply_fp8(transformer, layers=layers)[0]


def rank_layers(session, names: list, quantize: Quantize) -> list[dict]:
    """``names`` ranked by their effect alone on the transformer's output, most sensitive first."""
    from ..accel.fp8 import capture_calls, layer_sensitivity
    from .verify import render_set

    gen = session.card.generation
    transformer = session.pipe.transformer
    every = max(1, int(gen.steps) // 4)
    calls = capture_calls(transformer, lambda: render_set(session.pipe, session.card, gen.prompts[:1], gen.seeds[:1]),
                          every=every)
    try:
        return layer_sensitivity(transformer, calls, names, lambda n: quantize(transformer, [n]))
    finally:
        calls.clear()


def _quality(r) -> dict:
    return {"config": r.config, "passed": r.passed, "skipped_fraction": r.skipped_fraction,
            "psnr_min": r.quality.psnr_min if r.quality else None, "ssim_min": r.quality.ssim_min if r.quality else None,
            "stopped": r.stopped}


def fp8_tune(session, progress=None, quantize: Quantize | None = None) -> Fp8Search:
    """Tune the chosen strategy again with fp8 applied (module docstring); ``quantize`` stands in for
    torchao's fp8 (tests on the CPU)."""
    return decode(Fp8Search, _search(session, progress, quantize), "cache.fp8")


def _search(session, progress, quantize: Quantize | None) -> dict:
    card = session.card
    if not card.cache.fp8:
        return {"ran": False, "reason": "cache.fp8 is off"}
    if session.refused:
        return {"ran": False, "reason": f"cache refused: {session.refused}"}
    if not session.chosen:
        return {"ran": False, "reason": "no configuration passed on held-out seeds without fp8, so none is tuned with it"}
    from ..accel.fp8 import fp8_layers, fp8_refusal_for

    transformer = session.pipe.transformer
    shipped = quantize is None  # torchao's fp8, the quantization a fresh process can apply again
    if shipped:
        why = fp8_refusal_for(transformer)
        if why:
            return {"ran": False, "refused": why, "reason": f"fp8 refused: {why}"}
        quantize, how = torchao_fp8, "torchao Float8DynamicActivationFloat8WeightConfig (e4m3, per-row scales)"
    else:
        how = getattr(quantize, "__name__", "a given quantizer")
    names, odd = fp8_layers(transformer)
    if not names:
        why = "no block linear whose features are multiples of 16"
        return {"ran": False, "refused": why, "reason": f"fp8 refused: {why}"}
    name = session.chosen.name
    out: dict = {"ran": True, "quantization": how, "shipped_quantizer": shipped, "strategy": name,
                 "candidates": len(names), "left_out": odd,
                 "sensitivity": [], "tries": [], "chosen": None}
    ranked: list | None = None
    seen = set()
    for share in card.cache.fp8_keep:
        k = min(len(names), int(round(share * len(names))))
        if k in seen or k >= len(names):
            continue  # the same split again, or nothing left to quantize
        seen.add(k)
        if k and ranked is None:  # measured only when some layers are to be kept (at FLUX's size: minutes)
            sensitivity = rank_layers(session, names, quantize)
            ranked = [r["layer"] for r in sensitivity]
            out["sensitivity"] = [{"layer": r["layer"], "rel_error": r["rel_error"]} for r in sensitivity]
        out["chosen"] = _try_share(session, out, name, names, (ranked or [])[:k], share, quantize, progress)
        if out["chosen"]:
            break
    if ranked is None:
        out["sensitivity_note"] = "not measured: no share that keeps layers was tried"
    if out["chosen"] is None:
        out["reason"] = (f"no schedule of {name} passed on held-out seeds with fp8 at any kept share of "
                         f"{list(card.cache.fp8_keep)}")
        return out
    out["chosen"]["images"] = _save_chosen(session, out["chosen"], quantize)
    out["reason"] = (f"{name} {out['chosen']['config']} with {len(out['chosen']['layers'])} of {len(names)} block "
                     f"linears in fp8 passes on held-out seeds")
    return out


def _try_share(session, out: dict, name: str, names: list, kept: list, share: float, quantize: Quantize,
               progress) -> dict | None:
    """The strategy's search with every layer but ``kept`` in fp8 (recorded in ``out["tries"]``); the
    best held-out-passing composition, or None."""
    layers = [n for n in names if n not in set(kept)]
    start = len(session.results)
    undo = quantize(session.pipe.transformer, layers)
    try:
        held = session.tune_strategy(name, progress=progress, split_prefix="fp8-", keep=False)
    finally:
        undo()
    for r in session.results[start:]:
        r.fp8 = {"kept": len(kept), "quantized": len(layers)}
    calib = [r for r in session.results[start:] if r.split == "fp8-calibration"]
    passed = [h for h in held if h.passed]
    out["tries"].append({"kept_share": share, "kept": len(kept), "quantized": len(layers),
                         "calibration_rows": len(calib), "calibration_passed": sum(1 for r in calib if r.passed),
                         "holdout": [_quality(h) for h in held], "passed": bool(passed)})
    if not passed:
        return None
    best = max(passed, key=lambda r: (r.skipped_fraction, r.quality.psnr_min))
    return {"name": best.name, "family": best.family, "config": best.config,
            "skipped_fraction": best.skipped_fraction, "holdout_quality": best.quality,
            "candidates": len(names), "layers": layers, "kept": list(kept), "kept_share": share}


def _save_chosen(session, chosen: dict, quantize: Quantize) -> str:
    """Render and save the fp8 composition's calibration images; returns their folder."""
    from .. import accel
    from .verify import evaluate, save_images

    gen = session.card.generation
    cfg = accel.get(chosen["name"]).settings(**chosen["config"])
    images: dict = {}
    undo = quantize(session.pipe.transformer, chosen["layers"])
    try:
        r = evaluate(session.pipe, session.card, session.adapter, chosen["name"], cfg, session.baseline,
                     session.baseline_counts, session.gates, gen.prompts, gen.seeds, split="fp8-chosen",
                     keep_images=images)
    finally:
        undo()
    r.fp8 = {"kept": len(chosen["kept"]), "quantized": len(chosen["layers"])}
    session.results.append(r)
    chosen["calibration_quality"] = r.quality
    save_images(session.ctx.dir / FP8_IMAGES, images)
    return FP8_IMAGES


__all__ = ["FP8_IMAGES", "fp8_tune", "rank_layers", "torchao_fp8"]
