"""diffusers MagCache: skips blocks while the accumulated magnitude-ratio error stays under
``threshold``; its magnitude ratios are calibrated on this model first (``calibrate=True``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hooks import WrapGroup
from . import register
from .technique import CacheTechnique
from ._diffusers_hooks import _registries, install_block_hooks, needs_top_level


@dataclass
class MagCacheSettings:
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: list = field(default_factory=list)  # filled by calibration when empty


def _apply(pipe, adapter, cfg_obj):
    from diffusers.hooks import apply_mag_cache
    from diffusers.hooks import mag_cache as mc

    return install_block_hooks(pipe, adapter, mc, (mc._MAG_CACHE_LEADER_BLOCK_HOOK, mc._MAG_CACHE_BLOCK_HOOK),
                               lambda: apply_mag_cache(pipe.transformer, cfg_obj))


@register
class DiffusersMagCache(CacheTechnique):
    name = "diffusers_magcache"
    family = "diffusers MagCache"
    Settings = MagCacheSettings

    @classmethod
    def applicable(cls, adapter):
        if adapter.info.has_separate_cfg:
            return "MagCache expects one transformer call per step"
        return needs_top_level(adapter)

    @classmethod
    def calibrate(cls, pipe, adapter, run, steps) -> dict:
        """One case (``run(1)``) in MagCache's calibration mode: this model's magnitude ratios
        (read per hook instance, before MagCache resets them at the end of the run)."""
        from diffusers.hooks import MagCacheConfig

        ratios: list[float] = []
        undo = _apply(pipe, adapter, MagCacheConfig(num_inference_steps=steps, calibrate=True))
        records = WrapGroup("record-mag-ratios")

        def record(original, state, residual):
            original(state, residual)
            ratios.append(float(state.calibration_ratios[-1]))

        try:
            for _, reg in _registries(pipe.transformer):
                for hook in reg.hooks.values():
                    if hasattr(hook, "_perform_calibration_step"):
                        records.wrap(hook, record, attr="_perform_calibration_step")
            run(1)
        finally:
            try:
                records.remove()
            finally:
                undo()
        return {"mag_ratios": ratios[:steps]}

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        from diffusers.hooks import MagCacheConfig

        ratios = list(config.mag_ratios) or [1.0] * (steps or 2)
        return _apply(pipe, adapter, MagCacheConfig(threshold=config.threshold, max_skip_steps=config.max_skip_steps,
                                                    retention_ratio=config.retention_ratio,
                                                    num_inference_steps=steps, mag_ratios=ratios))

    @classmethod
    def grid(cls, adapter, steps):
        return [MagCacheSettings(threshold=t, max_skip_steps=k) for k in (2, 4) for t in (0.06, 0.12, 0.24)]

    @classmethod
    def disabled(cls, adapter, steps):
        return MagCacheSettings(threshold=0.0, max_skip_steps=0)
