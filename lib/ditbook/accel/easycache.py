"""EasyCache-style runtime-adaptive step cache: no calibration, nothing fitted, decided per call.

After Zhou et al., "Less is Enough: Training-Free Video Diffusion Acceleration via Runtime-Adaptive
Cache" (2025). A flow model's transformer maps its input ``x_t`` to an output ``v_t``; the
*transformation rate* ``k = |v_t - v_s| / |x_t - x_s|`` between two computed steps stays nearly
constant after the first few steps. After a computed step the cache keeps ``d = v - x`` and ``k``;
each later call adds the output change ``k |x_t - x_{t-1}| / |v|`` the input change predicts, and
while that accumulated estimate stays below ``threshold`` the call returns ``x_t + d`` without
running a block; past it the call is computed and the estimate starts again.
The first ``warmup_steps`` calls always compute. It applies to any transformer whose output has its
input's shape (a call whose shapes differ is always computed).

One wrapper on ``pipe.transformer.forward`` (``ditbook.hooks``, undone exactly); with CFG as two
calls per step each branch keeps its own state; a new generation (the timestep going up again)
starts from a clean state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .technique import CacheTechnique


@dataclass
class EasyCacheSettings:
    threshold: float = 0.1  # the accumulated predicted relative output change that forces a computed call
    warmup_steps: int = 2  # calls computed first, per CFG branch


def _mean_abs(t: torch.Tensor) -> float:
    return float(t.detach().float().abs().mean())


def _first_tensor(out):
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):
        return next(v for v in out.values() if torch.is_tensor(v))
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.sample


def _with_tensor(out, t: torch.Tensor):
    """``out`` (the last computed call's output) with its first tensor replaced by ``t``."""
    if torch.is_tensor(out):
        return t
    if isinstance(out, (tuple, list)):
        return type(out)((t, *out[1:]))
    if isinstance(out, dict) and not hasattr(out, "sample"):
        key = next(k for k, v in out.items() if torch.is_tensor(v))
        return {**out, key: t}
    return type(out)(sample=t)


class _Branch:
    """One CFG branch's running estimate."""

    def __init__(self):
        self.calls, self.acc = 0, 0.0
        self.x_prev = self.x_done = self.v_done = self.out = None
        self.rate: float | None = None


class RuntimeCache:
    """The wrapper's state: per-branch estimates, and what it did (``skipped``/``computed`` calls)."""

    def __init__(self, settings: EasyCacheSettings, branches: int):
        self.settings, self.n = settings, max(1, branches)
        self.reset()
        self.skipped = self.computed = 0

    def reset(self) -> None:
        self.branches = [_Branch() for _ in range(self.n)]
        self.call, self.last_t = -1, None

    def _timestep(self, args, kwargs) -> float | None:
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        return float(t.flatten()[0]) if torch.is_tensor(t) else None

    def __call__(self, original, *args, **kwargs):
        t = self._timestep(args, kwargs)
        if t is not None and self.last_t is not None and t > self.last_t + 1e-9:
            self.reset()  # a new generation
        self.last_t = t if t is not None else self.last_t
        self.call += 1
        b = self.branches[self.call % self.n]
        x = kwargs.get("hidden_states", args[0] if args else None)
        if not torch.is_tensor(x):
            return original(*args, **kwargs)
        if self._may_skip(b, x):
            self.skipped += 1
            b.x_prev, b.calls = x, b.calls + 1
            return _with_tensor(b.out, x + (b.v_done - b.x_done).to(x.dtype))
        out = original(*args, **kwargs)
        v = _first_tensor(out)
        self.computed += 1
        if torch.is_tensor(v) and v.shape == x.shape:
            if b.x_done is not None:
                dx = _mean_abs(x - b.x_done)
                b.rate = _mean_abs(v - b.v_done) / dx if dx > 0 else None
            b.x_done, b.v_done, b.out = x.detach(), v.detach(), out
        b.x_prev, b.calls, b.acc = x, b.calls + 1, 0.0
        return out

    def _may_skip(self, b: _Branch, x: torch.Tensor) -> bool:
        s = self.settings
        if b.calls < s.warmup_steps or b.rate is None or b.out is None or b.x_prev is None or x.shape != b.x_done.shape:
            return False
        b.acc += b.rate * _mean_abs(x - b.x_prev) / max(_mean_abs(b.v_done), 1e-12)
        return b.acc < s.threshold


@register
class EasyCache(CacheTechnique):
    name = "easycache"
    family = "runtime-adaptive step cache (EasyCache)"
    Settings = EasyCacheSettings

    @classmethod
    def enable(cls, pipe, adapter, settings, steps=None):
        from ..hooks import wrap_method

        state = RuntimeCache(settings, 2 if adapter.info.has_separate_cfg else 1)
        return wrap_method(pipe.transformer, "ditbook.easycache", state).remove

    @classmethod
    def grid(cls, adapter, steps):
        """Most promising first (a ``max_configs`` budget keeps the useful part): on the reference model
        (20 steps, CPU fp32) 0.03 skipped 19 of 40 calls at 38.0 dB worst PSNR, 0.05 23 at 34.4 dB, 0.1
        26 at 30.1 dB; the first fifth of the steps always computes (where the rate is not yet steady)."""
        warm = max(2, steps // 5) if steps >= 6 else 1
        return [EasyCacheSettings(threshold=t, warmup_steps=warm) for t in (0.03, 0.05, 0.02, 0.1)]

    @classmethod
    def disabled(cls, adapter, steps):
        return EasyCacheSettings(threshold=0.0, warmup_steps=0)
