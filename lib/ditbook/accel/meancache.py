"""MeanCache (Gao et al., ICLR 2026): on a skipped step, use the *average* velocity over the step's
interval instead of the instantaneous velocity of the last computed step.

The velocity's rate of change ``d`` is the finite difference of the last two computed outputs, so
the forecast for a call at timestep ``s`` with spacing ``h`` is ``v_t + d * ((s - t) + h / 2)``,
skipped while its predicted drift stays under the ``_forecast`` budget (``threshold = 0``: never).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._forecast import apply_forecaster, rel_l1
from . import register
from .technique import CacheTechnique


@dataclass
class MeanCacheSettings:
    threshold: float = 1.0  # allowed predicted drift, in medians of the measured step-to-step change
    warmup_steps: int = 2  # first calls (per CFG slot) always computed
    max_consecutive: int = 2  # never forecast more than this many calls in a row


def mean_velocity(slot, s: float, prev_s: float | None):
    """(forecast, error estimate) for a call at ``s``; None before two computed calls."""
    if len(slot.outputs) < 2 or prev_s is None:
        return None
    (t_r, t_t), (v_r, v_t) = slot.times[-2:], slot.outputs[-2:]
    span = t_t - t_r
    if span == 0:
        return None
    d = (v_t - v_r) / span
    h = s - prev_s  # this step's spacing, taken as the previous one's (timesteps descend)
    offset = (s - t_t) + h / 2.0
    forecast = v_t + d * offset
    # predicted change away from v_t, in the units the calibration measures (relative L1)
    err = abs(offset / span) * rel_l1(v_t, v_r)
    return forecast, err


@register
class MeanCache(CacheTechnique):
    name = "meancache"
    family = "MeanCache (average velocity, ditbook hooks)"
    Settings = MeanCacheSettings

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        return apply_forecaster(pipe, adapter, config, mean_velocity, "ditbook-meancache")

    @classmethod
    def grid(cls, adapter, steps):
        return [MeanCacheSettings(threshold=t, warmup_steps=2, max_consecutive=k)
                for t, k in ((2.0, 1), (3.0, 2), (1.0, 1), (1.0, 2), (2.0, 2), (3.0, 1), (0.5, 1), (0.5, 2))]

    @classmethod
    def disabled(cls, adapter, steps):
        return MeanCacheSettings(threshold=0.0)
