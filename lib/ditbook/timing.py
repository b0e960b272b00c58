"""Timing one pipeline configuration: end-to-end and per-part times, peak memory.

Parts measured per pipeline call (wrappers installed per instance at run time through
``ditbook.hooks``, never on classes, undone exactly):

- ``text_encoding``: ``pipe.encode_prompt`` (a wrap on the instance);
- ``transformer_step``: each call of ``pipe.transformer`` (forward pre/post hooks);
- ``denoising``: from the first transformer call's start to the last one's end in a pipeline call
  (includes the scheduler steps between them);
- ``vae_decode``: ``pipe.vae.decode`` (a wrap on the instance).

On CUDA every boundary is a CUDA event, read after one synchronize at the end of the call; on
the CPU it is ``time.perf_counter``. Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and
the sampled peak RSS of the process on the CPU.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .hooks import wrap_method

PARTS = ("text_encoding", "denoising", "transformer_step", "vae_decode")

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
def device_of(pipe) -> str:
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

    WRAP = "ditbook.part-timing"

    def _wrap_attr(self, owner, attr: str, part: str) -> None:
        if owner is None or not hasattr(owner, attr):
            return
        recorder = self

        def timed(original, *args, **kwargs):
            if not recorder.active:
                return original(*args, **kwargs)
            start = recorder.clock.mark()
            out = original(*args, **kwargs)
            recorder._pending.append((part, start, recorder.clock.mark()))
            return out

        self._undo.append(wrap_method(owner, self.WRAP, timed, attr=attr).remove)

    def _install(self) -> None:
        try:  # all or nothing: a failure half-way leaves the pipeline as it was
            self._install_parts()
        except BaseException:
            self.remove()
            raise

    def _install_parts(self) -> None:
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

    device = device_of(pipe)
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


__all__ = ["PARTS", "Stat", "Clock", "device_of", "PeakMemory", "PartRecorder", "Timing", "time_pipeline"]
