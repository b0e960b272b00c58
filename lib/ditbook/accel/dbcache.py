"""cache-dit DBCache: the first ``Fn`` blocks always run; when their residual changed less than
``threshold`` since the last computed step, the middle blocks are replaced by their cached
residual and the last ``Bn`` blocks run again."""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .technique import CacheTechnique


@dataclass
class DBCacheSettings:
    Fn: int = 1
    Bn: int = 0
    threshold: float = 0.08
    max_warmup_steps: int = 1
    max_continuous_cached_steps: int = -1


def cfg_from_adapter(cache_config, target):
    """``cache_config`` with ``enable_separate_cfg`` set from ``target``'s own ``has_separate_cfg``
    when ``target`` is a BlockAdapter and the config leaves it unset (else cache-dit matches its
    adapters by pipeline-class-name prefix, wrong for e.g. ``FluxReferencePipeline``)."""
    from cache_dit import BlockAdapter

    if isinstance(target, BlockAdapter) and getattr(cache_config, "enable_separate_cfg", None) is None:
        cache_config.enable_separate_cfg = bool(target.has_separate_cfg)
    return cache_config


def enable_dbcache(pipe, adapter, cache_config_kwargs: dict, calibrator=None):
    """Enable cache-dit on ``pipe`` through ``adapter``; returns the undo callable."""
    import cache_dit

    from ..hooks import snapshot_instance_attrs

    transformer = adapter.owner_module() if hasattr(adapter, "owner_module") else pipe.transformer
    order = list(transformer._modules)
    # disable_cache leaves cache-dit's patch functors on the instances: put them back exactly
    restore_instances = snapshot_instance_attrs(transformer)
    block_adapter = adapter.block_adapter()
    cache_dit.enable_cache(block_adapter, cache_config=cfg_from_adapter(cache_dit.DBCacheConfig(**cache_config_kwargs),
                                                                        block_adapter),
                           calibrator_config=calibrator)

    def undo():
        cache_dit.disable_cache(block_adapter)
        # cache-dit's swap moves block lists to the end of the child order diffusers' hooks rely on
        modules = transformer._modules
        transformer._modules = type(modules)((k, modules[k]) for k in order + [k for k in modules if k not in order])
        adapter.unpatch()
        restore_instances()

    return undo


def default_dbcache() -> dict:
    """DBCache's defaults as cache-dit keywords: the cache strategy's (``DBCacheSettings``), written once."""
    kwargs = DBCache.cache_kwargs(DBCacheSettings())
    kwargs.pop("num_inference_steps")
    return kwargs


def dbcache_config(options: dict | None = None):
    """cache-dit's ``DBCacheConfig`` of ``options`` (cache-dit keywords: the card's ``parallel.cache``)
    over DBCache's defaults."""
    from cache_dit import DBCacheConfig

    return DBCacheConfig(**{**default_dbcache(), **(options or {})})


def min_list_length(adapter) -> int:
    return min(p.length for p in adapter.info.block_lists)


@register
class DBCache(CacheTechnique):
    name = "dbcache"
    family = "cache-dit DBCache"
    Settings = DBCacheSettings

    @classmethod
    def cache_kwargs(cls, c, steps=None) -> dict:
        return dict(Fn_compute_blocks=c.Fn, Bn_compute_blocks=c.Bn, residual_diff_threshold=c.threshold,
                    max_warmup_steps=c.max_warmup_steps, max_continuous_cached_steps=c.max_continuous_cached_steps,
                    num_inference_steps=steps)

    @classmethod
    def applicable(cls, adapter):
        if not adapter.info.block_lists:
            return "no block lists"
        return None

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        return enable_dbcache(pipe, adapter, cls.cache_kwargs(config, steps))

    @classmethod
    def grid(cls, adapter, steps):
        n = min_list_length(adapter)
        fns = sorted({f for f in (1, 2, 4, 8) if f < n} or {min(1, n)})
        return [DBCacheSettings(Fn=f, Bn=0, threshold=t, max_warmup_steps=1)
                for f in fns[:2] for t in (0.12, 0.16, 0.24, 0.08, 0.32)]

    @classmethod
    def disabled(cls, adapter, steps):
        return DBCacheSettings(Fn=1, Bn=0, threshold=0.0, max_warmup_steps=steps)
