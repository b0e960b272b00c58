"""Cache on top of context parallelism, with the skip decision agreed across ranks.

Each rank of a CP group holds a different slice of the sequence, so a residual difference
measured locally differs between ranks; if one rank skipped the remaining blocks while another
ran them, the next collective would pair mismatched calls — a hang or corrupted output.
cache-dit averages the difference over the world before deciding; ditbook adds an explicit
agreement on the decision itself: a per-instance wrapper around the context manager's
``can_cache`` all-reduces the boolean (MIN: skip only when every rank may skip) and counts the
times a rank's local answer differed from the agreed one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_DBCACHE = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "residual_diff_threshold": 0.12,
                   "max_warmup_steps": 2, "max_cached_steps": -1}


@dataclass
class CacheAgreement:
    decisions: int = 0
    skips: int = 0
    disagreements: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def dbcache_config(options: dict | None = None):
    from cache_dit import DBCacheConfig

    return DBCacheConfig(**{**DEFAULT_DBCACHE, **(options or {})})


def agree_cache_decisions(pipe, group=None) -> CacheAgreement:
    """Wrap cache-dit's decision on this pipeline so every rank of ``group`` takes the same one."""
    cm = getattr(pipe, "_context_manager", None) or getattr(pipe.transformer, "_context_manager", None)
    if cm is None:
        raise RuntimeError("no cache-dit context manager on this pipeline: enable the cache first")
    stats = CacheAgreement()
    orig = cm.can_cache

    @functools.wraps(orig)
    def can_cache(*args, **kwargs):
        local = bool(orig(*args, **kwargs))
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dev = args[0].device if args and isinstance(args[0], torch.Tensor) else torch.device("cpu")
            if dev.type == "cuda":
                flag = flag.to(dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        agreed = bool(int(flag.item()))
        stats.decisions += 1
        stats.skips += int(agreed)
        stats.disagreements += int(agreed != local)
        return agreed

    cm.can_cache = can_cache  # instance attribute: this pipeline's context manager only
    return stats


def cache_summary(pipe) -> dict:
    """Cached steps per cache context, from cache-dit's stats."""
    try:
        import cache_dit

        stats = cache_dit.summary(pipe) or []
        return {"cached_steps": [list(getattr(s, "cached_steps", [])) for s in stats]}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
