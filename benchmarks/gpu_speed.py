"""GPU speed suite (issue 8): cache schedules, compile, scale table, Ulysses and CFG parallel.

Run on a GPU host from the repository root (see docs/benchmarks.md for the offline recipe):

    python benchmarks/gpu_speed.py --out OUT [--parts cache,scale,gqa,ulysses,cfg] [--nproc 2]

Writes one JSON per part into OUT, then ``result.md`` and ``speed.png`` summarising them.
``--scale tiny --device cpu --size 128`` checks the code path on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from speedsuite import suite as gpu_suite
from speedsuite.worker import ULYSSES_VARIANTS
from speedsuite.report import write_speed_report


def torchrun(nproc: int, args: list[str], device: str, timeout: float | None = None) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m",
           "speedsuite.worker", "--device", device, *args]
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ)  # the workers import speedsuite from beside this script
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), env.get("PYTHONPATH")) if p)
    try:
        return subprocess.call(cmd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"torchrun ran past {timeout:.0f}s and was ended", flush=True)
        return 124


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="cache,gqa,cfg,ulysses,compile,scale")
    ap.add_argument("--scale", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 1)
    ap.add_argument("--schedule-file", type=Path, default=Path("docs/schedule_quality.json"))
    ap.add_argument("--no-report", action="store_true", help="JSON only (result.md is made later)")
    ap.add_argument("--cfg-steps", type=int, default=10)
    ap.add_argument("--ulysses-variants", default="", help="comma-separated (default: all of gpu_worker's)")
    ap.add_argument("--variant-timeout", type=float, default=300.0,
                    help="seconds one Ulysses variant's torchrun may take before it is ended")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "ditbook_speed"
    base_flux = work / "flux_seed0.npy"
    base_qwen = work / "qwen_seed0.npy"
    for stale in (base_flux, base_qwen):  # parity is only ever against this command's own baseline
        stale.unlink(missing_ok=True)
    t0 = time.perf_counter()
    failures = []

    def attempt(name, fn):
        try:
            fn()
        except Exception as exc:  # one part failing must not lose the others' figures
            import traceback

            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {exc}")

    if "cache" in parts:
        attempt("cache", lambda: gpu_suite.cache_suite(
            args.out, scale=args.scale, device=args.device, size=args.size, steps=args.steps,
            repeats=args.repeats, compile=False, schedule_file=args.schedule_file,
            save_baseline=base_flux))
    if "baseline" in parts:
        attempt("baseline", lambda: gpu_suite.cache_suite(
            args.out, scale=args.scale, device=args.device, size=args.size, steps=args.steps,
            repeats=args.repeats, compile=False, schedule_file=args.schedule_file, chosen_only=True,
            name="baseline", save_baseline=base_flux))
    if "compile" in parts:
        attempt("compile", lambda: gpu_suite.cache_suite(
            args.out, scale=args.scale, device=args.device, size=args.size, steps=args.steps,
            repeats=args.repeats, compile=True, schedule_file=args.schedule_file, chosen_only=True,
            name="compile", save_baseline=None if "cache" in parts else base_flux))
    if "gqa" in parts:
        attempt("gqa", lambda: gpu_suite.gqa_suite(args.out, device=args.device))
    if "cfg" in parts:
        attempt("cfg-baseline", lambda: gpu_suite.cfg_baseline(args.out, device=args.device, size=args.size,
                                                              steps=args.cfg_steps, repeats=args.repeats,
                                                              save_baseline=base_qwen))
    if "scale" in parts:
        small = args.device == "cpu"
        attempt("scale", lambda: gpu_suite.scale_suite(
            args.out, device=args.device, scales=("tiny",) if small else ("tiny", "small", "full"),
            sizes=(64, 128) if small else (512, 1024, 2048)))
    if args.nproc >= 2 and "ulysses" in parts:
        # one torchrun per variant: cache-dit patches classes and registers attention backends,
        # which would otherwise carry into the next variant's figures
        variants = args.ulysses_variants.split(",") if args.ulysses_variants else list(ULYSSES_VARIANTS)
        for i, variant in enumerate(variants):
            rc = torchrun(args.nproc, ["--task", "ulysses", "--out", str(args.out), "--baseline", str(base_flux),
                                       "--scale", args.scale, "--size", str(args.size), "--steps", str(args.steps),
                                       "--repeats", str(args.repeats), "--variants", variant]
                          + (["--append"] if i else []), args.device, timeout=args.variant_timeout)
            if rc:
                failures.append(f"ulysses {variant}: torchrun exit {rc}")
    if args.nproc >= 2 and "comm" in parts:
        rc = torchrun(args.nproc, ["--task", "comm", "--out", str(args.out)], args.device)
        if rc:
            failures.append(f"comm: torchrun exit {rc}")
    if args.nproc >= 2 and "cfg" in parts:
        rc = torchrun(2, ["--task", "cfg", "--out", str(args.out), "--baseline", str(base_qwen),
                          "--size", str(args.size), "--steps", str(args.cfg_steps), "--repeats", str(args.repeats)],
                      args.device)
        if rc:
            failures.append(f"cfg: torchrun exit {rc}")
    (args.out / "run_info.json").write_text(json.dumps({
        "command": " ".join(sys.argv), "seconds": round(time.perf_counter() - t0, 1), "failures": failures,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "env": gpu_suite.environment()}, indent=2) + "\n")
    if not args.no_report:
        write_speed_report(args.out)
    print("failures:", failures or "none")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
