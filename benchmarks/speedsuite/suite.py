"""The GPU speed suite of issue 8: full-size shapes, peers and ditbook measured side by side.

``python benchmarks/gpu_speed.py --out DIR`` runs it on a GPU host (see docs/benchmarks.md);
``--scale tiny --device cpu`` runs the same code on a CPU in a minute, for checking.

Parts, each writing one JSON file into DIR:

- ``cache.json``: a FLUX.1-dev-shaped pipeline, the eager baseline and every step schedule
  (cache-dit's predefined SCM policies and ditbook's tuned one, all static, see
  ``bench.schedules``), per-part times, FLOPs per step and achieved TFLOP/s; then the same with
  ``compile_repeated_blocks``.
- ``scale.json``: per-stage cost (one denoising step, VAE decode) as the transformer grows
  (tiny → FLUX.1-dev) and the resolution grows (512², 1024², 2048²).
- ``parallel_<task>.json``: written by the torchrun worker (``bench.gpu_worker``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from .fullsize import flux_pipeline
from .schedules import Schedule, cache_dit_policy, ditbook_schedule
from ditbook.benchmark.measure import count_transformer_flops, default_peak_tflops
from ditbook.configuration import Config, baseline_config
from ditbook.timing import time_pipeline


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def environment() -> dict:
    from ditbook.environment import versions

    env = {"versions": versions()}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
    return env


class NoSchedule(ValueError):
    """A ``schedule_quality.py`` output gives no schedule for this run (the message says why);
    ``chose_none``: the search passed no schedule at all (else it chose one for another step count)."""

    def __init__(self, reason: str, chose_none: bool = False):
        super().__init__(reason)
        self.chose_none = chose_none


def schedule_from_choice(path: Path, steps: int) -> Schedule:
    """The schedule a ``schedule_quality.py`` output chose, for a run of ``steps`` steps; raise
    :class:`NoSchedule` with the reason when it chose none (naming the closest it tried) or its
    choice has another step count: a default is never timed in its place unannounced."""
    data = json.loads(Path(path).read_text())
    best = data.get("chosen")
    if not best:
        tried = data.get("schedules") or []
        top = max(tried, key=lambda r: (r.get("calibration") or {}).get("psnr_min") or 0, default=None)
        near = (f"; the closest, {top['name']} ({top['computed']}/{data.get('steps')} computed), gave "
                f"{top['calibration']['psnr_min']:.2f} dB" if top and top.get("calibration") else "")
        raise NoSchedule(f"{path} chose no schedule: none of its {len(tried)} passed the gates "
                         f"{data.get('gates')} on {data.get('card')}{near}", chose_none=True)
    mask = tuple(int(c) for c in best["mask"])
    if len(mask) != steps:
        raise NoSchedule(f"{path}: its schedule {best['name']} has {len(mask)} steps, this run {steps}")
    return Schedule(best["name"], mask, int(best.get("taylorseer_order", 0)))


def chosen_schedule(steps: int, path: Path | None = None) -> Schedule:
    """ditbook's schedule: the one recorded by ``benchmarks/schedule_quality.py`` on the reference
    model (fewest computed steps that pass the gates on held-out seeds; :func:`schedule_from_choice`,
    which refuses a file that chose none or chose for another step count); without a file, a default."""
    if path is not None and Path(path).is_file():
        return schedule_from_choice(path, steps)
    return ditbook_schedule(steps, warmup=4, computed=10, taylorseer_order=1)


def schedule_configs(steps: int, chosen: Schedule, budgets=(8, 9), peers: bool = True) -> list[Config]:
    """The peers' SCM policies, ditbook's chosen schedule, and ditbook schedules with other
    computed-step budgets (a schedule's speed depends on its budget and TaylorSeer order only)."""
    peers = [cache_dit_policy(p, steps) for p in ("medium", "fast")] if peers else []
    ours = [chosen] + [ditbook_schedule(steps, 4, c, chosen.taylorseer_order or 1) for c in budgets
                       if c != chosen.computed]
    return [Config(s.name, f"cache/{s.owner}", s.apply, params=s.to_dict()) for s in peers + ours]


def _time(fp, cfg: Config, warmup: int, repeats: int) -> dict:
    undo = cfg.apply(fp.pipe)
    try:
        t = time_pipeline(fp.pipe, fp, warmup=warmup, repeats=repeats)
    finally:
        if undo:
            undo()
    row = {"name": cfg.name, "family": cfg.family, "params": cfg.params, **t.to_dict()}
    _log(f"  {cfg.name:28s} {t.end_to_end.median:8.3f}s  (min {t.end_to_end.min:.3f}, max {t.end_to_end.max:.3f})")
    return row


def _graph_apply(pipe):
    from ditbook.accel.graphs import install_step_graphs

    graphs = install_step_graphs(pipe.transformer)

    def undo():
        _log(f"    graphs: {graphs.to_dict()}")
        graphs.remove()
    return undo


def _efficiency(flops, row: dict, peak: float | None) -> dict | None:
    """Achieved TFLOP/s of one transformer call (median of the row's calls) and its share of peak."""
    step = row["parts"]["transformer_step"]
    if not step:
        return None
    achieved = flops.flops_per_call / step["median"] / 1e12
    return {"tflops": round(achieved, 1), "peak_tflops": peak, "share": round(achieved / peak, 3) if peak else None}


def _ratios(rows: list[dict], base_name: str) -> None:
    base = next(r for r in rows if r["name"] == base_name)["end_to_end"]["median"]
    for r in rows:
        r["speedup_vs_" + base_name] = round(base / r["end_to_end"]["median"], 3)


def cache_suite(out: Path, *, scale: str = "full", device: str = "cuda", size: int = 1024, steps: int = 28,
                warmup: int = 1, repeats: int = 3, compile: bool = True, schedule_file: Path | None = None,
                save_baseline: Path | None = None, chosen_only: bool = False, name: str = "cache") -> dict:
    """Eager baseline, the peers' and ditbook's schedules, then compiled; one process, side by side.
    ``chosen_only`` times just the baseline and ditbook's chosen schedule (the compile run)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    _log(f"cache suite: FLUX shape {scale}, {size}², {steps} steps, {device}")
    fp = flux_pipeline(scale, device, dtype, height=size, width=size, steps=steps)
    chosen = chosen_schedule(steps, schedule_file)
    result: dict = {"shape": fp.name, "transformer_params": fp.transformer_params, "size": size,
                    "steps": steps, "device": device, "env": environment(), "chosen": chosen.to_dict()}
    flops = count_transformer_flops(fp.pipe, fp, steps=steps)
    result["flops"] = flops.to_dict()
    if save_baseline is not None:
        with torch.inference_mode():
            img = fp(seed=0).images[0].float().cpu().numpy()
        save_baseline.parent.mkdir(parents=True, exist_ok=True)
        np.save(save_baseline, img)
    rows = [_time(fp, baseline_config(), warmup, repeats)]
    sched = (lambda: schedule_configs(steps, chosen, budgets=(), peers=False)) if chosen_only else \
        (lambda: schedule_configs(steps, chosen))
    for cfg in sched():
        rows.append(_time(fp, cfg, warmup, repeats))
    rows.append(_time(fp, Config("baseline-again", "baseline", lambda p: None), 0, repeats))
    _ratios(rows, "baseline")
    peak = default_peak_tflops(device)
    result["efficiency_eager"] = _efficiency(flops, rows[0], peak)
    result["eager"] = rows
    _dump(out / f"{name}.json", result)
    if compile:
        _log("compiling the repeated blocks (regional torch.compile)")
        t0 = time.perf_counter()
        fp.pipe.transformer.compile_repeated_blocks(fullgraph=True)
        with torch.inference_mode():
            fp()
        result["compile_seconds"] = round(time.perf_counter() - t0, 1)
        crow = [_time(fp, Config("baseline-compiled", "baseline", lambda p: None), warmup, repeats)]
        if device.startswith("cuda"):
            # the same compiled call replayed as a CUDA graph: the one-GPU figure a graphed
            # parallel plan is fairly compared with
            crow.append(_time(fp, Config("baseline-compiled+graph", "baseline", _graph_apply), warmup, repeats))
        for cfg in schedule_configs(steps, chosen, budgets=(), peers=False):
            cfg.name += "-compiled"
            crow.append(_time(fp, cfg, max(warmup, 1), repeats))
        base = rows[0]["end_to_end"]["median"]
        for r in crow:
            r["speedup_vs_baseline"] = round(base / r["end_to_end"]["median"], 3)
        _ratios(crow, "baseline-compiled")
        result["efficiency_compiled"] = _efficiency(flops, crow[0], peak)
        result["compiled"] = crow
        _dump(out / f"{name}.json", result)
    del fp
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    return result


def scale_suite(out: Path, *, device: str = "cuda", scales=("tiny", "small", "full"), sizes=(512, 1024, 2048),
                steps: int = 3, repeats: int = 2) -> dict:
    """Per-stage cost as the model and the resolution grow (a few steps; per-step figures)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rows = []
    for scale in scales:
        fp = None
        for size in sizes:
            _log(f"scale: {scale} at {size}²")
            fp = flux_pipeline(scale, device, dtype, height=size, width=size, steps=steps) if fp is None else fp
            fp.call_kwargs.update(height=size, width=size)
            t = time_pipeline(fp.pipe, fp, warmup=1, repeats=repeats)
            parts = t.to_dict()["parts"]
            rows.append({
                "scale": scale, "size": size, "transformer_params": fp.transformer_params,
                "image_tokens": (size // 16) ** 2, "end_to_end_s": t.end_to_end.median,
                "transformer_step_s": (parts["transformer_step"] or {}).get("median"),
                "vae_decode_s": (parts["vae_decode"] or {}).get("median"),
                "peak_memory_mb": t.to_dict()["peak_memory_mb"], "steps": steps,
            })
            _log(f"  step {rows[-1]['transformer_step_s']}, vae {rows[-1]['vae_decode_s']}")
        del fp
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    result = {"device": device, "env": environment(), "rows": rows}
    _dump(out / "scale.json", result)
    return result


def gqa_suite(out: Path, *, device: str = "cuda", repeats: int = 20) -> dict:
    """The attention path for the GQA shape: pick by one measurement, confirm with a second.

    ditbook picks the faster of SDPA ``enable_gqa=True`` and K/V repeated to the query heads from
    a selection run; an independent confirmation run (more repeats) then checks the pick is
    within 3% of the fastest path measured, dispatch backends included."""
    from ditbook.cp.attention import time_gqa
    from .fullsize import gqa_shapes

    shp = gqa_shapes()
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    backends = ("native", "_native_flash", "_native_cudnn", "_native_efficient") if device.startswith("cuda") else ()
    kw = dict(batch=shp["batch"], device=device, dtype=dtype)
    pick = time_gqa(shp["heads"], shp["kv_heads"], shp["head_dim"], shp["tokens"], repeats=max(5, repeats // 4), **kw)
    confirm = time_gqa(shp["heads"], shp["kv_heads"], shp["head_dim"], shp["tokens"], repeats=repeats,
                       backends=backends, **kw)
    fastest = min(confirm.seconds, key=confirm.seconds.get)
    picked_s = confirm.seconds.get(pick.faster)
    result = {"shape": shp, "device": device, "env": environment(), "selection": pick.to_dict(),
              "confirmation": confirm.to_dict(), "picked": pick.faster, "fastest": fastest,
              "picked_over_fastest": round(picked_s / confirm.seconds[fastest], 4) if picked_s else None}
    _log(f"GQA: picked {pick.faster}; confirmation {confirm.seconds}; fastest {fastest}")
    _dump(out / "gqa.json", result)
    return result


def cfg_baseline(out: Path, *, device: str = "cuda", size: int = 1024, steps: int = 10, repeats: int = 3,
                 save_baseline: Path | None = None) -> dict:
    """The single-GPU baseline of the true-CFG (Qwen-Image-shaped) pipeline, for the CFG-parallel
    ratio measured by the worker on the same host in the same command."""
    from .fullsize import qwen_image_pipeline

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    layers = 60 if device.startswith("cuda") else 2
    _log(f"CFG baseline: Qwen-Image shape ({layers} blocks), {size}², {steps} steps")
    fp = qwen_image_pipeline(device, dtype, num_layers=layers, height=size, width=size, steps=steps)
    if save_baseline is not None:
        with torch.inference_mode():
            img = fp(seed=0).images[0].float().cpu().numpy()
        save_baseline.parent.mkdir(parents=True, exist_ok=True)
        np.save(save_baseline, img)
    row = _time(fp, baseline_config(), 1, repeats)
    result = {"shape": fp.name, "transformer_params": fp.transformer_params, "size": size, "steps": steps,
              "env": environment(), "baseline": row}
    _dump(out / "cfg_baseline.json", result)
    del fp
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result
