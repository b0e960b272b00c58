"""diffusers Pyramid Attention Broadcast: inside a timestep window, attention outputs are
reused for ``skip_range`` - 1 steps out of ``skip_range``."""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Strategy, register
from ._diffusers_hooks import finish_install, has_diffusers_attention, needs_top_level, timestep_callback


@dataclass
class PABSettings:
    skip_range: int = 2
    window_low: int = 100
    window_high: int = 800


@register
class DiffusersPAB(Strategy):
    name = "diffusers_pab"
    family = "diffusers PAB"
    Config = PABSettings

    @classmethod
    def applicable(cls, adapter):
        return has_diffusers_attention(adapter) or needs_top_level(adapter)

    @classmethod
    def apply(cls, pipe, adapter, config, steps=None):
        from diffusers.hooks import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast
        from diffusers.hooks import pyramid_attention_broadcast as pab

        adapter.patch()
        current, handle = timestep_callback(pipe, pipe.transformer)
        names = tuple(p.path for p in adapter.info.block_lists)
        cfg = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=config.skip_range,
            spatial_attention_timestep_skip_range=(config.window_low, config.window_high),
            spatial_attention_block_identifiers=names,
            current_timestep_callback=current)
        apply_pyramid_attention_broadcast(pipe.transformer, cfg)
        return finish_install(pipe, adapter, (pab._PYRAMID_ATTENTION_BROADCAST_HOOK,), handle)

    @classmethod
    def grid(cls, adapter, steps):
        return [PABSettings(skip_range=k, window_low=lo, window_high=hi)
                for k in (2, 3) for lo, hi in ((100, 800), (50, 950))]

    @classmethod
    def disabled(cls, adapter, steps):
        return PABSettings(skip_range=1, window_low=0, window_high=0)
