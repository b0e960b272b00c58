"""fp8 that keeps quality (issue 25 item 1): the options that lower fp8's error, each judged on the
shipped reference model by its card's cache gates, alone and under the cache schedule the speed
rows use (``cache+fp8``: the combined error, which failed the gates at 27.3 dB with every block
linear in fp8).

1. **Sensitivity, measured on the model:** the transformer's inputs are recorded during one render
   (``ditbook.accel.fp8.capture_calls``); each block linear alone is put in fp8 and the recorded
   calls rerun; its error is the output's relative L2 distance (``layer_sensitivity``). No layer is
   chosen by its name.
2. **fp8 only where the error budget allows:** the k most sensitive layers stay in bf16, for k in
   ``--keep``; fp8 alone and cache+fp8 are rendered on the calibration cases (the card's prompts x
   seeds) against the bf16 images; the smallest k whose cache+fp8 passes the gates is chosen there.
3. **Confirmed on held-out seeds** (``--holdout-seeds``, the compose benchmark's): all layers in fp8
   and the chosen k, each with per-row and per-tensor scales, fp8 alone and cache+fp8.

Each row also gives the share of the block linears' weights (their GEMM work per token) left in bf16.

    python3 benchmarks/fp8_quality.py --out OUT                 # a GPU of capability >= 8.9
    python3 benchmarks/fp8_quality.py --out OUT --device cpu --stand-in int8   # the code path on a CPU

``--stand-in int8`` replaces fp8 with torchao's int8 weight-only config (it runs on a CPU); its
figures are not fp8's. Writes ``OUT/fp8_quality.json`` and ``OUT/fp8_quality.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "benchmarks"))

from speedsuite.suite import chosen_schedule  # noqa: E402

from ditbook.accel.fp8 import (apply_fp8, capture_calls, float8_config, fp8_layers, fp8_refusal, layer_sensitivity)  # noqa: E402
from ditbook.quality import compare_sets  # noqa: E402

KEEP = (0, 2, 4, 8, 13, 26)


def scale_config(granularity: str, stand_in: str | None):
    if stand_in == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig()
    if granularity == "row":
        return float8_config()  # what ditbook ships
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor

    return Float8DynamicActivationFloat8WeightConfig(activation_dtype=torch.float8_e4m3fn,
                                                     weight_dtype=torch.float8_e4m3fn,
                                                     granularity=(PerTensor(), PerTensor()))


def main(argv=None) -> int:
    # long: one measuring sequence (load, baseline, sensitivity, the keep sweep, held-out confirmation, report)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--card", type=Path, default=REPO / "models" / "reference.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=28, help="the cache schedule's step count (docs/schedule_quality.json)")
    ap.add_argument("--keep", default=",".join(map(str, KEEP)), help="how many of the most sensitive layers stay in bf16")
    ap.add_argument("--holdout-seeds", default="100,101,102")
    ap.add_argument("--holdout-keep", default="", help="also confirm these k on held-out seeds (besides 0 and the chosen)")
    ap.add_argument("--every", type=int, default=4, help="record every n-th transformer call of one render")
    ap.add_argument("--stand-in", choices=["int8"], default=None)
    args = ap.parse_args(argv)
    from ditbook.card import gate_check
    from ditbook.loading import choose_placement, load_pipeline
    from ditbook.render import render_all

    t0 = time.perf_counter()
    card = gate_check(args.card, {"runtime.device": args.device})
    pipe = load_pipeline(card, choose_placement(card))
    tr = pipe.transformer
    if args.stand_in is None and (why := fp8_refusal(next(tr.parameters()).device)):
        print(f"fp8_quality: refused: {why}")
        return 2
    gates = card.cache.gates
    prompts, seeds = list(card.generation.prompts), list(card.generation.seeds)
    held = [int(s) for s in args.holdout_seeds.split(",")]
    schedule = chosen_schedule(args.steps, REPO / "docs" / "schedule_quality.json")

    def images(case_seeds, cache: bool = False) -> dict:
        undo = schedule.apply(pipe) if cache else None
        try:
            with torch.inference_mode():
                return {r.key: r.image for r in render_all(pipe, card, prompts=prompts, seeds=case_seeds,
                                                           num_inference_steps=args.steps)}
        finally:
            if undo is not None:
                undo()

    def judged(got, ref) -> dict:
        q = compare_sets(got, ref, gates).to_dict()
        return {k: q[k] for k in ("psnr_min", "ssim_min", "passed")}

    ref_cal, ref_held = images(seeds), images(held)
    result: dict = {"card": str(args.card), "device": str(next(tr.parameters()).device), "steps": args.steps,
                    "schedule": schedule.to_dict(), "gates": gates.to_dict(), "stand_in": args.stand_in,
                    "torch": torch.__version__, "calibration_seeds": seeds, "holdout_seeds": held,
                    "cache_alone": {"calibration": judged(images(seeds, True), ref_cal),
                                    "holdout": judged(images(held, True), ref_held)}}
    layers, _ = fp8_layers(tr)
    modules = dict(tr.named_modules())
    weight = {n: modules[n].weight.numel() for n in layers}

    # 1. sensitivity, per-row scales (what ships), on the inputs of one render
    cfg_row = scale_config("row", args.stand_in)
    calls = capture_calls(tr, lambda: images(seeds[:1]), every=args.every)

    def quantize_one(name):
        return apply_fp8(tr, config=cfg_row, check_device=False, layers=[name])[0]

    t = time.perf_counter()
    sens = layer_sensitivity(tr, calls, layers, quantize_one)
    result["sensitivity"] = {"calls": len(calls), "seconds": round(time.perf_counter() - t, 1), "layers": sens}
    order = [r["layer"] for r in sens]

    def row(k: int, granularity: str, case_seeds, ref) -> dict:
        kept = order[:k]
        undo, rec = apply_fp8(tr, config=scale_config(granularity, args.stand_in), check_device=False,
                              layers=[n for n in layers if n not in set(kept)])
        try:
            alone, cached = judged(images(case_seeds), ref), judged(images(case_seeds, True), ref)
        finally:
            undo()
        return {"keep": k, "scales": granularity, "quantized": rec["quantized"], "of": len(layers),
                "bf16_weight_share": round(sum(weight[n] for n in kept) / sum(weight.values()), 4),
                "fp8": alone, "cache+fp8": cached}

    def safe_row(k: int, granularity: str, case_seeds, ref) -> dict:
        """A row that torchao cannot run is recorded with its reason (its undo has run)."""
        try:
            return row(k, granularity, case_seeds, ref)
        except Exception as exc:
            return {"keep": k, "scales": granularity, "of": len(layers), "failed": f"{type(exc).__name__}: {exc}"[:300]}

    # 2. the keep sweep on calibration cases
    sweep = [safe_row(k, "row", seeds, ref_cal) for k in (int(x) for x in args.keep.split(",")) if k <= len(layers)]
    result["calibration"] = sweep
    passing = [r for r in sweep if "failed" not in r and r["cache+fp8"]["passed"]]
    chosen = min(passing, key=lambda r: r["keep"]) if passing else None
    result["chosen_keep"] = chosen["keep"] if chosen else None
    # 3. held-out confirmation: all layers in fp8, the chosen k and --holdout-keep, per-row and per-tensor scales
    ks = sorted({0, *([chosen["keep"]] if chosen else []), *(int(x) for x in args.holdout_keep.split(",") if x)})
    grans = ["row"] if args.stand_in else ["row", "tensor"]
    result["holdout"] = [safe_row(k, g, held, ref_held) for k in ks for g in grans]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_quality.json").write_text(json.dumps(result, indent=1))
    (args.out / "fp8_quality.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _q(q: dict) -> str:
    return f"{q['psnr_min']:.2f} dB / {q['ssim_min']:.4f} {'pass' if q['passed'] else 'FAIL'}"


def markdown(r: dict) -> str:
    g = r["gates"]
    lines = [f"# fp8 that keeps quality — {r['card']}, {r['steps']} steps, {r['device']}"
             + (f" (STAND-IN {r['stand_in']}, not fp8)" if r["stand_in"] else ""), "",
             f"Gates: PSNR > {g.get('psnr')} dB, SSIM > {g.get('ssim')} (worst image); schedule "
             f"`{r['schedule'].get('name')}`; the cache alone: calibration {_q(r['cache_alone']['calibration'])}, "
             f"held-out {_q(r['cache_alone']['holdout'])}.", "",
             f"Sensitivity: {len(r['sensitivity']['layers'])} block linears, each alone in fp8 over "
             f"{r['sensitivity']['calls']} recorded transformer calls ({r['sensitivity']['seconds']} s); most sensitive: "
             + ", ".join(f"`{x['layer']}` {x['rel_error']:.2e}" for x in r["sensitivity"]["layers"][:5])
             + f"; least: {r['sensitivity']['layers'][-1]['rel_error']:.2e}.", "",
             "| cases | kept in bf16 (most sensitive) | scales | bf16 weight share | fp8 alone | cache + fp8 |",
             "| --- | ---: | --- | ---: | --- | --- |"]
    for name, rows in (("calibration", r["calibration"]), ("held-out", r["holdout"])):
        for x in rows:
            if "failed" in x:
                lines.append(f"| {name} | {x['keep']} of {x['of']} | per-{x['scales']} | – | failed: {x['failed'][:120]} | – |")
                continue
            lines.append(f"| {name} | {x['keep']} of {x['of']} | per-{x['scales']} | {x['bf16_weight_share']:.1%} | "
                         f"{_q(x['fp8'])} | {_q(x['cache+fp8'])} |")
    lines += ["", f"Chosen on calibration cases: keep {r['chosen_keep']} (the fewest whose cache + fp8 passes)."
              if r["chosen_keep"] is not None else "No k of the sweep made cache + fp8 pass on calibration cases.",
              f"Whole run {r['seconds']} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
