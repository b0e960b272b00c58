"""The gap to the limit (issue 25, item 3): beside a row's computed-step time, the time that step
would take at the device's matmul peak for its FLOP count, and the achieved fraction of that peak.

- FLOPs of one transformer call, counted (``torch.utils.flop_counter.FlopCounterMode``) on the
  real model at the row's shape, on the inputs of its first transformer call (captured by a
  forward pre-hook during a call the benchmark makes anyway), split into GEMM FLOPs (matmuls,
  convolutions) and attention FLOPs (the scaled-dot-product-attention kernels). The CPU's fused
  SDPA kernel has no formula in torch's registry; it is given the same formula as the GPU kernels
  (``sdpa_flop_count``), so a CPU count includes attention too.
- The peaks, measured in the same process (:func:`measure_peaks`): a bf16 GEMM and, on CUDA
  capability >= 8.9, an fp8 e4m3 ``torch._scaled_mm`` with tensor-wise scales (torchao's default
  float8 recipe), CUDA events, warm, median. On a CPU nothing is measured ("no peak measured").
- The computed-step time (:class:`CallTimer`): every transformer call of the timed repeats timed
  apart (CUDA events or ``perf_counter``); with a static cache schedule only the calls of computed
  steps (mask 1) count, the cached ones run only the first blocks.
- At peak: FLOPs / bf16 peak; for a row whose block linears run in fp8, GEMM FLOPs at the fp8 peak
  plus attention FLOPs at the bf16 peak (attention stays bf16): a lower bound, since not every
  GEMM of the model is a quantized block linear.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ditbook.timing import Clock

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution", "cudnn_convolution",
            "convolution_overrideable", "_slow_conv2d_forward")


def _op_name(op) -> str:
    return str(op).split(".")[-1] if "." in str(op) else str(op)


def split_flops(by_operator: dict[str, int]) -> dict:
    """GEMM, attention and other FLOPs of a ``FlopCounterMode`` count by operator."""
    gemm = attn = other = 0
    for op, n in by_operator.items():
        name = _op_name(op)
        if "attention" in name:
            attn += n
        elif name in GEMM_OPS:
            gemm += n
        else:
            other += n
    return {"total": gemm + attn + other, "gemm": gemm, "attention": attn, "other": other}


def _custom_mapping() -> dict:
    """Formulas for attention kernels torch's registry lacks (the CPU's fused SDPA)."""
    from torch.utils.flop_counter import sdpa_flop_count

    def cpu_flash(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {op: cpu_flash} if op is not None else {}


def count_call_flops(module, args: tuple, kwargs: dict) -> dict:
    """FLOPs of ``module(*args, **kwargs)``: total, GEMM, attention, other, and by operator."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_custom_mapping())
    with torch.inference_mode(), counter:
        module(*args, **kwargs)
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return {**split_flops(by_op), "by_operator": by_op, "counter": "torch.utils.flop_counter.FlopCounterMode"}


class CallCapture:
    """The positional and keyword inputs of the first call of ``module`` (a forward pre-hook)."""

    def __init__(self, module):
        self.module = module
        self.first: tuple[tuple, dict] | None = None
        self._handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        if self.first is None:
            self.first = (args, dict(kwargs))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def count(self) -> dict | None:
        """The FLOPs of re-running the captured call (None if none was captured); drops the inputs."""
        self.remove()
        if self.first is None:
            return None
        args, kwargs = self.first
        self.first = None
        return count_call_flops(self.module, args, kwargs)


class CallTimer:
    """Each call of ``module`` timed (forward pre/post hooks, marks of ``ditbook.timing.Clock``:
    CUDA events on CUDA, read once at :meth:`seconds`, else ``perf_counter``)."""

    def __init__(self, module, cuda: bool):
        self.clock = Clock(cuda)
        self.marks: list[list[Any]] = []
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self.marks.append([self.clock.mark(), None])

    def _post(self, module, args, output):
        if self.marks and self.marks[-1][1] is None:
            self.marks[-1][1] = self.clock.mark()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def seconds(self) -> list[float]:
        self.clock.sync()
        return [self.clock.seconds(s, e) for s, e in self.marks if e is not None]


def computed_calls(durations: list[float], pipeline_calls: int, mask: str | None) -> tuple[list[float], str]:
    """The durations of the transformer calls of computed steps, and how they were picked.

    ``mask``: a static schedule's step mask ("1101...", 1 = computed) or None (every step
    computed). Calls map to steps when each pipeline call made a whole multiple of the mask's
    length of transformer calls (several calls per step: true CFG)."""
    if not durations or pipeline_calls < 1:
        return [], "no transformer calls timed"
    if not mask:
        return list(durations), "every call (no cache schedule)"
    per_pipe, rest = divmod(len(durations), pipeline_calls)
    steps = len(mask)
    if rest or per_pipe % steps:
        return list(durations), f"every call ({per_pipe} calls per pipeline call do not map onto {steps} steps)"
    per_step = per_pipe // steps
    picked = [d for i, d in enumerate(durations) if mask[(i % per_pipe) // per_step] == "1"]
    return picked, f"calls of the {mask.count('1')} computed steps of {steps}"


def _median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def measure_peaks(device: str, n: int = 8192, warmup: int = 3, repeats: int = 7) -> dict:
    """The device's dense matmul rates, measured here: bf16 and (capability >= 8.9) fp8 e4m3."""
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return {"note": f"no peak measured (device {device})", "bf16_tflops": None, "fp8_tflops": None}
    dev = torch.device(device)
    flops = 2.0 * n ** 3
    out: dict = {"gemm": f"{n}x{n}x{n}", "method": f"CUDA events, {warmup} warm-up, median of {repeats}",
                 "device_name": torch.cuda.get_device_name(dev)}
    t0 = time.perf_counter()
    with torch.cuda.device(dev):
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        out["bf16_tflops"] = round(flops / (_median_ms(lambda: a @ b, warmup, repeats) / 1e3) / 1e12, 1)
        cap = torch.cuda.get_device_capability(dev)
        if cap >= (8, 9) and hasattr(torch, "float8_e4m3fn"):
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev, dtype=torch.float32)
            try:
                ms = _median_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16), warmup, repeats)
                out["fp8_tflops"] = round(flops / (ms / 1e3) / 1e12, 1)
                out["fp8"] = "torch._scaled_mm e4m3, tensor-wise scales, bf16 out"
            except (RuntimeError, TypeError) as exc:
                out.update(fp8_tflops=None, fp8=f"not measured: {type(exc).__name__}: {exc}")
            del a8, b8
        else:
            out.update(fp8_tflops=None, fp8=f"not measured: capability {cap[0]}.{cap[1]} < 8.9")
        del a, b
        torch.cuda.empty_cache()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def gap(flops: dict | None, peaks: dict | None, computed: list[float], how: str, fp8: bool = False) -> dict:
    """A row's computed-step time beside its time at peak, and the achieved fraction of peak."""
    g: dict = {"how": how}
    if computed:
        g.update(computed_step_s=round(statistics.median(computed), 6), computed_step_min_s=round(min(computed), 6),
                 computed_step_max_s=round(max(computed), 6), computed_calls=len(computed))
    step = g.get("computed_step_s")
    bf16 = (peaks or {}).get("bf16_tflops")
    if flops and bf16:
        g["at_bf16_peak_s"] = flops["total"] / (bf16 * 1e12)
        if step:
            g["of_bf16_peak"] = g["at_bf16_peak_s"] / step
    f8 = (peaks or {}).get("fp8_tflops")
    if fp8 and flops and bf16 and f8:
        g["at_fp8_peak_s"] = flops["gemm"] / (f8 * 1e12) + (flops["total"] - flops["gemm"]) / (bf16 * 1e12)
        if step:
            g["of_fp8_peak"] = g["at_fp8_peak_s"] / step
    return g


def _sig(v, digits=3) -> str:
    return "–" if v is None else f"{v:.{digits}g}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


GAP_HEADER = "| computed step (s) | at bf16 peak (s) | of bf16 peak | at fp8 peak (s) | of fp8 peak |"
GAP_ALIGN = "| ---: | ---: | ---: | ---: | ---: |"


def gap_cells(row: dict) -> str:
    """The five gap cells of a table row (leading ``|`` included, trailing left out)."""
    g = row.get("gap") or {}
    return (f"| {_sig(g.get('computed_step_s'), 4)} | {_sig(g.get('at_bf16_peak_s'))} | {_pct(g.get('of_bf16_peak'))} "
            f"| {_sig(g.get('at_fp8_peak_s'))} | {_pct(g.get('of_fp8_peak'))} ")


def gap_notes(result: dict) -> list[str]:
    """The lines under a table: the FLOP count and the peaks it was set against."""
    fl, pk = result.get("flops"), result.get("peaks") or {}
    lines = []
    if fl:
        lines.append(f"FLOPs of one transformer call at this shape ({fl.get('counter', 'FlopCounterMode')}): "
                     f"{fl['total'] / 1e12:.4g} TFLOP, of which GEMM {fl['gemm'] / 1e12:.4g}, attention "
                     f"{fl['attention'] / 1e12:.4g}, other {fl['other'] / 1e12:.4g}.")
        if not fl["attention"]:
            lines.append("No attention operator was counted (a kernel torch's FLOP registry does not know): the "
                         "at-peak times are GEMM-only lower bounds.")
    else:
        lines.append("FLOPs not counted.")
    if pk.get("bf16_tflops"):
        f8 = f", fp8 {pk['fp8_tflops']} TFLOP/s ({pk.get('fp8')})" if pk.get("fp8_tflops") else \
            f"; fp8 {pk.get('fp8', 'not measured')}"
        lines.append(f"Peaks measured in this process on {pk.get('device_name')} ({pk['gemm']} GEMM, {pk['method']}): "
                     f"bf16 {pk['bf16_tflops']} TFLOP/s{f8}. \"At peak\" is the call's FLOPs at that rate (fp8 rows: "
                     f"GEMM FLOPs at the fp8 rate, attention at bf16); \"of peak\" is at-peak time / computed-step time.")
    else:
        lines.append(f"Peaks: {pk.get('note', 'no peak measured')}.")
    return lines


__all__ = ["split_flops", "count_call_flops", "CallCapture", "CallTimer", "computed_calls", "measure_peaks", "gap",
           "gap_cells", "gap_notes", "GAP_HEADER", "GAP_ALIGN"]
