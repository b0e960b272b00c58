"""Timing harness: end-to-end and per-part times, peak memory, FLOPs per transformer step.

Every configuration is measured in one process, side by side with a baseline measured in that
same process, and reported as ratios against it.

Configuration protocol
----------------------
A configuration is a :class:`Config`::

    Config(name="dbcache-F1B0-0.12", family="cache",
           apply=lambda pipe: <turn the acceleration on>; return undo)

``apply(pipe)`` switches the acceleration on for a *loaded* pipeline and returns a callable that
switches it off again (or ``None`` when nothing needs undoing). The harness calls ``apply``,
measures, then calls the returned undo before the next configuration, so one loaded pipeline
serves every configuration. ``family`` groups configurations in the plots and the readout
(``baseline``, ``cache``, ``parallel``, ``cache+parallel``, or a finer name such as
``cache/dbcache``; the part before ``/`` is the gate family). ``params`` is a free mapping shown in
the tables; ``gates`` optionally overrides the quality gates for this configuration.
The cache and parallel packages provide their configurations as ``Config`` objects (see
:mod:`ditbook.bench.inputs`).

Parts measured per pipeline call (wrappers installed per instance at run time, never on classes):

- ``text_encoding``: ``pipe.encode_prompt`` (instance attribute shadowing the bound method);
- ``transformer_step``: each call of ``pipe.transformer`` (forward pre/post hooks);
- ``denoising``: from the first transformer call's start to the last one's end in a pipeline call
  (includes the scheduler steps between them);
- ``vae_decode``: ``pipe.vae.decode`` (instance attribute).

On CUDA every boundary is a CUDA event, read after one synchronize at the end of the call; on
the CPU it is ``time.perf_counter``. Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and
the sampled peak RSS of the process on the CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

PARTS = ("text_encoding", "denoising", "transformer_step", "vae_decode")
H200_DENSE_BF16_TFLOPS = 790.0  # measured dense bf16 matmul rate of one H200 (see docs/benchmarks.md)


# -- configurations -------------------------------------------------------------------------
@dataclass
class Config:
    """A named acceleration: ``apply(pipe)`` turns it on and returns an undo callable (or None)."""

    name: str
    family: str
    apply: Callable[[Any], Callable[[], None] | None]
    params: dict = field(default_factory=dict)
    gates: dict | None = None
    notes: str = ""

    @property
    def gate_family(self) -> str:
        return self.family.split("/")[0]

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "params": dict(self.params), "notes": self.notes}


def baseline_config() -> Config:
    return Config("baseline", "baseline", lambda pipe: None, notes="the pipeline as loaded")


# -- statistics -----------------------------------------------------------------------------
@dataclass
class Stat:
    """Median, min and max of repeated measurements, in seconds."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Stat | None":
        xs = [float(v) for v in values]
        if not xs:
            return None
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative spread of the repeats."""
        return (self.max - self.min) / self.median if self.median > 0 else float("nan")

    def to_dict(self) -> dict:
        return {"median": round(self.median, 6), "min": round(self.min, 6), "max": round(self.max, 6),
                "n": self.n}


# -- clocks ---------------------------------------------------------------------------------
def _device_of(pipe) -> str:
    dev = getattr(pipe, "device", None)
    if dev is None:
        tr = getattr(pipe, "transformer", None)
        params = tr.parameters() if tr is not None and hasattr(tr, "parameters") else iter(())
        p = next(params, None)
        dev = p.device if p is not None else "cpu"
    return str(dev)


class Clock:
    """Marks on CUDA events (resolved after one synchronize) or on ``time.perf_counter``."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start


# -- memory ---------------------------------------------------------------------------------
def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # /proc fallback on Linux
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory over a block: CUDA max allocated, or the process RSS sampled every 5 ms.

    Written by hand: torch has no resettable peak-RSS counter on the CPU, and ``ru_maxrss`` only
    grows over the process lifetime."""

    def __init__(self, cuda: bool, interval: float = 0.005):
        self.cuda = cuda
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    @property
    def kind(self) -> str:
        return "cuda_max_allocated" if self.cuda else "rss_peak"

    def __enter__(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.peak = int(torch.cuda.max_memory_allocated())
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())
        return False


# -- per-part instrumentation ---------------------------------------------------------------
class PartRecorder:
    """Per-instance wrappers on a pipeline's parts; ``remove()`` restores the instance exactly.

    Each pipeline call's intervals are collected as (part, start_mark, end_mark) and resolved by
    :meth:`end_call` after the clock synchronizes."""

    def __init__(self, pipe, clock: Clock):
        self.pipe = pipe
        self.clock = clock
        self.active = False
        self._pending: list[tuple[str, Any, Any]] = []
        self._open_transformer: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self.calls: list[dict[str, list[float]]] = []
        self._install()

    def _wrap_attr(self, owner, attr: str, part: str) -> None:
        if owner is None or not hasattr(owner, attr):
            return
        had_own = attr in vars(owner)
        original = getattr(owner, attr)
        recorder = self

        def wrapper(*args, **kwargs):
            if not recorder.active:
                return original(*args, **kwargs)
            start = recorder.clock.mark()
            out = original(*args, **kwargs)
            recorder._pending.append((part, start, recorder.clock.mark()))
            return out

        wrapper.__wrapped__ = original
        setattr(owner, attr, wrapper)

        def undo():
            if had_own:
                setattr(owner, attr, original)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, attr)

        self._undo.append(undo)

    def _install(self) -> None:
        self._wrap_attr(self.pipe, "encode_prompt", "text_encoding")
        self._wrap_attr(getattr(self.pipe, "vae", None), "decode", "vae_decode")
        tr = getattr(self.pipe, "transformer", None)
        if tr is not None and hasattr(tr, "register_forward_pre_hook"):
            def pre(module, args):
                if self.active:
                    self._open_transformer.append(self.clock.mark())

            def post(module, args, output):
                if self.active and self._open_transformer:
                    self._pending.append(("transformer_step", self._open_transformer.pop(), self.clock.mark()))

            h1 = tr.register_forward_pre_hook(pre)
            h2 = tr.register_forward_hook(post)
            self._undo += [h1.remove, h2.remove]

    def begin_call(self) -> None:
        self._pending.clear()
        self._open_transformer.clear()
        self.active = True

    def end_call(self) -> dict[str, list[float]]:
        """Synchronize, resolve this call's intervals to seconds per part, and keep them."""
        self.active = False
        self.clock.sync()
        parts: dict[str, list[float]] = {p: [] for p in PARTS}
        steps = [(s, e) for p, s, e in self._pending if p == "transformer_step"]
        for part, s, e in self._pending:
            parts[part].append(self.clock.seconds(s, e))
        if steps:
            parts["denoising"].append(self.clock.seconds(steps[0][0], steps[-1][1]))
        self.calls.append(parts)
        return parts

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


# -- one configuration ----------------------------------------------------------------------
@dataclass
class Timing:
    """What one configuration took: end to end and per part, over the repeats."""

    end_to_end: Stat
    parts: dict[str, Stat | None]
    transformer_calls: float
    peak_memory_bytes: int
    memory_kind: str
    device: str

    def to_dict(self) -> dict:
        return {
            "end_to_end": self.end_to_end.to_dict(),
            "parts": {k: (v.to_dict() if v else None) for k, v in self.parts.items()},
            "transformer_calls": self.transformer_calls,
            "peak_memory_mb": round(self.peak_memory_bytes / 2**20, 2),
            "memory_kind": self.memory_kind,
            "device": self.device,
        }


def time_pipeline(pipe, call: Callable[[], Any], *, warmup: int = 1, repeats: int = 3,
                  on_repeat: Callable[[int, float], None] | None = None) -> Timing:
    """Warm up, then time ``call()`` (one full pipeline call) ``repeats`` times, per part too."""
    import torch

    device = _device_of(pipe)
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    clock = Clock(cuda)
    with torch.inference_mode():
        for _ in range(max(0, warmup)):
            call()
        clock.sync()
        e2e: list[float] = []
        with PartRecorder(pipe, clock) as rec, PeakMemory(cuda) as mem:
            for i in range(max(1, repeats)):
                clock.sync()
                rec.begin_call()
                start = clock.mark()
                call()
                end = clock.mark()
                rec.end_call()
                e2e.append(clock.seconds(start, end))
                if on_repeat is not None:
                    on_repeat(i, e2e[-1])
    per_part: dict[str, list[float]] = {p: [] for p in PARTS}
    for c in rec.calls:
        for p in PARTS:
            if p == "transformer_step":
                per_part[p] += c[p]
            else:
                # a part called several times in one pipeline call counts as its sum
                if c[p]:
                    per_part[p].append(sum(c[p]))
    calls = statistics.median(len(c["transformer_step"]) for c in rec.calls) if rec.calls else 0
    return Timing(Stat.of(e2e), {p: Stat.of(v) for p, v in per_part.items()}, float(calls),
                  mem.peak, mem.kind, device)


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
    """Capture the inputs of the first transformer call of ``call()``, then count the FLOPs of
    re-running the transformer on them under ``FlopCounterMode``."""
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

    @property
    def gate_family(self) -> str:
        return self.family.split("/")[0]

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

    def all(self) -> list[ConfigResult]:
        return [self.baseline, *self.configs]

    def to_dict(self) -> dict:
        return {
            "device": self.device, "warmup": self.warmup, "repeats": self.repeats,
            "flops": self.flops.to_dict() if self.flops else None,
            "baseline_drift": None if self.baseline_drift is None else round(self.baseline_drift, 4),
            "noise_floor": self.noise_floor,
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
            })
        return rows


def _ratio(base: Stat | None, other: Stat | None) -> float | None:
    if base is None or other is None or other.median <= 0:
        return None
    return base.median / other.median


def benchmark(pipe, configs: list[Config], render: Callable[[str, int], np.ndarray],
              cases: list[tuple[str, str, int]], *, warmup: int = 1, repeats: int = 3,
              peak_tflops: float | None = None, steps: int | None = None, count_flops: bool = True,
              gates_for: Callable[[Config], Any] | None = None,
              progress: Callable[[Iterable], Iterable] | None = None,
              log: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Measure the baseline, then each configuration, then the baseline again, in this process.

    ``render(prompt, seed) -> image`` runs the pipeline once; ``cases`` are (key, prompt, seed).
    Timing repeats use the first case; quality uses every case against the baseline images
    rendered here. A configuration that raises is recorded with its error, undone, and skipped.
    """
    from .metrics import Gates, compare_sets

    if not cases:
        raise ValueError("benchmark needs at least one (key, prompt, seed) case")
    per_config_log = progress is None  # a progress wrapper reports each configuration itself
    progress = progress or (lambda it: it)
    log = log or (lambda msg: None)
    gates_for = gates_for or (lambda cfg: Gates.from_dict(cfg.gates))
    _, p0, s0 = cases[0]
    call = lambda: render(p0, s0)  # noqa: E731
    device = _device_of(pipe)
    if peak_tflops is None:
        peak_tflops = default_peak_tflops(device)

    def render_cases() -> dict[str, np.ndarray]:
        return {key: render(prompt, seed) for key, prompt, seed in cases}

    def measure(cfg: Config) -> ConfigResult:
        res = ConfigResult(cfg.name, cfg.family, dict(cfg.params), notes=cfg.notes)
        undo = None
        try:
            undo = cfg.apply(pipe)
            res.images = render_cases()  # also warms up this configuration
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

    base_cfg = baseline_config()
    log(f"benchmark: baseline on {device} (warmup {warmup}, repeats {repeats})")
    baseline = measure(base_cfg)
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
    again = render_cases()
    noise = compare_sets(again, baseline.images, Gates()).to_dict()
    noise = {k: noise[k] for k in ("psnr_min", "ssim_min", "max_abs")}
    baseline.quality = compare_sets(baseline.images, baseline.images, Gates()).to_dict()

    results = []
    for cfg in progress(configs):
        if per_config_log:
            log(f"benchmark: {cfg.name} ({cfg.family})")
        res = measure(cfg)
        if res.timing is not None:
            bt, ct = baseline.timing, res.timing
            res.speedup = _ratio(bt.end_to_end, ct.end_to_end)
            res.part_speedups = {p: _ratio(bt.parts.get(p), ct.parts.get(p)) for p in PARTS}
            res.memory_ratio = ct.peak_memory_bytes / bt.peak_memory_bytes if bt.peak_memory_bytes else None
            res.efficiency = efficiency(flops, ct, peak_tflops)
        if res.images:
            res.quality = compare_sets(res.images, baseline.images, gates_for(cfg)).to_dict()
        results.append(res)

    drift = None
    if configs:
        end = time_pipeline(pipe, call, warmup=0, repeats=repeats)
        drift = end.end_to_end.median / baseline.timing.end_to_end.median
    return BenchmarkReport(device, warmup, repeats, baseline, results, flops, drift, noise)


__all__ = [
    "Config", "baseline_config", "Stat", "Clock", "PeakMemory", "PartRecorder", "Timing", "time_pipeline",
    "FlopEstimate", "count_transformer_flops", "default_peak_tflops", "Efficiency", "efficiency",
    "ConfigResult", "BenchmarkReport", "benchmark", "PARTS", "H200_DENSE_BF16_TFLOPS", "asdict",
]
