"""Attention backend per device, and compile with its one-time cost, at the FLUX.1-dev shape.

    python3 -m speedsuite.backends --out DIR            # on the GPU host (PYTHONPATH: lib, benchmarks)
    python3 -m speedsuite.backends --out DIR --scale tiny --device cpu --steps 2 --size 256   # check

Writes ``DIR/backends.json``: the backend table of ``ditbook.accel.attention_backend``
(every backend diffusers' dispatcher registers: usable here or why not; per usable backend the
transformer-call time, its agreement with the default backend on one attention call and on the
transformer output; the pick and, from an independent interleaved confirmation round, how close
the pick is to the fastest), then end to end in the same process: the default backend and the
pick (and the confirmation's fastest, if another), their decoded images compared (PSNR/SSIM),
and with ``--compile`` the same compiled (regional), the one-time compile cost beside each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .fullsize import flux_pipeline
from .suite import _dump, _log, environment
from ditbook.accel.attention_backend import apply_backend, measure_pipeline_backends
from ditbook.accel.compile import compiled_config
from ditbook.configuration import Config
from ditbook.quality import compare
from ditbook.timing import time_pipeline


def _image(fp):
    with torch.inference_mode():
        return fp(seed=0).images[0].float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()


def _row(fp, cfg: Config, warmup: int, repeats: int, reference) -> tuple[dict, object]:
    undo = cfg.apply(fp.pipe)
    try:
        t0 = time.perf_counter()
        img = _image(fp)  # the first call (compiles, when compiled)
        first = time.perf_counter() - t0
        t = time_pipeline(fp.pipe, fp, warmup=warmup, repeats=repeats)
    finally:
        if undo:
            undo()
    row = {"name": cfg.name, "params": cfg.params, "first_call_s": round(first, 3), **t.to_dict()}
    if reference is not None:
        q = compare(img, reference)
        row["vs_default"] = {"psnr": q.psnr, "ssim": q.ssim}
    _log(f"  {cfg.name:34s} {t.end_to_end.median:8.3f}s (min {t.end_to_end.min:.3f}, max {t.end_to_end.max:.3f})"
         f"  first call {first:.1f}s  {row.get('vs_default', '')}")
    return row, img


def run(out: Path, *, scale: str = "full", device: str = "cuda", size: int = 1024, steps: int = 28,
        warmup: int = 3, repeats: int = 10, e2e_repeats: int = 3, compile: bool = False) -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    _log(f"attention backends: FLUX shape {scale}, {size}², {steps} steps, {device}, {dtype}")
    fp = flux_pipeline(scale, device, dtype, height=size, width=size, steps=steps)
    result: dict = {"shape": fp.name, "transformer_params": fp.transformer_params, "size": size, "steps": steps,
                    "device": device, "dtype": str(dtype), "env": environment()}
    tokens = (size // 16) ** 2
    table = measure_pipeline_backends(fp.pipe, lambda: fp(seed=0), warmup=warmup, repeats=repeats,
                                      confirm_repeats=repeats, seq_len=tokens + 512, log=_log)
    result["backends"] = table.to_dict()
    _dump(out / "backends.json", result)
    if table.pick is None:
        return result
    names = [table.default] + [n for n in (table.pick, table.fastest_confirmed) if n != table.default]
    names = list(dict.fromkeys(names))

    def backend_cfg(name: str) -> Config:
        if name == table.default:
            return Config(f"attention:{name} (default)", "baseline", lambda p: None, params={"backend": name})
        return Config(f"attention:{name}", "attention", lambda p, n=name: apply_backend(p.transformer, n),
                      params={"backend": name})

    rows, ref = [], None
    for name in names:
        row, img = _row(fp, backend_cfg(name), 1, e2e_repeats, ref)
        ref = img if ref is None else ref
        rows.append(row)
    base = rows[0]["end_to_end"]["median"]
    for r in rows:
        r["speedup_vs_default"] = round(base / r["end_to_end"]["median"], 4)
    result["end_to_end"] = rows
    _dump(out / "backends.json", result)
    if compile:
        crow = []
        for name in list(dict.fromkeys([table.default, table.pick])):
            row, _ = _row(fp, compiled_config(backend_cfg(name)), 1, e2e_repeats, ref)
            row["speedup_vs_default"] = round(base / row["end_to_end"]["median"], 4)
            crow.append(row)
            _log(f"    compile: {row['params']['compile']}")
        result["compiled"] = crow
        _dump(out / "backends.json", result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--scale", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--e2e-repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.out, scale=a.scale, device=a.device, size=a.size, steps=a.steps, warmup=a.warmup,
              repeats=a.repeats, e2e_repeats=a.e2e_repeats, compile=a.compile)
    print(json.dumps({k: res["backends"].get(k) for k in ("pick", "fastest_confirmed", "pick_over_fastest",
                                                          "speedup_vs_default")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
