"""Speed at video shapes on one GPU (issue 16, item 5): a Wan2.1-T2V-shaped WanPipeline with random
weights, true CFG (two transformer calls per step), text encoder and VAE left out (the prompt
embeddings are passed in at their real shape, the pipeline returns latents), so what is timed is
the denoising loop: the part that caching, compile and parallelism change.

    python3 benchmarks/video_gpu.py --out OUT                          # 1.3B shape, 480x832x81, one H200
    python3 benchmarks/video_gpu.py --out OUT --tiny --device cpu      # the same code on a CPU

Shapes (the published ``transformer/config.json`` of Wan-AI/Wan2.1-T2V-1.3B-Diffusers and
Wan-AI/Wan2.1-T2V-14B-Diffusers): 1.3B = 30 layers, 12 heads x 128, FFN 8960; 14B = 40 layers,
40 heads x 128, FFN 13824; both patch (1, 2, 2), 16 latent channels, text width 4096, 512 text
tokens. 480x832 with 81 frames is 21 x 60 x 104 latents, 21 x 30 x 52 = 32,760 tokens.

Rows, one process, each against the eager row of the same process:

- ``eager``, ``cache`` (a static step schedule through cache-dit: ``--computed`` of ``--steps``
  steps computed, spaced like the FLUX schedule ``benchmarks/schedule_quality.py`` chose),
  ``compile`` (regional), ``cache+compile``;
- each: the first call timed apart (compile), then ``--repeats`` calls (median, min, max), the
  time per denoising step (end to end / steps) and per transformer call;
- ``--schedule-file F`` (``benchmarks/schedule_quality.py``'s output for the video reference,
  ``--card models/video_reference.yaml --steps 20``): the cache rows use the schedule chosen there
  on a trained model; when it chose none (no schedule passed the gates), every row with ``cache``
  is recorded ``refused`` with that reason and the other rows still run;
- ``--shape 14b`` adds nothing but the size: the 14B transformer, eager, time per step (fewer
  steps: a 50-step run would take minutes per repeat).

The weights are random, so the cache's effect on quality is not judged here; the video
reference's cache stage judges schedules on a trained model (``models/video_reference.yaml``).

Writes ``OUT/video_<shape>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .fullsize import FullSizePipeline, _make
from .gap import GAP_ALIGN, GAP_HEADER, CallCapture, CallTimer, gap_cells, gap_notes, measure_peaks
from .schedules import ditbook_schedule
from .suite import _dump, _log, environment
from ditbook.configuration import Config
from ditbook.timing import device_of, time_pipeline

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
WAN_TINY = {**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64, "num_layers": 2,
            "text_dim": 32, "freq_dim": 16}
SHAPES = {"1.3b": WAN_1_3B, "14b": WAN_14B, "tiny": WAN_TINY}
SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)  # UniPC flow (Wan's default sampler family)


def wan_pipeline(shape: str = "1.3b", device: str = "cuda", dtype=torch.bfloat16, *, height: int = 480,
                 width: int = 832, frames: int = 81, steps: int = 50, guidance_scale: float = 5.0,
                 text_tokens: int = 512, seed: int = 0) -> FullSizePipeline:
    """A Wan2.1-T2V-shaped WanPipeline with random weights (text encoder and VAE left out)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    cfg = SHAPES[shape]
    transformer = _make(WanTransformer3DModel, cfg, device, dtype, seed)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=SCHEDULER["shift"],
                                        num_train_timesteps=SCHEDULER["num_train_timesteps"])
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    embeds = torch.randn(1, text_tokens, cfg["text_dim"], generator=g).to(device, dtype)
    kwargs = dict(prompt_embeds=embeds, negative_prompt_embeds=torch.randn_like(embeds) * 0.5, height=height,
                  width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=guidance_scale,
                  output_type="latent")
    params = sum(p.numel() for p in transformer.parameters())
    return FullSizePipeline(pipe, f"wan-{shape}", kwargs, params)


def tokens(cfg: dict, height: int, width: int, frames: int) -> int:
    pt, ph, pw = cfg["patch_size"]
    return ((frames - 1) // 4 + 1) // pt * (height // 8 // ph) * (width // 8 // pw)


ROWS = ("eager", "cache", "compile", "cache+compile")


def row_configs(schedule, compile_opts: dict, steps: int) -> dict[str, Config]:
    """The composition benchmark's rows of the same names (``speedsuite.compose.row_configs``)."""
    from .compose import row_configs as compose_rows

    return {k: v for k, v in compose_rows(schedule, compile_opts, steps).items() if k in ROWS}


def time_row(fp, cfg: Config, repeats: int, steps: int) -> dict:
    row: dict = {"config": cfg.name}
    undo = cfg.apply(fp.pipe)
    try:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        last = fp.pipe.transformer.blocks[-1]  # runs only when a step is computed (cache-dit keeps Fn first blocks)
        seen = []
        hook = last.register_forward_pre_hook(lambda *_: seen.append(1))
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                fp(seed=0)
            sync()
        finally:
            hook.remove()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        # what ran, not what was configured: the last block's calls in one generation (2 per computed step)
        row["last_block_calls"] = len(seen)
        timer = CallTimer(fp.pipe.transformer, cuda=torch.cuda.is_available() and device_of(fp.pipe).startswith("cuda"))
        try:
            t = time_pipeline(fp.pipe, fp, warmup=0, repeats=repeats)
        finally:
            timer.remove()
        row["call_s"] = timer.seconds()  # each transformer call: the gap columns (speedsuite.gap)
    finally:
        if undo is not None:
            undo()
    timing = t.to_dict()
    med = t.end_to_end.median
    calls = (timing.get("parts") or {}).get("transformer_step") or {}
    row.update(status="measured", timing=timing, params=cfg.params, per_step_s=round(med / steps, 4),
               transformer_call_median_s=calls.get("median"))
    _log(f"  {cfg.name:16s} last block ran {row['last_block_calls']}x; {med:8.3f}s  ({med / steps:.3f} s/step, min {t.end_to_end.min:.3f}, "
         f"max {t.end_to_end.max:.3f})  first call {row['first_call_s']:.1f}s")
    return row


def file_schedule(path: Path, steps: int):
    """(schedule, None) from a ``schedule_quality.py`` output whose choice has ``steps`` steps, or
    (None, the reason no cache row can run) when it chose none; another step count stops the run."""
    from .suite import NoSchedule, schedule_from_choice

    try:
        return schedule_from_choice(path, steps), None
    except NoSchedule as exc:
        if exc.chose_none:
            return None, str(exc)
        raise SystemExit(f"{exc} (--steps)")


def run(out: Path, *, shape: str = "1.3b", device: str = "cuda", height: int = 480, width: int = 832,
        frames: int = 81, steps: int = 20, computed: int | None = None, warmup_steps: int = 3, repeats: int = 2,
        rows: list[str] | None = None, compile_backend: str = "inductor", schedule_file: Path | None = None) -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rows = list(rows or ROWS)
    if "eager" not in rows:
        rows = ["eager"] + rows
    warmup_steps = min(warmup_steps, steps - 1)  # a short run (the 14B shape's few steps) keeps a valid mask
    computed = min(steps, computed or max(warmup_steps + 1, round(steps * 8 / 28)))  # the FLUX schedule's share
    schedule = ditbook_schedule(steps, warmup=warmup_steps, computed=computed, taylorseer_order=1)
    no_cache = None
    if schedule_file is not None:
        chosen, no_cache = file_schedule(schedule_file, steps)
        schedule = chosen or schedule  # without a choice the cache rows are refused below, not run
    cfg = SHAPES[shape]
    result: dict = {"command": "video", "shape": f"wan-{shape}", "config": cfg, "height": height, "width": width,
                    "frames": frames, "tokens": tokens(cfg, height, width, frames), "steps": steps,
                    "transformer_calls_per_step": 2, "device": device, "dtype": str(dtype), "repeats": repeats,
                    "schedule": schedule.to_dict() if not no_cache else None, "schedule_refused": no_cache,
                    "schedule_file": str(schedule_file) if schedule_file else None, "env": environment(), "rows": []}
    _log(f"video: wan-{shape}, {height}x{width}x{frames} ({result['tokens']} tokens), {steps} steps true CFG, "
         f"{device}; " + (f"schedule {schedule.name} ({schedule.computed}/{steps} computed)" if not no_cache
                           else f"no cache schedule: {no_cache}"))
    t_start = time.perf_counter()
    fp = wan_pipeline(shape, device, dtype, height=height, width=width, frames=frames, steps=steps)
    result["transformer_params"] = fp.transformer_params
    configs = row_configs(schedule, {"backend": compile_backend}, steps)
    result["peaks"] = measure_peaks(device)
    from .compose import add_gap

    for name in rows:
        if no_cache and "cache" in name.split("+"):
            result["rows"].append({"row": name, "config": name, "status": "refused", "reason": no_cache})
            _log(f"  {name:16s} refused: {no_cache}")
            continue
        capture = CallCapture(fp.pipe.transformer) if name == "eager" else None
        try:
            row = time_row(fp, configs[name], repeats, steps)
        finally:
            if capture is not None:
                capture.remove()
        if capture is not None:  # one transformer call (one CFG branch) at this shape, counted on the eager model
            result["flops"] = capture.count()
        row["row"] = name
        add_gap(row, result.get("flops"), result["peaks"], repeats)
        result["rows"].append(row)
        _dump(out / f"video_{shape}.json", result)
    base = result["rows"][0]["timing"]["end_to_end"]["median"]
    for r in result["rows"]:
        if r.get("timing"):
            r["speedup"] = round(base / r["timing"]["end_to_end"]["median"], 4)
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    _dump(out / f"video_{shape}.json", result)
    (out / f"video_{shape}.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    sched = result.get("schedule")
    said = (f"schedule `{sched['name']}` {sched['mask']} ({sched['computed']}/{result['steps']} computed)" if sched
            else f"no cache schedule ({result.get('schedule_refused')})")
    lines = [f"# Speed at a video shape — {result['shape']}, {result['height']}x{result['width']}x{result['frames']} "
             f"({result['tokens']} tokens), {result['steps']} steps true CFG, {result['device']}, {result['dtype']}",
             "",
             f"Transformer {result.get('transformer_params', 0) / 1e9:.2f} B parameters (random weights); {said}; "
             f"{result['repeats']} timed calls per row after the first; versions: "
             f"{result['env'].get('versions')}; GPUs: {result['env'].get('gpus', 'none')}.",
             "",
             "| configuration | end to end (s), median (min–max) | s per step | transformer call (s) | speedup vs eager "
             f"| first call (s) | last block ran (2 per computed step) {GAP_HEADER}",
             f"| --- | --- | ---: | ---: | ---: | ---: | ---: {GAP_ALIGN}"]
    for r in result["rows"]:
        if r.get("status") == "refused":
            lines.append(f"| {r['row']} | refused: {r['reason']} |")
            continue
        e = r["timing"]["end_to_end"]
        call = r.get("transformer_call_median_s")
        lines.append(f"| {r['row']} | {e['median']:.3f} ({e['min']:.3f}–{e['max']:.3f}) | {r['per_step_s']:.3f} "
                     f"| {'–' if call is None else f'{call:.3f}'} | {r['speedup']:.2f}× | {r['first_call_s']:.1f} "
                     f"| {r['last_block_calls']} {gap_cells(r)}|")
    lines += [""] + gap_notes(result)
    lines += ["", f"Total {result.get('total_seconds')} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", default="1.3b", choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="the tiny shape at 32x32x5 (a CPU check of the code path)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--steps", type=int, default=20, help="denoising steps (a 50-step run takes about a minute "
                                                            "per repeat at the 1.3B shape; the table reports s/step)")
    ap.add_argument("--computed", type=int, default=None, help="computed steps of the cache schedule")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", default="eager,cache,compile,cache+compile")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--schedule-file", type=Path, default=None,
                    help="schedule_quality.py's output on the video reference: its chosen schedule is the cache rows'")
    a = ap.parse_args(argv)
    if a.tiny:
        a.shape, a.height, a.width, a.frames = "tiny", 32, 32, 5
    a.out.mkdir(parents=True, exist_ok=True)
    run(a.out, shape=a.shape, device=a.device, height=a.height, width=a.width, frames=a.frames, steps=a.steps,
        computed=a.computed, repeats=a.repeats, rows=[r for r in a.rows.split(",") if r],
        compile_backend=a.compile_backend, schedule_file=a.schedule_file)
    print((a.out / f"video_{a.shape}.md").read_text())
    return 0
