"""Cache strategies, one file each, registered by name.

Every strategy is a class with a config dataclass (``Config``), a ``family``, and
``apply(pipe, adapter, config) -> undo`` (a callable that removes it again); ``grid(adapter,
steps)`` lists the configs the tuner tries, ``disabled(adapter, steps)`` a config whose threshold
turns caching off (used to check that the adapter alone reproduces the baseline), and
``applicable(adapter)`` says why a strategy cannot run on a model (``None`` when it can). There
are no model-name lists: applicability follows from the adapter's facts.
"""

from __future__ import annotations

from .registry import REGISTRY, Strategy, register  # noqa: F401


def get(name: str) -> type[Strategy]:
    _load()
    if name not in REGISTRY:
        raise KeyError(f"unknown cache strategy {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def names() -> list[str]:
    _load()
    return list(REGISTRY)


def _load():
    from . import (blockdance, cubic, dbcache, dbcache_taylorseer, diffusers_fastercache, diffusers_fbc,  # noqa: F401
                   diffusers_magcache, diffusers_pab, diffusers_taylorseer, meancache, scm, teacache_fitted)
