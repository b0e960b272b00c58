"""Speed, composed, on one GPU (issue 16): a static cache schedule, regional compile, fp8 and CUDA
graphs of the computed steps, alone and together, at the FLUX.1-dev shape — each row's quality
measured on the shipped reference model by the cache gates.

    python3 benchmarks/compose_gpu.py --out OUT                      # one H200: FLUX.1-dev shape, 1024², 28 steps, bf16
    python3 benchmarks/compose_gpu.py --out OUT --tiny --device cpu  # the same code on a CPU, for checking

Rows (``ROWS``), measured in one process against the eager row of the same process:

- ``eager``; ``cache`` (the schedule ``benchmarks/schedule_quality.py`` chose on the reference
  model, ``docs/schedule_quality.json``, a static step mask); ``compile`` (regional, diffusers'
  ``compile_repeated_blocks``); ``cache+compile``; ``cache+compile+decoder`` (the image decoder
  compiled too, ``ditbook.accel.compile.compile_decoder``); ``fp8+compile`` and ``cache+fp8+compile``
  (torchao float8 on the block linears, ``ditbook.accel.fp8``); ``cache+compile+graph`` (the
  computed steps' block work replayed as CUDA graphs, ``ditbook.accel.graphs``).
- Each: the first call (compile, graph capture) timed apart, then ``--repeats`` timed calls
  (median, min, max; CUDA events), the one-time compile cost (``params.compile``), the ratio to
  eager, the FLUX-shape image against eager's (PSNR/SSIM: random weights, so only a sanity check
  that nothing broke; cached rows differ by design), and the quality on the reference model: the
  same configuration applied to ``models/reference.yaml``'s pipeline on the same device at the
  schedule's step count, its images against that pipeline's eager images (the card's prompts x
  calibration seeds and held-out seeds) judged by the card's ``cache.gates``. By default that pass
  applies each row without its compile (fp8's compile alone takes minutes: 212 s at the FLUX shape
  on an H200, which would break the 8-minute budget twice); ``--quality-compiled`` judges the
  compiled forms.
- The gap to the limit (``speedsuite.gap``): each row's computed-step time (its transformer calls
  of computed steps, timed apart) beside the FLOPs of one call (counted on the eager model) at the
  bf16 / fp8 matmul rates measured in this process, and the achieved share of those peaks.
- A row that cannot run here is ``refused`` with the reason (fp8 below CUDA capability 8.9 or on a
  CPU; graphs on a CPU); nothing else is skipped silently.

Writes ``OUT/compose.json`` and ``OUT/compose.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch

from .fullsize import flux_pipeline
from .gap import GAP_ALIGN, GAP_HEADER, CallCapture, CallTimer, computed_calls, gap, gap_cells, gap_notes, measure_peaks
from .schedules import ditbook_schedule
from .suite import NoSchedule, _dump, _log, chosen_schedule, environment
from ditbook.accel.compile import compiled_config
from ditbook.accel.fp8 import Fp8Refused, fp8_config
from ditbook.configuration import Config, baseline_config
from ditbook.cp.cache_sync import static_schedule
from ditbook.accel.graphs import GraphUnavailable, install_cached_step_graphs
from ditbook.quality import Gates, compare, compare_sets
from ditbook.timing import device_of, time_pipeline

ROWS = ("eager", "cache", "compile", "cache+compile", "cache+compile+decoder", "fp8+compile", "cache+fp8+compile",
        "cache+compile+graph")
REFUSALS = (Fp8Refused, GraphUnavailable)
REPO = Path(__file__).resolve().parents[2]


def graph_config(inner: Config, mask, steps: int, warmup: int = 2, capturer=None) -> Config:
    """``inner`` (a static cache schedule, compiled or not) with its computed steps replayed as
    CUDA graphs; ``params["graphs"]`` gets the capture and replay counts."""
    stats: dict = {}
    options = static_schedule(mask)

    def apply(pipe):
        undo_inner = inner.apply(pipe)
        try:
            graphs = install_cached_step_graphs(pipe.transformer, options, steps=steps, warmup=warmup,
                                                capturer=capturer)
        except BaseException:
            if undo_inner is not None:
                undo_inner()
            raise

        def undo():
            stats.update(graphs.to_dict())
            graphs.remove()
            if undo_inner is not None:
                undo_inner()
        return undo

    return Config(f"{inner.name}+graph", inner.family, apply, params={**inner.params, "graphs": stats})


def row_configs(schedule, compile_opts: dict | None, steps: int) -> dict[str, Config]:
    """The configuration of each row (fresh objects: their ``params`` are filled while they run).
    ``compile_opts`` None: every row without its compile (the quality pass's default)."""
    cache = Config("cache", "cache", schedule.apply, params={"schedule": schedule.to_dict()})
    base = baseline_config()
    comp = (lambda c: compiled_config(c, **compile_opts)) if compile_opts is not None else (lambda c: c)
    return {
        "eager": base,
        "cache": cache,
        "compile": comp(base),
        "cache+compile": comp(cache),
        # the image decoder compiled too (ditbook.accel.compile.compile_decoder): uncompiled it is the cache row
        "cache+compile+decoder": (compiled_config(cache, **compile_opts, decoder=True) if compile_opts is not None
                                  else cache),
        "fp8+compile": comp(fp8_config(base)),
        "cache+fp8+compile": comp(fp8_config(cache)),
        "cache+compile+graph": graph_config(comp(cache), schedule.mask, steps),
    }


def _image(fp) -> "object":
    with torch.inference_mode():
        return fp(seed=0).images[0].float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()


def speed_row(fp, cfg: Config, repeats: int, eager_image) -> tuple[dict, object]:
    """Apply, first call timed apart, ``repeats`` timed calls, undo. Refusals become a row. Each
    transformer call of the timed calls is timed apart too (``row["call_s"]``: the gap columns)."""
    row: dict = {"config": cfg.name}
    img = None
    try:
        undo = cfg.apply(fp.pipe)
    except REFUSALS as exc:
        row.update(status="refused", reason=f"{type(exc).__name__}: {exc}")
        _log(f"  {cfg.name:28s} refused: {exc}")
        return row, None
    try:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        img = _image(fp)
        sync()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        timer = CallTimer(fp.pipe.transformer, cuda=torch.cuda.is_available() and device_of(fp.pipe).startswith("cuda"))
        try:
            t = time_pipeline(fp.pipe, fp, warmup=0, repeats=repeats)
        finally:
            timer.remove()
        row["call_s"] = [round(x, 6) for x in timer.seconds()]
    except REFUSALS as exc:  # e.g. a refusal raised at the first call
        row.update(status="refused", reason=f"{type(exc).__name__}: {exc}")
        return row, None
    finally:
        if undo is not None:
            undo()
    row.update(status="measured", timing=t.to_dict(), params=cfg.params)
    if eager_image is not None:
        q = compare(img, eager_image)
        row["shape_vs_eager"] = {"psnr": q.psnr, "ssim": q.ssim}
    _log(f"  {cfg.name:28s} {t.end_to_end.median:8.3f}s (min {t.end_to_end.min:.3f}, max {t.end_to_end.max:.3f})"
         f"  first call {row['first_call_s']:.1f}s")
    return row, img


def _uncompiled(row: str) -> str:
    """The row's configuration without its compile (``cache+compile+decoder`` -> ``cache``)."""
    return row.replace("+compile", "").replace("+decoder", "")


def reference_quality(card_path: Path, device: str, steps: int, make: Callable[[], dict[str, Config]],
                      names: list[str], holdout_seeds: list[int], prompts: int | None = None,
                      compiled: bool = False) -> dict:
    """Each row's configuration on the reference model: images against the eager images of the same
    pipeline (calibration seeds of the card + ``holdout_seeds``), judged by the card's cache gates.
    ``compiled`` False (``make`` then builds the rows without compile): the ``compile`` row is the
    eager model itself and is not re-judged; compile's own effect on the images is the speed
    part's ``shape_vs_eager`` of the ``compile`` row."""
    from ditbook.card import gate_check
    from ditbook.loading import choose_placement, load_pipeline
    from ditbook.render import render_all

    card = gate_check(card_path, {"runtime.device": device})
    pipe = load_pipeline(card, choose_placement(card))
    gates: Gates = card.cache.gates
    seeds = list(card.generation.seeds) + [s for s in holdout_seeds if s not in card.generation.seeds]
    prompt_list = list(card.generation.prompts)[:prompts] if prompts else list(card.generation.prompts)

    def images() -> dict:
        with torch.inference_mode():
            return {r.key: r.image for r in render_all(pipe, card, prompts=prompt_list, seeds=seeds,
                                                       num_inference_steps=steps)}

    ref = images()
    out: dict = {"card": str(card_path), "steps": steps, "seeds": seeds, "prompts": len(prompt_list),
                 "gates": gates.to_dict(), "compiled": compiled, "rows": {}}
    configs = make()
    judged: dict[str, str] = {}  # uncompiled configuration -> the row that judged it
    for name in names:
        cfg = configs[name]
        if name == "eager":
            again = images()  # the noise floor: eager twice
            q = compare_sets(again, ref, gates).to_dict()
            out["noise_floor"] = {k: q[k] for k in ("psnr_min", "ssim_min", "max_abs")}
            continue
        if name == "compile" and not compiled:
            out["rows"][name] = {"status": "not judged", "reason": "uncompiled quality pass: this row is the eager model"}
            continue
        same = _uncompiled(name)  # uncompiled, cache+compile is cache: judged once
        if not compiled and same != name and same in judged:
            out["rows"][name] = {**out["rows"][judged[same]], "same_as": judged[same]}
            continue
        try:
            undo = cfg.apply(pipe)
        except REFUSALS as exc:
            out["rows"][name] = {"status": "refused", "reason": f"{type(exc).__name__}: {exc}"}
            continue
        try:
            got = images()
        finally:
            if undo is not None:
                undo()
        q = compare_sets(got, ref, gates).to_dict()
        judged[_uncompiled(name)] = name
        out["rows"][name] = {"status": "measured", **{k: q[k] for k in ("psnr_min", "ssim_min", "worst_tile_psnr",
                                                                        "passed", "reasons")}}
        _log(f"  reference {name:26s} PSNR min {q['psnr_min']:.2f} dB, SSIM min {q['ssim_min']:.4f}"
             f"  {'pass' if q['passed'] else 'FAIL'}")
    return out


def run(out: Path, *, tiny: bool = False, device: str = "cuda", size: int | None = None, steps: int = 28,
        repeats: int = 3, rows: list[str] | None = None, compile_backend: str = "inductor",
        quality: bool = True, quality_compiled: bool = False, card: Path = REPO / "models" / "reference.yaml",
        schedule_file: Path = REPO / "docs" / "schedule_quality.json", holdout_seeds=(100, 101, 102),
        quality_prompts: int | None = None, quality_rows: list[str] | None = None) -> dict:
    rows = list(rows or ROWS)
    extra = [r for r in (quality_rows or []) if r not in rows]  # judged on the reference model, not timed
    unknown = [r for r in rows + extra if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if "eager" not in rows:
        rows = ["eager"] + rows  # every ratio is against the eager row of this process
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    size = size or (128 if tiny else 1024)
    scale = "tiny" if tiny else "full"
    try:
        schedule = chosen_schedule(steps, schedule_file)  # the reference model's chosen 28-step schedule
    except NoSchedule as exc:
        if not tiny:
            raise SystemExit(f"compose: {exc}")
        schedule = ditbook_schedule(steps, warmup=2, computed=max(3, steps // 3))  # a short check run
        _log(f"compose: {exc}; the tiny check run uses {schedule.name}")
    compile_opts = {"backend": compile_backend}
    result: dict = {"command": "compose", "shape": f"flux-{scale}", "size": size, "steps": steps, "device": device,
                    "dtype": str(dtype), "repeats": repeats, "compile_backend": compile_backend,
                    "schedule": schedule.to_dict(), "env": environment(), "rows": []}
    _log(f"compose: FLUX shape {scale}, {size}², {steps} steps, {device}, {dtype}; schedule {schedule.name} "
         f"({schedule.computed}/{steps} computed)")
    t_start = time.perf_counter()
    fp = flux_pipeline(scale, device, dtype, height=size, width=size, steps=steps,
                       **({"text_tokens": 32} if tiny else {}))
    result["transformer_params"] = fp.transformer_params
    configs = row_configs(schedule, compile_opts, steps)
    result["peaks"] = measure_peaks(device)  # the device's bf16 / fp8 matmul rates, this process
    eager_img = None
    for name in rows:
        capture = CallCapture(fp.pipe.transformer) if name == "eager" else None
        try:
            row, img = speed_row(fp, configs[name], repeats, eager_img)
        finally:
            if capture is not None:
                capture.remove()
        if capture is not None:  # one transformer call at this shape, counted on the eager model
            result["flops"] = capture.count()
        row["row"] = name
        if name == "eager":
            eager_img = img
        add_gap(row, result.get("flops"), result["peaks"], repeats)
        result["rows"].append(row)
        _dump(out / "compose.json", result)
    base = next(r for r in result["rows"] if r["row"] == "eager")["timing"]["end_to_end"]["median"]
    for r in result["rows"]:
        if r["status"] == "measured":
            r["speedup"] = round(base / r["timing"]["end_to_end"]["median"], 4)
    result["speed_seconds"] = round(time.perf_counter() - t_start, 1)
    del fp
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if quality:
        _log(f"quality on the reference model ({card}), {steps} steps, cache gates")
        q_opts = compile_opts if quality_compiled else None
        result["reference"] = reference_quality(card, device, steps, lambda: row_configs(schedule, q_opts, steps),
                                                rows + extra, list(holdout_seeds), quality_prompts,
                                                compiled=quality_compiled)
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    _dump(out / "compose.json", result)
    (out / "compose.md").write_text(markdown(result))
    return result


def add_gap(row: dict, flops: dict | None, peaks: dict, repeats: int) -> None:
    """``row["gap"]``: its computed-step time (the transformer calls of computed steps) beside the
    time at the measured peaks (``speedsuite.gap``)."""
    call_s = row.pop("call_s", [])
    if row.get("status") != "measured":
        return
    params = row.get("params") or {}
    mask = (params.get("schedule") or {}).get("mask")
    picked, how = computed_calls(call_s, repeats, mask)
    row["gap"] = gap(flops, peaks, picked, how, fp8=bool((params.get("fp8") or {}).get("quantized")))


def _f(v, nd=3, suffix=""):
    return "–" if v is None else f"{v:.{nd}f}{suffix}"


def markdown(result: dict) -> str:
    ref = (result.get("reference") or {}).get("rows") or {}
    g = (result.get("reference") or {}).get("gates") or {}
    lines = [f"# Speed, composed — {result['shape']}, {result['size']}², {result['steps']} steps, "
             f"{result['device']}, {result['dtype']}",
             "",
             f"Schedule `{result['schedule']['name']}` {result['schedule']['mask']} "
             f"({result['schedule']['computed']}/{result['steps']} computed); compile backend "
             f"`{result['compile_backend']}`; {result['repeats']} timed calls per row after the first; "
             f"versions: {result['env'].get('versions')}; GPUs: {result['env'].get('gpus', 'none')}.",
             "",
             "| configuration | end to end (s), median (min–max) | speedup vs eager | first call (s) | compile (s) "
             f"{GAP_HEADER} reference PSNR min / SSIM min (gates > {g.get('psnr', '?')} / > {g.get('ssim', '?')}) | notes |",
             f"| --- | --- | ---: | ---: | ---: {GAP_ALIGN} --- | --- |"]
    for r in result["rows"]:
        q = ref.get(r["row"]) or {}
        if q.get("status") == "measured":
            rq = f"{_f(q['psnr_min'], 2)} / {_f(q['ssim_min'], 4)} {'pass' if q['passed'] else 'FAIL'}"
        elif q.get("status") == "refused":
            rq = "refused"
        elif q.get("status") == "not judged":
            rq = "= eager (uncompiled pass)"
        else:
            rq = "baseline" if r["row"] == "eager" else "–"
        if r["status"] != "measured":
            lines.append(f"| {r['row']} | refused | – | – | – {gap_cells(r)}| {rq} | {r['reason']} |")
            continue
        e = r["timing"]["end_to_end"]
        params = r.get("params") or {}
        comp = (params.get("compile") or {}).get("compile_s")
        notes = []
        gr = params.get("graphs") or {}
        if gr:
            notes.append(f"graphs: {gr.get('captured')} captured, {gr.get('replays')} replays, "
                         f"{gr.get('eager_calls')} eager" + (f", disabled: {gr['disabled']}" if gr.get("disabled") else ""))
        fp8 = params.get("fp8") or {}
        if fp8.get("layers"):
            notes.append(f"fp8: {fp8['quantized']}/{fp8['layers']} block linears")
        sv = r.get("shape_vs_eager")
        if sv and r["row"] != "eager":
            notes.append(f"vs eager at this shape {_f(sv['psnr'], 1)} dB / {_f(sv['ssim'], 4)}")
        lines.append(f"| {r['row']} | {_f(e['median'])} ({_f(e['min'])}–{_f(e['max'])}) | {_f(r.get('speedup'), 2, '×')} "
                     f"| {_f(r.get('first_call_s'), 1)} | {_f(comp, 1)} {gap_cells(r)}| {rq} | {'; '.join(notes)} |")
    lines += [""] + gap_notes(result)
    refd = result.get("reference") or {}
    if refd:
        lines += ["", f"Reference model: {refd['prompts']} prompt(s) x seeds {refd['seeds']}, {refd['steps']} steps, "
                      + ("each row as measured (compiled)." if refd.get("compiled") else
                         "each row's configuration without its compile (compile's own effect on the images is the "
                         "`compile` row's PSNR against eager at the FLUX shape; run with --quality-compiled to "
                         "judge the compiled forms, which costs their compile time again).")]
    timed = {r["row"] for r in result["rows"]}
    for name, q in ref.items():
        if name not in timed and q.get("status") == "measured":
            lines += ["", f"Judged on the reference model, not timed here: `{name}` PSNR min {_f(q['psnr_min'], 2)} dB, "
                          f"SSIM min {_f(q['ssim_min'], 4)} {'pass' if q['passed'] else 'FAIL'}."]
    nf = refd.get("noise_floor")
    if nf:
        lines += ["", f"Reference noise floor (eager twice): PSNR min {_f(nf['psnr_min'], 2)} dB, "
                      f"SSIM min {_f(nf['ssim_min'], 4)}."]
    lines += ["", f"Speed part {result.get('speed_seconds')} s, total {result.get('total_seconds')} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny FLUX shape (1+2 blocks, 4 heads), 128² unless --size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (aot_eager: trace without kernels, a quick CPU check)")
    ap.add_argument("--no-quality", action="store_true", help="skip the reference-model quality pass")
    ap.add_argument("--quality-compiled", action="store_true",
                    help="judge each row compiled on the reference model too (default: without its compile)")
    ap.add_argument("--card", type=Path, default=REPO / "models" / "reference.yaml")
    ap.add_argument("--holdout-seeds", default="100,101,102", help="held-out seeds of the quality pass")
    ap.add_argument("--schedule-file", type=Path, default=REPO / "docs" / "schedule_quality.json",
                    help="benchmarks/schedule_quality.py's output: its chosen schedule is the cache row")
    ap.add_argument("--quality-prompts", type=int, default=None, help="first N prompts of the card (default: all)")
    ap.add_argument("--quality-rows", default="",
                    help="comma-separated rows judged on the reference model without being timed at the FLUX shape "
                         "(e.g. fp8+compile when its minutes-long compile does not fit the host's budget)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    res = run(a.out, tiny=a.tiny, device=a.device, size=a.size, steps=a.steps, repeats=a.repeats,
              rows=[r for r in a.rows.split(",") if r], compile_backend=a.compile_backend,
              quality=not a.no_quality, quality_compiled=a.quality_compiled, card=a.card,
              holdout_seeds=[int(s) for s in a.holdout_seeds.split(",") if s], quality_prompts=a.quality_prompts,
              schedule_file=a.schedule_file, quality_rows=[r for r in a.quality_rows.split(",") if r])
    print((a.out / "compose.md").read_text())
    return 0 if all(r["status"] in ("measured", "refused") for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
