"""diffusers TaylorSeer cache: attention outputs are computed every ``cache_interval`` steps
after ``disable_cache_before_step`` and predicted by a Taylor series in between."""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .technique import CacheTechnique
from ._diffusers_hooks import finish_install, attention_lists, has_diffusers_attention


@dataclass
class TaylorSeerSettings:
    cache_interval: int = 2
    disable_cache_before_step: int = 2
    max_order: int = 1


@register
class DiffusersTaylorSeer(CacheTechnique):
    name = "diffusers_taylorseer"
    family = "diffusers TaylorSeer"
    Settings = TaylorSeerSettings

    @classmethod
    def applicable(cls, adapter):
        return has_diffusers_attention(adapter)

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        import torch
        from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache
        from diffusers.hooks import taylorseer_cache as tc

        adapter.patch()
        cfg = TaylorSeerCacheConfig(cache_interval=config.cache_interval,
                                    disable_cache_before_step=config.disable_cache_before_step,
                                    max_order=config.max_order, taylor_factors_dtype=torch.float32,
                                    cache_identifiers=attention_lists(adapter))
        apply_taylorseer_cache(pipe.transformer, cfg)
        return finish_install(pipe, adapter, (tc._TAYLORSEER_CACHE_HOOK,))

    @classmethod
    def grid(cls, adapter, steps):
        return [TaylorSeerSettings(cache_interval=k, disable_cache_before_step=w, max_order=o)
                for k in (2, 3) for w in (max(1, steps // 4),) for o in (2, 1)]

    @classmethod
    def disabled(cls, adapter, steps):
        return TaylorSeerSettings(cache_interval=1, disable_cache_before_step=steps + 1)
