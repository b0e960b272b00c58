"""Many configurations side by side: every configuration is measured in one process, beside a
baseline measured in that same process, and reported as ratios against it; FLOPs per transformer
step and the efficiency they imply.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..configuration import Config, baseline_config
from ..timing import PARTS, Stat, Timing, device_of, time_pipeline

H200_DENSE_BF16_TFLOPS = 790.0  # measured dense bf16 matmul rate of one H200 (see docs/benchmarks.md)


# -- FLOPs ----------------------------------------------------------------------------------
@dataclass
class FlopEstimate:
    """Matmul FLOPs of one real transformer call, counted by ``torch.utils.flop_counter``."""

    flops_per_call: int
    calls_per_step: float
    by_operator: dict[str, int]

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_call * self.calls_per_step

    def to_dict(self) -> dict:
        return {"flops_per_call": int(self.flops_per_call), "calls_per_step": self.calls_per_step,
                "flops_per_step": float(self.flops_per_step),
                "gflops_per_step": round(self.flops_per_step / 1e9, 4),
                "by_operator": {k: int(v) for k, v in self.by_operator.items()}}


def count_transformer_flops(pipe, call: Callable[[], Any], steps: int | None = None) -> FlopEstimate:
    """FLOPs of the transformer re-run on the inputs of ``call()``'s first transformer call."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    tr = pipe.transformer
    captured: list[tuple] = []
    count = [0]

    def pre(module, args, kwargs):
        count[0] += 1
        if not captured:
            captured.append((args, kwargs))

    handle = tr.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.inference_mode():
            call()
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError("the pipeline call never called pipe.transformer; no FLOPs to count")
    args, kwargs = captured[0]
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        tr(*args, **kwargs)
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    calls_per_step = count[0] / steps if steps else 1.0
    return FlopEstimate(int(counter.get_total_flops()), float(calls_per_step), by_op)


def default_peak_tflops(device: str) -> float | None:
    """The device's dense matmul peak when known (H200: measured bf16), else None."""
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
        if "H200" in name:
            return H200_DENSE_BF16_TFLOPS
    return None


@dataclass
class Efficiency:
    achieved_tflops: float | None
    peak_tflops: float | None
    share_of_peak: float | None

    def to_dict(self) -> dict:
        return {"achieved_tflops": _sig(self.achieved_tflops), "peak_tflops": self.peak_tflops,
                "share_of_peak": _sig(self.share_of_peak)}


def efficiency(flops: FlopEstimate | None, timing: Timing, peak_tflops: float | None) -> Efficiency:
    step = timing.parts.get("transformer_step")
    if flops is None or step is None or step.median <= 0:
        return Efficiency(None, peak_tflops, None)
    achieved = flops.flops_per_call / step.median / 1e12
    share = achieved / peak_tflops if peak_tflops else None
    return Efficiency(achieved, peak_tflops, share)


def _sig(v: float | None, digits: int = 4) -> float | None:
    """``v`` rounded to significant digits (tiny models reach tiny TFLOP/s)."""
    if v is None or not math.isfinite(v):
        return None
    return float(f"{v:.{digits}g}")


# -- many configurations side by side -------------------------------------------------------
@dataclass
class ConfigResult:
    name: str
    family: str
    params: dict
    timing: Timing | None = None
    speedup: float | None = None
    part_speedups: dict[str, float | None] = field(default_factory=dict)
    memory_ratio: float | None = None
    efficiency: Efficiency | None = None
    quality: dict | None = None  # SetQuality.to_dict() against the in-process baseline images
    images: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    error: str | None = None
    notes: str = ""

    def to_dict(self) -> dict:
        q = self.quality or {}
        return {
            "name": self.name, "family": self.family, "params": self.params, "notes": self.notes,
            "timing": self.timing.to_dict() if self.timing else None,
            "speedup": None if self.speedup is None else round(self.speedup, 4),
            "part_speedups": {k: (None if v is None else round(v, 4)) for k, v in self.part_speedups.items()},
            "memory_ratio": None if self.memory_ratio is None else round(self.memory_ratio, 4),
            "efficiency": self.efficiency.to_dict() if self.efficiency else None,
            "psnr_min": q.get("psnr_min"), "ssim_min": q.get("ssim_min"),
            "worst_tile_psnr": q.get("worst_tile_psnr"),
            "passed": q.get("passed"), "reasons": q.get("reasons", []),
            "error": self.error,
        }


@dataclass
class BenchmarkReport:
    device: str
    warmup: int
    repeats: int
    baseline: ConfigResult
    configs: list[ConfigResult]
    flops: FlopEstimate | None
    baseline_drift: float | None  # baseline re-measured at the end / at the start (1.0 = no drift)
    noise_floor: dict | None = None  # the baseline rendered twice, compared with itself
    timing: dict | None = None  # timing_record(): drift, its limit, stable, the verdict rows' warm-up and repeats

    def all(self) -> list[ConfigResult]:
        return [self.baseline, *self.configs]

    def to_dict(self) -> dict:
        return {
            "device": self.device, "warmup": self.warmup, "repeats": self.repeats,
            "flops": self.flops.to_dict() if self.flops else None,
            "baseline_drift": None if self.baseline_drift is None else round(self.baseline_drift, 4),
            "noise_floor": self.noise_floor,
            "timing": self.timing,
            "baseline": self.baseline.to_dict(),
            "configs": [c.to_dict() for c in self.configs],
        }

    def table(self) -> list[dict]:
        """One flat row per configuration, for display."""
        rows = []
        for c in self.all():
            t = c.timing
            parts = t.parts if t else {}
            ms = lambda p: None if not parts.get(p) else round(parts[p].median * 1e3, 2)  # noqa: E731
            rows.append({
                "config": c.name, "family": c.family,
                "e2e_ms": None if t is None else round(t.end_to_end.median * 1e3, 2),
                "e2e_spread": None if t is None else round(t.end_to_end.spread, 3),
                "speedup": None if c.speedup is None else round(c.speedup, 3),
                "text_ms": ms("text_encoding"), "denoise_ms": ms("denoising"),
                "step_ms": ms("transformer_step"), "decode_ms": ms("vae_decode"),
                "peak_mb": None if t is None else round(t.peak_memory_bytes / 2**20, 1),
                "psnr_min": (c.quality or {}).get("psnr_min"), "ssim_min": (c.quality or {}).get("ssim_min"),
                "passed": (c.quality or {}).get("passed"), "error": c.error,
                "quality_on": "calibration",  # rendered here on the card's seeds
            })
        return rows


def _ratio(base: Stat | None, other: Stat | None) -> float | None:
    if base is None or other is None or other.median <= 0:
        return None
    return base.median / other.median


def _render_cases(render: Callable[[str, int], np.ndarray], cases: list[tuple[str, str, int]]) -> dict[str, np.ndarray]:
    """Every case rendered once: key -> image."""
    return {key: render(prompt, seed) for key, prompt, seed in cases}


def _measure_config(pipe, cfg: Config, render, cases, call: Callable[[], Any], warmup: int,
                    repeats: int) -> ConfigResult:
    """Apply ``cfg``, render every case and time the first, undo it; an error is recorded, not raised."""
    res = ConfigResult(cfg.name, cfg.family, dict(cfg.params), notes=cfg.notes)
    undo = None
    try:
        undo = cfg.apply(pipe)
        res.images = _render_cases(render, cases)  # also warms up this configuration
        res.timing = time_pipeline(pipe, call, warmup=warmup, repeats=repeats)
    except Exception as exc:  # recorded, not fatal: the other configurations still run
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if undo is not None:
            try:
                undo()
            except Exception as exc:
                res.error = (res.error + "; " if res.error else "") + f"undo failed: {type(exc).__name__}: {exc}"
    return res


def _compare_to_baseline(res: ConfigResult, baseline: ConfigResult, flops, peak_tflops, gates) -> None:
    """A configuration's speedups, memory ratio, efficiency and quality against the baseline."""
    from ..quality import compare_sets

    if res.timing is not None:
        bt, ct = baseline.timing, res.timing
        res.speedup = _ratio(bt.end_to_end, ct.end_to_end)
        res.part_speedups = {p: _ratio(bt.parts.get(p), ct.parts.get(p)) for p in PARTS}
        res.memory_ratio = ct.peak_memory_bytes / bt.peak_memory_bytes if bt.peak_memory_bytes else None
        res.efficiency = efficiency(flops, ct, peak_tflops)
    if res.images:
        res.quality = compare_sets(res.images, baseline.images, gates).to_dict()


def timing_record(drift: float | None, limit: float, warmup: int, repeats: int, verdict_rows) -> dict:
    """Whether the baseline re-timed at the end (``drift``, 1.0 = the same) stayed within ``limit``,
    with the warm-up and repeats the baseline and the verdict's rows got."""
    stable = None if drift is None else bool(abs(drift - 1.0) <= limit)
    return {"drift": None if drift is None else round(drift, 4), "limit": limit, "stable": stable,
            "warmup": warmup, "repeats": repeats, "verdict_rows": sorted(verdict_rows)}


def benchmark(pipe, configs: list[Config], render: Callable[[str, int], np.ndarray],
              cases: list[tuple[str, str, int]], *, warmup: int = 1, repeats: int = 3,
              peak_tflops: float | None = None, steps: int | None = None, count_flops: bool = True,
              gates_for: Callable[[Config], Any] | None = None,
              progress: Callable[[Iterable], Iterable] | None = None,
              log: Callable[[str], None] | None = None, verdict_rows=(),
              drift_limit: float | None = None) -> BenchmarkReport:
    """Measure the baseline, then each configuration, then the baseline again, in this process.

    ``render(prompt, seed) -> image``; ``cases``: (key, prompt, seed), timed on the first, judged on
    all. A configuration that raises is recorded with its error. The baseline and ``verdict_rows``
    get at least ``VERDICT_MIN_WARMUP`` / ``VERDICT_MIN_REPEATS``; ``drift_limit`` judges the re-timing.
    """
    # long: one measuring sequence (baseline, FLOPs, noise floor, each configuration, baseline again)
    from ..quality import Gates, compare_sets
    from ..settings import VERDICT_MIN_REPEATS, VERDICT_MIN_WARMUP, BenchmarkSettings

    drift_limit = BenchmarkSettings().timing_drift if drift_limit is None else drift_limit
    verdict_rows = set(verdict_rows or ())
    firm_warmup, firm_repeats = max(warmup, VERDICT_MIN_WARMUP), max(repeats, VERDICT_MIN_REPEATS)

    if not cases:
        raise ValueError("benchmark needs at least one (key, prompt, seed) case")
    per_config_log = progress is None  # a progress wrapper reports each configuration itself
    progress = progress or (lambda it: it)
    log = log or (lambda msg: None)
    gates_for = gates_for or (lambda cfg: Gates.from_dict(cfg.gates))
    _, p0, s0 = cases[0]
    call = lambda: render(p0, s0)  # noqa: E731
    device = device_of(pipe)
    if peak_tflops is None:
        peak_tflops = default_peak_tflops(device)

    log(f"benchmark: baseline on {device} (warmup {warmup}, repeats {repeats})")
    baseline = _measure_config(pipe, baseline_config(), render, cases, call, firm_warmup, firm_repeats)
    if baseline.error:
        raise RuntimeError(f"the baseline failed, nothing to compare against: {baseline.error}")
    baseline.speedup = 1.0
    flops = None
    if count_flops and getattr(pipe, "transformer", None) is not None:
        try:
            flops = count_transformer_flops(pipe, call, steps)
        except Exception as exc:
            log(f"benchmark: FLOP count failed ({type(exc).__name__}: {exc})")
    baseline.efficiency = efficiency(flops, baseline.timing, peak_tflops)
    again = _render_cases(render, cases)
    noise = compare_sets(again, baseline.images, Gates()).to_dict()
    noise = {k: noise[k] for k in ("psnr_min", "ssim_min", "max_abs")}
    baseline.quality = compare_sets(baseline.images, baseline.images, Gates()).to_dict()

    results = []
    for cfg in progress(configs):
        if per_config_log:
            log(f"benchmark: {cfg.name} ({cfg.family})")
        firm = cfg.name in verdict_rows
        res = _measure_config(pipe, cfg, render, cases, call, firm_warmup if firm else warmup,
                              firm_repeats if firm else repeats)
        _compare_to_baseline(res, baseline, flops, peak_tflops, gates_for(cfg) if res.images else None)
        results.append(res)

    drift = None
    if configs:
        end = time_pipeline(pipe, call, warmup=firm_warmup, repeats=firm_repeats)
        drift = end.end_to_end.median / baseline.timing.end_to_end.median
    timing = timing_record(drift, drift_limit, firm_warmup, firm_repeats, verdict_rows)
    return BenchmarkReport(device, warmup, repeats, baseline, results, flops, drift, noise, timing)


__all__ = ["FlopEstimate", "count_transformer_flops", "default_peak_tflops", "Efficiency", "efficiency",
           "ConfigResult", "BenchmarkReport", "benchmark", "H200_DENSE_BF16_TFLOPS", "asdict"]
