"""diffusers FirstBlockCache: block 0 always runs; when its residual changed less than
``threshold`` the other blocks return the cached residual (``diffusers.hooks``)."""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .technique import CacheTechnique
from ._diffusers_hooks import head_and_tail_differ, install_block_hooks, needs_top_level


@dataclass
class FirstBlockCacheSettings:
    threshold: float = 0.05


@register
class DiffusersFirstBlockCache(CacheTechnique):
    name = "diffusers_fbc"
    family = "diffusers FirstBlockCache"
    Settings = FirstBlockCacheSettings

    @classmethod
    def applicable(cls, adapter):
        if sum(p.length for p in adapter.info.block_lists) < 2:
            return "needs at least two blocks"
        return needs_top_level(adapter) or head_and_tail_differ(adapter)

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
        from diffusers.hooks import first_block_cache as fbc

        return install_block_hooks(
            pipe, adapter, fbc, (fbc._FBC_LEADER_BLOCK_HOOK, fbc._FBC_BLOCK_HOOK),
            lambda: apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=config.threshold)))

    @classmethod
    def grid(cls, adapter, steps):
        return [FirstBlockCacheSettings(t) for t in (0.1, 0.15, 0.2, 0.3, 0.05)]

    @classmethod
    def disabled(cls, adapter, steps):
        return FirstBlockCacheSettings(threshold=0.0)
