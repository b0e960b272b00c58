"""diffusers FasterCache: attention outputs reused across steps (spatial skip range) with a
weighted extrapolation, inside a timestep window."""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Strategy, register
from ._diffusers_hooks import finish_install, attention_lists, has_diffusers_attention, timestep_callback


@dataclass
class FasterCacheSettings:
    skip_range: int = 2
    window_low: int = -1
    window_high: int = 681


@register
class DiffusersFasterCache(Strategy):
    name = "diffusers_fastercache"
    family = "diffusers FasterCache"
    Config = FasterCacheSettings

    @classmethod
    def applicable(cls, adapter):
        return has_diffusers_attention(adapter)

    @classmethod
    def apply(cls, pipe, adapter, config, steps=None):
        from diffusers.hooks import FasterCacheConfig, apply_faster_cache
        from diffusers.hooks import faster_cache as fc

        adapter.patch()
        current, handle = timestep_callback(pipe, pipe.transformer)
        cfg = FasterCacheConfig(
            spatial_attention_block_skip_range=config.skip_range,
            spatial_attention_timestep_skip_range=(config.window_low, config.window_high),
            spatial_attention_block_identifiers=tuple(attention_lists(adapter)),
            current_timestep_callback=current,
            is_guidance_distilled=adapter.report.cfg.style != "batched",
            attention_weight_callback=lambda _: 0.5,
            tensor_format="BFCHW" if "Video" in type(pipe).__name__ else "BCHW")
        apply_faster_cache(pipe.transformer, cfg)
        return finish_install(pipe, adapter, (fc._FASTER_CACHE_DENOISER_HOOK, fc._FASTER_CACHE_BLOCK_HOOK), handle)

    @classmethod
    def grid(cls, adapter, steps):
        return [FasterCacheSettings(skip_range=k, window_high=hi) for k in (2, 3) for hi in (681, 901)]

    @classmethod
    def disabled(cls, adapter, steps):
        return FasterCacheSettings(skip_range=1, window_low=0, window_high=0)
