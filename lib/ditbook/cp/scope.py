"""Only the attention inside the split block lists runs as context-parallel attention. cache-dit gives its CP config to
every attention processor, and ``attention.route_attention`` routes every SDPA call; a module running on whole
sequences on every rank (a text refiner) would then all-to-all unsplit tokens. ``limit_cp_to`` confines CP to the
split region."""

from __future__ import annotations

from ..hooks import swap_attribute


def _inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def limit_cp_to(transformer, lists: list[str] | None, route=None, undo=None) -> list[str]:
    """After CP is enabled: attention outside ``lists`` loses its CP config; returns the modules taken out."""
    if not lists:
        return []
    if route is not None:
        route.cp_scope = list(lists)
    inside, outside = set(), []
    for name, module in transformer.named_modules():
        proc = getattr(module, "processor", None)
        if proc is None or not (hasattr(proc, "_parallel_config") or hasattr(proc, "_cp_config")):
            continue
        if _inside(name, lists):
            inside.add(id(proc))
        else:
            outside.append((name, proc))
    taken = []
    for name, proc in outside:
        if id(proc) in inside or all(getattr(proc, a, None) is None for a in ("_parallel_config", "_cp_config")):
            continue
        for attr in ("_parallel_config", "_cp_config"):
            if hasattr(proc, attr):
                handle = swap_attribute(proc, attr, None)
                if undo is not None:
                    undo.track(handle)
        taken.append(name)
    return taken
