"""Where an fp8 transformer call spends its time (issue 25 item 2): one FLUX.1-dev-wide transformer
call (widths, heads and token counts of FLUX.1-dev at 1024², random weights, bf16), compiled
regionally, per row:

- ``bf16``: the blocks as they are;
- ``fp8-row``: the block linears in fp8 as ``ditbook.accel.fp8`` ships them (torchao float8,
  dynamic e4m3 activations and weights, per-row scales);
- ``fp8-tensor``: the same with per-tensor scales (one scale per activation / weight tensor).

Each row: the first call (the compile) timed apart, then the median of ``--repeats`` warm calls
(CUDA events), dynamo's graph and recompile counts, and a ``torch.profiler`` trace of one warm call
whose GPU kernels are summed by kind (fp8 GEMM, bf16 GEMM, attention, inductor-fused kernels,
other) with the slowest kernels named. The depth is cut (``--blocks``, default 4 double and 8
single blocks) so the compile fits a short GPU command: per-block figures are those of the full
model, whose 19 + 38 blocks are the same two block classes.

``--graph`` also captures each row's warm compiled call as one CUDA graph and times its replay
(median of ``--repeats``), so the host's share of a call shows: a graphed call runs at the GPU's
speed alone. The capture follows the compile in the same row (no second compile).

    python3 benchmarks/fp8_profile.py --out OUT                   # one H200 (capability >= 8.9 for fp8)
    python3 benchmarks/fp8_profile.py --out OUT --tiny --device cpu  # the code path on a CPU (fp8 refused)

Writes ``OUT/fp8_profile.json`` and ``OUT/fp8_profile.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "benchmarks"))

from speedsuite.fullsize import FLUX_DEV, TEXT_TOKENS, _make  # noqa: E402

ROWS = ("bf16", "fp8-row", "fp8-tensor")
KINDS = ("fp8 gemm", "bf16 gemm", "attention", "quantize", "fused (inductor)", "other")


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind, from its name: inductor's triton kernels first (the ones that compute
    an absolute maximum or feed ``_scaled_mm`` hold the activations' quantization, whatever else
    they fuse), then attention kernels, then cuBLAS / CUTLASS GEMMs (fp8 when the name says so:
    cuBLAS's ``qq`` kernels take two quantized operands)."""
    n = name.lower()
    if n.startswith("triton") or "triton_" in n:
        return "quantize" if any(k in n for k in ("amax", "_scaled_mm", "quant")) else "fused (inductor)"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "cudnn_generated")):
        return "attention"
    if any(k in n for k in ("gemm", "xmma", "nvjet", "cutlass", "matmul", "_mm_", "sm90")):
        fp8 = any(k in n for k in ("e4m3", "fp8", "f8f8", "float8", "e5m2", "_qq"))
        return "fp8 gemm" if fp8 else "bf16 gemm"
    if any(k in n for k in ("amax", "abs_max", "absmax", "quant")):
        return "quantize"
    return "other"


def kinds_from_table(table: str, gpu_ms: float) -> dict:
    """GPU time by kind read back from a saved profiler table (``profile.table``, 40 rows): the
    device-kernel rows (no CPU time of their own), each by :func:`kernel_kind`; what the table's
    rows do not reach is ``other``. Lets a saved profile be re-read when the kinds are refined."""
    import re

    by = {k: 0.0 for k in KINDS}
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 11 or cells[0].startswith(("aten::", "Name", "-")) or cells[2] != "0.000us":
            continue
        t = cells[6]
        ms = float(t[:-2]) if t.endswith("ms") else float(t[:-2]) / 1e3 if t.endswith("us") else float(t[:-1]) * 1e3
        by[kernel_kind(cells[0])] += ms
    by["other"] += max(0.0, gpu_ms - sum(by.values()))
    return {k: round(v, 3) for k, v in by.items()}


def transformer_inputs(tr, tokens: int, text_tokens: int, device, dtype) -> dict:
    cfg = tr.config
    g = torch.Generator(device="cpu").manual_seed(0)
    side = int(round(tokens ** 0.5))
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return {"hidden_states": torch.randn(1, tokens, cfg.in_channels, generator=g).to(device, dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, generator=g).to(device, dtype),
            "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=g).to(device, dtype),
            "timestep": torch.tensor([0.5], device=device, dtype=dtype),
            "guidance": torch.tensor([3.5], device=device, dtype=dtype) if cfg.guidance_embeds else None,
            "img_ids": ids.reshape(-1, 3).to(device), "txt_ids": torch.zeros(text_tokens, 3, device=device),
            "return_dict": False}


def _fp8_config(granularity: str):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    from ditbook.accel.fp8 import float8_config

    if granularity == "row":
        return float8_config()  # what ditbook ships
    return Float8DynamicActivationFloat8WeightConfig(activation_dtype=torch.float8_e4m3fn,
                                                     weight_dtype=torch.float8_e4m3fn,
                                                     granularity=(PerTensor(), PerTensor()))


def _timed(fn, device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def profile_call(fn, device, top: int) -> dict:
    """GPU kernel time of one call, summed by kind, and the slowest kernels."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        if device.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
            kernels[ev.key] = [float(us), int(ev.count)]
    try:  # the profiler's own table as well, in case a kernel's kind above is misread
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda"
                                          else "self_cpu_time_total", row_limit=40)
    except Exception as exc:
        table = f"{type(exc).__name__}: {exc}"
    by_kind = {k: 0.0 for k in KINDS}
    for name, (us, _) in kernels.items():
        by_kind[kernel_kind(name)] += us
    total = sum(by_kind.values())
    slow = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_ms": round(total / 1e3, 3), "by_kind_ms": {k: round(v / 1e3, 3) for k, v in by_kind.items()},
            "kernels": [{"name": n[:120], "kind": kernel_kind(n), "ms": round(us / 1e3, 3), "calls": c}
                        for n, (us, c) in slow], "kernel_count": sum(c for _, c in kernels.values()), "table": table}


def graph_call(call, device):
    """``call`` captured as one CUDA graph (after two warm calls on a side stream); returns the
    replay. Raises RuntimeError on a device without CUDA graphs."""
    if device.type != "cuda":
        raise RuntimeError(f"CUDA graphs need a CUDA device, not {device.type}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def run_row(name: str, make, inputs: dict, device, repeats: int, top: int, backend: str,
            graph: bool = False) -> dict:
    from torch._dynamo.utils import counters

    from ditbook.accel.compile import compile_regions
    from ditbook.accel.fp8 import Fp8Refused, apply_fp8, fp8_refusal

    row: dict = {"row": name}
    tr = make()
    try:
        if name.startswith("fp8"):
            why = fp8_refusal(device)
            if why:
                raise Fp8Refused(why)
            _, rec = apply_fp8(tr, config=_fp8_config(name.split("-")[1]), check_device=False)
            row["fp8"] = rec
        torch._dynamo.reset()
        counters.clear()
        compile_regions(tr, backend=backend)
        call = lambda: tr(**inputs)  # noqa: E731
        with torch.no_grad():
            row["first_call_s"] = round(_timed(call, device, 1)[0], 2)
            _timed(call, device, 2)
            times = _timed(call, device, repeats)
            row["call_s"] = {"median": round(statistics.median(times), 5), "min": round(min(times), 5),
                             "max": round(max(times), 5), "n": len(times)}
            row["profile"] = profile_call(call, device, top)
            if graph:
                try:
                    replay = graph_call(call, device)
                    _timed(replay, device, 2)
                    g = _timed(replay, device, repeats)
                    row["graph_call_s"] = {"median": round(statistics.median(g), 5), "min": round(min(g), 5),
                                           "max": round(max(g), 5), "n": len(g)}
                except Exception as exc:  # the eager-launched figures stand; the graph's failure is named
                    row["graph_call_s"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        row["dynamo"] = {"unique_graphs": counters["stats"].get("unique_graphs", 0),
                         "recompiles": sum(counters["recompiles"].values()) if counters.get("recompiles") else 0,
                         "graph_breaks": sum(counters["graph_break"].values()) if counters.get("graph_break") else 0}
        row["status"] = "measured"
    except Exception as exc:  # a row that cannot run is recorded with its reason
        row.update(status="refused" if type(exc).__name__ == "Fp8Refused" else "failed",
                   reason=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        del tr
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def write_md(result: dict, path: Path) -> None:
    lines = [f"# fp8 per-op profile — {result['shape']}", "",
             f"Device {result['device']}, torch {result['torch']}, backend {result['backend']}, "
             f"median of {result['repeats']} warm calls (CUDA events); GPU kernel time of one profiled call by kind.", "",
             "| row | first call (s) | call (s) | vs bf16 | graphed call (s) | vs bf16 graphed | "
             + " | ".join(f"{k} (ms)" for k in KINDS) + " | kernels | graphs / recompiles |",
             "| --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in KINDS) + " | ---: | ---: |"]
    base = next((r["call_s"]["median"] for r in result["rows"] if r["row"] == "bf16" and r.get("call_s")), None)
    gbase = next((r["graph_call_s"].get("median") for r in result["rows"]
                  if r["row"] == "bf16" and r.get("graph_call_s")), None)
    for r in result["rows"]:
        if r.get("status") != "measured":
            lines.append(f"| {r['row']} | {r.get('status')}: {r.get('reason', '')[:80]} |" + " |" * (len(KINDS) + 6))
            continue
        p, d = r["profile"], r["dynamo"]
        ratio = f"{base / r['call_s']['median']:.2f}×" if base else "–"
        g = r.get("graph_call_s") or {}
        gcell = f"{g['median']:.4f}" if g.get("median") else (g.get("error", "–")[:60] if g else "–")
        gratio = f"{gbase / g['median']:.2f}×" if gbase and g.get("median") else "–"
        lines.append(f"| {r['row']} | {r['first_call_s']} | {r['call_s']['median']:.4f} | {ratio} | {gcell} | {gratio} | "
                     + " | ".join(f"{p['by_kind_ms'][k]:.2f}" for k in KINDS)
                     + f" | {p['kernel_count']} | {d['unique_graphs']} / {d['recompiles']} |")
    for r in result["rows"]:
        if r.get("status") == "measured":
            lines += ["", f"## {r['row']}: slowest kernels", "", "| kernel | kind | ms | calls |", "| --- | --- | ---: | ---: |"]
            lines += [f"| `{k['name']}` | {k['kind']} | {k['ms']} | {k['calls']} |" for k in r["profile"]["kernels"]]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", default="4,8", help="double,single blocks (FLUX.1-dev: 19,38)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--tiny", action="store_true", help="a tiny width and 64 tokens (a CPU try-out)")
    ap.add_argument("--graph", action="store_true", help="also time each row's call replayed as one CUDA graph")
    ap.add_argument("--reread", type=Path, default=None,
                    help="no run: re-read a saved fp8_profile.json's profiler tables by today's kernel kinds and "
                         "write fp8_profile.md under --out")
    args = ap.parse_args(argv)
    if args.reread is not None:
        result = json.loads(args.reread.read_text())
        for r in result["rows"]:
            if r.get("status") == "measured":
                p = r["profile"]
                p["by_kind_ms"] = kinds_from_table(p["table"], p["gpu_ms"])
                for k in p["kernels"]:
                    k["kind"] = kernel_kind(k["name"])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_profile.json").write_text(json.dumps(result, indent=1))
        write_md(result, args.out / "fp8_profile.md")
        print((args.out / "fp8_profile.md").read_text())
        return 0
    from diffusers import FluxTransformer2DModel

    device = torch.device(args.device)
    double, single = (int(x) for x in args.blocks.split(","))
    cfg = {**FLUX_DEV, "num_layers": double, "num_single_layers": single}
    tokens, text = 4096, TEXT_TOKENS  # 1024² at FLUX's 16x VAE-and-patch reduction; T5's 512 tokens
    if args.tiny:
        cfg.update(num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32, pooled_projection_dim=32,
                   axes_dims_rope=(4, 6, 6))
        tokens, text = 64, 8
    inputs = transformer_inputs(_make(FluxTransformer2DModel, {**cfg, "num_layers": 0, "num_single_layers": 0},
                                      "cpu", torch.float32, 0), tokens, text, device, torch.bfloat16)
    make = lambda: _make(FluxTransformer2DModel, cfg, str(device), torch.bfloat16, 0)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"shape": f"FLUX.1-dev widths, {double} double + {single} single blocks, {tokens} image + {text} text tokens",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
              "torch": torch.__version__, "backend": args.backend, "repeats": args.repeats, "rows": []}
    for name in args.rows.split(","):
        print(f"fp8_profile: {name}", flush=True)
        result["rows"].append(run_row(name, make, inputs, device, args.repeats, args.top, args.backend, args.graph))
        (args.out / "fp8_profile.json").write_text(json.dumps(result, indent=1))
    write_md(result, args.out / "fp8_profile.md")
    print((args.out / "fp8_profile.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
