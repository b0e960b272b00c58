"""Acceleration configurations: a name, a family and an ``apply(pipe)`` that switches the
acceleration on for a *loaded* pipeline and returns a callable that switches it off again (or
``None`` when nothing needs undoing)::

    Config(name="dbcache-F1B0-0.12", family="cache",
           apply=lambda pipe: <turn the acceleration on>; return undo)

The benchmark harness (:mod:`ditbook.benchmark.measure`) calls ``apply``, measures, then calls the
returned undo before the next configuration, so one loaded pipeline serves every configuration.
``family`` groups configurations in the plots and the readout (``baseline``, ``cache``,
``parallel``, ``cache+parallel``, or a finer name such as ``cache/dbcache``; the part before ``/``
is the gate family). ``params`` is a free mapping shown in the tables; ``gates`` optionally
overrides the quality gates for this configuration. The cache and parallel stages provide their
configurations as ``Config`` objects (see :mod:`ditbook.benchmark.inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

@dataclass
class Config:
    """A named acceleration: ``apply(pipe)`` turns it on and returns an undo callable (or None)."""

    name: str
    family: str
    apply: Callable[[Any], Callable[[], None] | None]
    params: dict = field(default_factory=dict)
    gates: dict | None = None
    notes: str = ""
    refused: str | None = None  # why it cannot run here (its apply raises with this reason)

    @property
    def gate_family(self) -> str:
        return self.family.split("/")[0]

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "params": dict(self.params), "notes": self.notes}


def baseline_config() -> Config:
    return Config("baseline", "baseline", lambda pipe: None, notes="the pipeline as loaded")


def config_label(config: dict) -> str:
    """A short label of a configuration's scalar settings (lists such as fitted coefficients or
    step masks stay in ``params``, not in the name)."""
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()) if not isinstance(v, (list, tuple, dict)))


def row_name(name: str, config: dict | None) -> str:
    """The benchmark row name of a cache strategy with ``config``: ``name[label]``, or ``name`` when
    the configuration has no scalar setting (one rule for the cache stage's rows, the verdict and
    the report)."""
    label = config_label(config or {})
    return f"{name}[{label}]" if label else str(name)


def fp8_suffix(record: dict) -> str:
    """The row-name suffix of a configuration tuned with some block linears in fp8 (the cache
    stage's fp8 composition): ``+fp8[<quantized>/<candidates>]``."""
    return f"+fp8[{len(record.get('layers') or [])}/{record.get('candidates')}]"


__all__ = ["Config", "baseline_config", "config_label", "fp8_suffix", "row_name"]
