"""cache-dit DBCache with the TaylorSeer calibrator: cached steps extrapolate the residual with
a Taylor series over the computed steps instead of reusing it unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .technique import CacheTechnique
from .dbcache import enable_dbcache, min_list_length


@dataclass
class DBCacheTaylorSeerSettings:
    Fn: int = 1
    Bn: int = 0
    threshold: float = 0.12
    max_warmup_steps: int = 2
    taylorseer_order: int = 1


@register
class DBCacheTaylorSeer(CacheTechnique):
    name = "dbcache_taylorseer"
    family = "cache-dit DBCache+TaylorSeer"
    Settings = DBCacheTaylorSeerSettings

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        import cache_dit

        kwargs = dict(Fn_compute_blocks=config.Fn, Bn_compute_blocks=config.Bn,
                      residual_diff_threshold=config.threshold, max_warmup_steps=config.max_warmup_steps,
                      num_inference_steps=steps)
        return enable_dbcache(pipe, adapter, kwargs,
                              cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=config.taylorseer_order))

    @classmethod
    def grid(cls, adapter, steps):
        n = min_list_length(adapter)
        fns = sorted({f for f in (1, 2, 4) if f < n} or {1})
        # second-order extrapolation tolerates larger thresholds
        return [DBCacheTaylorSeerSettings(Fn=f, threshold=t, taylorseer_order=o, max_warmup_steps=2)
                for o in (2, 1) for f in fns[:1] for t in (0.24, 0.32, 0.16, 0.48)]

    @classmethod
    def disabled(cls, adapter, steps):
        return DBCacheTaylorSeerSettings(Fn=1, threshold=0.0, max_warmup_steps=steps)
