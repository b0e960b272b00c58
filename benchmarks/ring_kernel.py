"""Ring attention's per-block kernel on one GPU (issue 24 item 5): for one step of a 2-rank ring at
the FLUX.1-dev and Wan2.1-1.3B shapes, the time and peak extra memory of each block's partial
attention (out and log-sum-exp) by ``ditbook.accel.ring``'s fused path and by its float32
path, beside the plain attention call on the same local shapes; and the 2-block merge against one
attention over both blocks (the ring's result on two ranks, computed in one process).

    python3 benchmarks/ring_kernel.py --out OUT        # one H200, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from ditbook.accel import ring  # noqa: E402

# (heads, local tokens of one rank of two, head dim): FLUX.1-dev 1024² (4096 image + 512 text
# tokens, 24 heads); Wan2.1-1.3B 480x832x81 (32,760 tokens, 12 heads)
SHAPES = {"flux": (24, 2304, 128), "wan-1.3b": (12, 16380, 128)}


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(median ms, peak extra GiB) of ``fn`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[len(times) // 2], peak


def measure(name: str, heads: int, tokens: int, dim: int, repeats: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, k2, v2 = (torch.randn(1, heads, tokens, dim, generator=g, device="cpu").to("cuda", torch.bfloat16)
                       for _ in range(5))
    scale = dim ** -0.5
    rows = {}
    rows["sdpa (plain call, local keys)"] = _timed(lambda: F.scaled_dot_product_attention(q, k, v), repeats)
    rows["ring block, fused"] = _timed(lambda: ring.partial_attention(q, k, v, scale), repeats)
    rows["ring block, float32 path"] = _timed(lambda: ring.reference_partial(q, k, v, scale), max(3, repeats // 3))
    kernel = ring._CHOSEN.get((str(q.device), q.dtype, dim))
    # the 2-rank ring in one process: two blocks merged vs one attention over both blocks
    o1, l1 = ring.partial_attention(q, k, v, scale)
    o2, l2 = ring.partial_attention(q, k2, v2, scale)
    merged, _ = ring.merge_partials(o1, l1, o2, l2)
    full = F.scaled_dot_product_attention(q, torch.cat([k, k2], -2), torch.cat([v, v2], -2)).float()
    err = float((merged - full).abs().max())
    fo, fl = ring.partial_attention(q, k, v, scale)
    ro, rl = ring.reference_partial(q, k, v, scale)
    return {"shape": name, "heads": heads, "local_tokens": tokens, "head_dim": dim, "kernel": kernel,
            "rows": [{"path": p, "median_ms": round(t, 3), "peak_extra_gib": round(m, 3)} for p, (t, m) in rows.items()],
            "merge_vs_full_max_abs": err, "fused_vs_float32": {"out_max_abs": float((fo - ro).abs().max()),
                                                               "lse_max_abs": float((fl - rl).abs().max())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
              "command": "python3 benchmarks/ring_kernel.py --out OUT",
              "shapes": [measure(n, *s, args.repeats) for n, s in SHAPES.items()]}
    (args.out / "ring_kernel.json").write_text(json.dumps(result, indent=1) + "\n")
    for s in result["shapes"]:
        print(s["shape"], s["kernel"], s["rows"], "merge err", s["merge_vs_full_max_abs"], s["fused_vs_float32"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
