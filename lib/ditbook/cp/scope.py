"""Which attention runs as context-parallel attention: only the attention inside the block lists
whose tokens the plan splits.

cache-dit's ``_enable_context_parallelism`` gives its CP config to every attention processor of
the model, and ``attention.route_attention`` routes every module's own SDPA call; a module that
runs on whole sequences on every rank (a text token refiner before the blocks, an attention pool
over the text) then does a Ulysses all-to-all over sequences that were never split: the ranks
exchange copies of the same tokens and the attention sees each key ``degree`` times (or the
shapes no longer match its mask and it raises). ``limit_cp_to`` confines CP to the split region.
"""

from __future__ import annotations

from ..hooks import swap_attribute


def _inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def limit_cp_to(transformer, lists: list[str] | None, route=None, undo=None) -> list[str]:
    """After CP is enabled: attention processors outside ``lists`` (module-name prefixes) lose the
    CP config cache-dit gave them, and ``route`` (an ``AttentionRoute``) sends only the SDPA calls
    of modules inside ``lists`` through the CP attention. A processor object shared with a module
    inside ``lists`` keeps its config. Returns the attention modules taken out of CP; ``undo`` (a
    ``hooks.WrapGroup``, optional) keeps the handles that give the configs back exactly."""
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
        if id(proc) in inside:
            continue
        if getattr(proc, "_parallel_config", None) is None and getattr(proc, "_cp_config", None) is None:
            continue
        for attr in ("_parallel_config", "_cp_config"):
            if hasattr(proc, attr):
                handle = swap_attribute(proc, attr, None)
                if undo is not None:
                    undo.track(handle)
        taken.append(name)
    return taken
