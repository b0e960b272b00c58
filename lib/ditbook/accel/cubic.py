"""Cubic: forecast a skipped step's transformer output with a cubic through the outputs of the
last four computed steps (Lagrange interpolation in the timestep, evaluated beyond the last one).

The error estimate is the difference between the cubic and the quadratic through the last three
points, accumulated under the ``_forecast`` budget (``threshold = 0`` computes every step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._forecast import apply_forecaster, rel_l1
from . import register
from .technique import CacheTechnique


@dataclass
class CubicSettings:
    threshold: float = 2.0  # allowed cubic-vs-quadratic disagreement, in medians of the step-to-step change
    warmup_steps: int = 4  # first calls (per CFG slot) always computed; a cubic needs four points
    max_consecutive: int = 2  # never forecast more than this many calls in a row


def lagrange(times, values, s: float):
    """The polynomial through (times[i], values[i]) evaluated at ``s``."""
    out = None
    for i, (ti, vi) in enumerate(zip(times, values)):
        w = 1.0
        for j, tj in enumerate(times):
            if j != i:
                w *= (s - tj) / (ti - tj)
        out = vi * w if out is None else out + vi * w
    return out


def cubic_forecast(slot, s: float, prev_s=None):
    if len(slot.outputs) < 4 or len(set(slot.times[-4:])) < 4:
        return None
    times, values = slot.times[-4:], slot.outputs[-4:]
    cubic = lagrange(times, values, s)
    quad = lagrange(times[-3:], values[-3:], s)
    return cubic, rel_l1(cubic, quad)


@register
class Cubic(CacheTechnique):
    name = "cubic"
    family = "Cubic extrapolation (ditbook hooks)"
    Settings = CubicSettings

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        return apply_forecaster(pipe, adapter, config, cubic_forecast, "ditbook-cubic")

    @classmethod
    def grid(cls, adapter, steps):
        # the cubic-vs-quadratic disagreement is 1.2-1.7x the median step change (REFERENCE.md)
        return [CubicSettings(threshold=t, warmup_steps=4, max_consecutive=k)
                for t, k in ((2.0, 1), (3.0, 2), (1.5, 1), (2.0, 2), (3.0, 1), (4.0, 2), (1.0, 1), (0.5, 1))]

    @classmethod
    def disabled(cls, adapter, steps):
        return CubicSettings(threshold=0.0)
