"""diffusers FasterCache: attention outputs reused across steps (spatial skip range) with a
weighted extrapolation, inside a timestep window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hooks import swap_attribute
from . import register
from .technique import CacheTechnique
from ._diffusers_hooks import finish_install, attention_lists, has_diffusers_attention, timestep_callback


@dataclass
class FasterCacheSettings:
    skip_range: int = 2
    window_low: int = -1
    window_high: int = 681


def tensor_layout(rank: int) -> str:
    """FasterCache's layout of the transformer's output by the rank of its latents: a 5-d video
    latent is batch x frames x channels x height x width, anything else batch x channels x height x width."""
    return "BFCHW" if rank == 5 else "BCHW"


class LayoutByRank:
    """A forward pre-hook giving FasterCache's denoiser hook the layout of the first call's latents
    (``tensor_layout``) before it reads it; ``remove()`` takes the pre-hook off and the layout back."""

    def __init__(self, transformer, denoiser):
        self.denoiser, self.swap = denoiser, None
        self.handle = transformer.register_forward_pre_hook(self._pick, with_kwargs=True)

    def _pick(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if self.swap is None and torch.is_tensor(x):
            self.swap = swap_attribute(self.denoiser, "tensor_format", tensor_layout(x.dim()))

    def remove(self) -> None:
        self.handle.remove()
        if self.swap is not None:
            self.swap.remove()


@register
class DiffusersFasterCache(CacheTechnique):
    name = "diffusers_fastercache"
    family = "diffusers FasterCache"
    Settings = FasterCacheSettings

    @classmethod
    def applicable(cls, adapter):
        return has_diffusers_attention(adapter)

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
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
            tensor_format="BCHW")  # replaced by the first call's latent rank (LayoutByRank)
        apply_faster_cache(pipe.transformer, cfg)
        denoiser = pipe.transformer._diffusers_hook.get_hook(fc._FASTER_CACHE_DENOISER_HOOK)
        layout = LayoutByRank(pipe.transformer, denoiser)
        return finish_install(pipe, adapter, (fc._FASTER_CACHE_DENOISER_HOOK, fc._FASTER_CACHE_BLOCK_HOOK), handle,
                              layout)

    @classmethod
    def grid(cls, adapter, steps):
        return [FasterCacheSettings(skip_range=k, window_high=hi) for k in (2, 3) for hi in (681, 901)]

    @classmethod
    def disabled(cls, adapter, steps):
        return FasterCacheSettings(skip_range=1, window_low=0, window_high=0)
