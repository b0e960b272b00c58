"""The cache schedule tuned with the block linears in fp8 (card ``cache.fp8``).

fp8 and caching each change the images; their errors add. A schedule tuned without fp8 and then
run with it can fail the gates that each alone passes (on the reference model: cache alone 31.2 dB
held-out, fp8 alone 32.0 dB, the two together 27.3 dB against a 30 dB gate). So the stage tunes
again with fp8 applied, and every figure of that search is the combined error:

1. which layers: each block linear fp8 can take, ranked by how much it alone changes the
   transformer's output (``accel.fp8.layer_sensitivity``, on the transformer calls of one
   calibration case) — measured on the model, never chosen by name; measured only when a share
   that keeps layers is tried (at the FLUX.1-dev shape the ranking of its 494 block linears took
   about two minutes of an H200, and with every layer in fp8 the first share often passes);
2. for each share of ``cache.fp8_keep`` (0, 0.25, 0.5 by default): that share of the layers, the
   most sensitive first, stays in the model's dtype, the rest go to fp8, and the chosen strategy's
   grid is searched again on the calibration cases (split ``fp8-calibration``) and confirmed on the
   held-out seeds (``fp8-holdout``) exactly as the plain search is;
3. the first share whose schedule passes on held-out seeds is the fp8 composition: its
   calibration images are saved (``images/chosen_fp8``) for the fresh-process reproduction, and
   ``results.json`` ``fp8.chosen`` names the strategy, its configuration and the quantized layers.

The cache stage does not decide between the plain choice and the fp8 one: speed is the
benchmark's to measure. The benchmark times both (``cache.benchmark_configs``), and the verdict
ships the fp8 composition only when it is faster, passed on held-out seeds, passed its gates on
the benchmark's images and reproduced in the fresh process (``benchmark.verdict.fp8_choice``).

Where fp8 cannot run (no CUDA GPU of capability 8.9 or newer, no torchao) the search is refused
before anything changes, with the reason; the stage goes on with its plain choice.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..records import Fp8Search, decode

Quantize = Callable[[object, list], Callable[[], None]]  # (transformer, layer names) -> undo

FP8_IMAGES = "images/chosen_fp8"


def torchao_fp8(transformer, layers: list) -> Callable[[], None]:
    """The shipped quantization: torchao float8 (per-row scales, e4m3) on ``layers``."""
    from ..accel.fp8 import apply_fp8

    return apply_fp8(transformer, layers=layers)[0]


def rank_layers(session, names: list, quantize: Quantize) -> list[dict]:
    """``names`` ranked by their effect alone on the transformer's output (most sensitive first),
    replaying the transformer calls of the first calibration case (about four of its steps)."""
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
    """Tune the chosen strategy again with fp8 applied (module docstring); returns the record
    ``results.json`` keeps as ``fp8``. ``quantize`` stands in for torchao's fp8 (tests on the CPU)."""
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
    """The strategy's search with every layer of ``names`` but ``kept`` in fp8; its try recorded
    in ``out["tries"]``; the best held-out-passing composition, or None."""
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
    """Render the fp8 composition on the calibration cases and save the images the fresh-process
    reproduction is compared with; returns their folder, relative to the stage's."""
    from .. import accel
    from .verify import evaluate

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
    folder = session.ctx.dir / FP8_IMAGES
    folder.mkdir(parents=True, exist_ok=True)
    for key, img in images.items():
        np.save(folder / f"{key}.npy", np.asarray(img, dtype=np.float32))
    return FP8_IMAGES


__all__ = ["FP8_IMAGES", "fp8_tune", "rank_layers", "torchao_fp8"]
