"""Multi-process part of the GPU speed suite, run under torchrun (one process per GPU).

``torchrun --nproc_per_node=2 -m speedsuite.worker --task ulysses --out DIR --baseline B.npy``

Each variant rebuilds the full-size pipeline on every rank (same seed, so identical weights),
applies one parallel configuration, and is timed with the same harness as the single-GPU suite;
rank 0 writes ``parallel_<task>.json`` with per-part times and the parity of its image against
the single-GPU image of the same seed.

Ulysses variants: diffusers' own ``enable_parallelism`` (the library path), cache-dit's
``ParallelismConfig(ulysses_size=N)`` (the peer, also with its async, fp8 and VAE-planner
options), and ditbook's: cache-dit's Ulysses hooks plus regional ``torch.compile`` of the
repeated blocks, and with ``+graph`` every transformer call replayed as one CUDA graph
(``ditbook.accel.graphs``), which takes the host's kernel launches and Python hooks out of
the step once the split has halved each rank's GPU work.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .fullsize import flux_pipeline, qwen_image_pipeline
from ditbook.quality import compare
from ditbook.settings import ParallelSettings
from ditbook.timing import time_pipeline


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ulysses_diffusers(fp, world: int):
    from diffusers import ContextParallelConfig

    if not torch.cuda.is_available():
        # diffusers 0.42.1 picks the device as rank % accelerator count: no accelerator, no run
        raise RuntimeError("diffusers' enable_parallelism needs a GPU (it divides by the accelerator count); "
                           "on a CPU the suite measures cache-dit's Ulysses only")
    fp.pipe.transformer.set_attention_backend("native")
    fp.pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))


def _ulysses_cache_dit(fp, world: int, vae: bool = False, async_: bool = False, float8: bool = False):
    import cache_dit
    from cache_dit import ParallelismConfig

    extra = [fp.pipe.vae] if vae else None
    cache_dit.enable_cache(fp.pipe, parallelism_config=ParallelismConfig(
        ulysses_size=world, extra_parallel_modules=extra, ulysses_async=async_, ulysses_float8=float8))


def _plus(apply, compile: bool = False, graph: bool = False, fp8: bool = False):
    """``apply`` (a Ulysses variant), then what the parallel stage's ``+compile`` and ``+graph``
    plan options add, in the same order (``parallel.worker.compile_repeated_blocks``, then each
    transformer call replayed as a CUDA graph — or, under a static cache schedule, the computed
    steps' block work, ``install_cached_step_graphs``); with ``fp8`` the block linears in fp8
    (``ditbook.accel.fp8``) before compiling. Returns the graphs, for their stats, or None."""
    from ditbook.accel.graphs import install_cached_step_graphs, install_step_graphs
    from ditbook.parallel.worker import compile_repeated_blocks

    def variant(fp, world):
        apply(fp, world)
        if fp8:
            from ditbook.accel.fp8 import apply_fp8

            apply_fp8(fp.pipe.transformer)
        if compile:
            compile_repeated_blocks(fp.pipe.transformer, backend=os.environ.get("DITBOOK_COMPILE_BACKEND", "inductor"))
        if not graph:
            return None
        schedule = getattr(fp, "schedule", None)
        if schedule is not None:
            from ditbook.cp.cache_sync import static_schedule

            return install_cached_step_graphs(fp.pipe.transformer, static_schedule(schedule.mask),
                                              steps=schedule.steps)
        return install_step_graphs(fp.pipe.transformer)
    return variant


def _ulysses_with_schedule(fp, world: int, schedule=None):
    """cache-dit's Ulysses with the static cache schedule ``benchmarks/schedule_quality.py`` chose
    on the reference model (the single-GPU suite's ``cache`` row; refused when it chose none for this
    step count) or ``schedule``, decisions agreed across ranks (``parallel.cache_sync``, as the
    parallel stage's ``+cache``); a static mask decides the same on every rank, so the agreement must
    record no disagreement."""
    import cache_dit
    from cache_dit import ParallelismConfig

    from ditbook.cp.cache_sync import agree_cache_decisions
    from .suite import chosen_schedule

    steps = fp.call_kwargs["num_inference_steps"]
    if schedule is None:
        schedule = chosen_schedule(steps, Path(__file__).resolve().parents[2] / "docs" / "schedule_quality.json")
    cache_dit.enable_cache(fp.pipe, cache_config=schedule.cache_config(),
                           calibrator_config=schedule.calibrator_config(),
                           parallelism_config=ParallelismConfig(ulysses_size=world))
    fp.schedule = schedule
    fp.agreement = agree_cache_decisions(fp.pipe)


def _cache_dit(**options):
    return lambda fp, w: _ulysses_cache_dit(fp, w, **options)


ULYSSES_VARIANTS = {
    "diffusers-ulysses": _ulysses_diffusers,
    "cache-dit-ulysses": _ulysses_cache_dit,
    # cache-dit's VAE planner decodes tiles on each rank: a different decode than the baseline's
    "cache-dit-ulysses+vae": _cache_dit(vae=True),
    "cache-dit-ulysses-async": _cache_dit(async_=True),
    "ditbook-ulysses+compile": _plus(_ulysses_cache_dit, compile=True),
    "ditbook-ulysses-async+compile": _plus(_cache_dit(async_=True), compile=True),
    "ditbook-ulysses-fp8+compile": _plus(_cache_dit(float8=True), compile=True),
    # the host out of the step: the parallel hooks, compiled blocks and all-to-alls in one graph
    "ditbook-ulysses+graph": _plus(_ulysses_cache_dit, graph=True),
    "ditbook-ulysses+compile+graph": _plus(_ulysses_cache_dit, compile=True, graph=True),
    # cache-dit's async Ulysses overlaps V's all-to-all with the Q/K projections and the single
    # blocks' output all-to-all with their MLP; host-bound it could not show, graphed it can
    "ditbook-ulysses-async+compile+graph": _plus(_cache_dit(async_=True), compile=True, graph=True),
    "diffusers-ulysses+compile+graph": _plus(_ulysses_diffusers, compile=True, graph=True),
    # composed (issue 16): the static cache schedule with Ulysses, compile, fp8 and graphs of the
    # computed steps
    "ditbook-ulysses+cache": _plus(_ulysses_with_schedule),
    "ditbook-ulysses+cache+compile": _plus(_ulysses_with_schedule, compile=True),
    "ditbook-ulysses+cache+compile+graph": _plus(_ulysses_with_schedule, compile=True, graph=True),
    "ditbook-ulysses+cache+fp8+compile": _plus(_ulysses_with_schedule, compile=True, fp8=True),
    "ditbook-ulysses+cache+fp8+compile+graph": _plus(_ulysses_with_schedule, compile=True, fp8=True, graph=True),
}


def run_comm(args, world: int) -> list[dict]:
    """All-to-all bandwidth at the size of one Ulysses exchange of the FLUX.1-dev shape (one of
    Q, K, V, O for 4608 tokens x 24 heads x 128 in bf16), to tell communication from compute."""
    dev = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else "cpu"
    rows = []
    for tokens in (4608, 16896):
        x = torch.randn(tokens // world * 24 * 128, dtype=_dtype(args), device=dev)
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        if args.device == "cuda":
            torch.cuda.synchronize()
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_to_all_single(y, x)
        if args.device == "cuda":
            torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / reps
        nbytes = x.numel() * x.element_size()
        moved = nbytes * (world - 1) / world  # bytes each rank sends to the others
        rows.append({"tokens": tokens, "bytes_per_rank": nbytes, "seconds": sec,
                     "send_gbps": round(moved / sec / 1e9, 2),
                     "per_step_seconds_57_layers_x4": round(sec * 57 * 4, 4)})
        _log(f"all_to_all {nbytes / 2**20:.1f} MiB per rank: {sec * 1e3:.3f} ms ({rows[-1]['send_gbps']} GB/s sent)")
    return rows


def _image(fp) -> np.ndarray:
    with torch.inference_mode():
        out = fp(seed=0)
    img = out.images[0].float().cpu().numpy()
    return np.transpose(img, (1, 2, 0)) if img.shape[0] in (1, 3) else img


def _parity(img: np.ndarray, baseline: Path | None) -> dict | None:
    if baseline is None or not Path(baseline).is_file():
        return None
    ref = np.load(baseline)
    ref = np.transpose(ref, (1, 2, 0)) if ref.shape[0] in (1, 3) else ref
    rep = compare(np.clip(img, 0, 1), np.clip(ref, 0, 1), ParallelSettings().gates)
    return rep.to_dict()


def _dtype(args):
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def _empty(args) -> None:
    if args.device == "cuda":
        torch.cuda.empty_cache()


def run_ulysses(args, world: int) -> list[dict]:
    rows = []
    names = args.variants.split(",") if args.variants else list(ULYSSES_VARIANTS)
    for name in names:
        _log(f"ulysses variant {name} on {world} ranks")
        try:
            fp = flux_pipeline(args.scale, args.device, _dtype(args), height=args.size, width=args.size,
                               steps=args.steps)
            applied = ULYSSES_VARIANTS[name](fp, world)
            t = time_pipeline(fp.pipe, fp, warmup=1, repeats=args.repeats)
            img = _image(fp)
            graphs = None
            if applied is not None:
                graphs = applied.to_dict()
                applied.remove()  # a graph that captured NCCL work must go before its communicator does
            del applied
        except Exception as exc:  # a variant that fails is recorded; the others still run
            import traceback

            traceback.print_exc()
            rows.append({"name": name, "world_size": world, "error": f"{type(exc).__name__}: {exc}"})
            fp = None
            _empty(args)
            dist.barrier()
            continue
        row = {"name": name, "world_size": world, **t.to_dict()}
        if graphs:
            row["graphs"] = graphs
        if getattr(fp, "schedule", None) is not None:
            row["schedule"] = fp.schedule.to_dict()
            row["cache_agreement"] = fp.agreement.to_dict()
        if dist.get_rank() == 0:
            row["parity"] = _parity(img, args.baseline)
            _log(f"  {name}: {t.end_to_end.median:.3f}s (step {t.parts['transformer_step'].median:.4f}s); "
                 f"parity {row['parity'] and row['parity']['psnr']}" + (f"; graphs {graphs}" if graphs else ""))
        rows.append(row)
        _save(args, "ulysses", rows)  # after every variant: a later one that hangs loses nothing
        del fp
        _empty(args)
        dist.barrier()
    return rows


def _save(args, task: str, rows: list[dict]) -> None:
    """Rank 0 writes ``parallel_<task>.json``; with ``--append`` after the rows already there
    (the suite runs each Ulysses variant in its own processes, so no variant's library patches
    leak into the next one's figures)."""
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"parallel_{task}.json"
        before = []
        if args.append and path.is_file():
            before = json.loads(path.read_text()).get("rows", [])
            before = [r for r in before if r.get("name") not in {x.get("name") for x in rows}]
        path.write_text(json.dumps({"task": task, "rows": before + rows}, indent=2, default=str) + "\n")


def run_cfg(args, world: int) -> list[dict]:
    from ditbook.accel.cfg import apply_cfg_parallel

    rows = []
    _log(f"CFG parallel on a Qwen-Image shape, {world} ranks")
    layers = 60 if args.device == "cuda" else 2
    fp = qwen_image_pipeline(args.device, _dtype(args), num_layers=layers, height=args.size, width=args.size,
                             steps=args.steps)
    stats = apply_cfg_parallel(fp.pipe.transformer, "separate")
    t = time_pipeline(fp.pipe, fp, warmup=1, repeats=args.repeats)
    img = _image(fp)
    row = {"name": "ditbook-cfg-parallel", "world_size": world, "cfg_stats": stats.to_dict(), **t.to_dict()}
    if dist.get_rank() == 0:
        row["parity"] = _parity(img, args.baseline)
        _log(f"  cfg parallel: {t.end_to_end.median:.3f}s; parity {row['parity'] and row['parity']['psnr']}")
    rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("ulysses", "cfg", "comm"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", type=Path, help="single-GPU image (.npy) of seed 0 for the parity check")
    ap.add_argument("--scale", default="full")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", help="comma-separated Ulysses variants (default: all)")
    ap.add_argument("--append", action="store_true", help="add rows to an existing parallel_<task>.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    try:
        rows = {"ulysses": run_ulysses, "cfg": run_cfg, "comm": run_comm}[args.task](args, world)
        _save(args, args.task, rows)
    finally:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.synchronize()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
