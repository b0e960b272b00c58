"""Reading a model's config for the probe: the positive integers under keys that name a role."""

from __future__ import annotations


def config_ints(cfg: dict, *words: str, exclude: tuple = ()) -> list[int]:
    """The distinct positive integer values (in the config's order) whose key contains one of
    ``words`` and none of ``exclude`` (lower case)."""
    out = []
    for k, v in cfg.items():
        low = k.lower()
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and any(w in low for w in words) \
                and not any(x in low for x in exclude):
            if v not in out:
                out.append(v)
    return out


def config_int(cfg: dict, *words: str, exclude: tuple = ()) -> int | None:
    """The first of :func:`config_ints`, or None."""
    found = config_ints(cfg, *words, exclude=exclude)
    return found[0] if found else None
