"""What diffusers' cache hooks need on any model, shared by the diffusers_* strategies: block classes
registered while a strategy is on, our block-list names known to the hook, the current timestep,
and removal through the hook registry (as diffusers' ``CacheMixin.disable_cache``)."""

from __future__ import annotations

import torch


def timestep_callback(pipe, transformer):
    """A callable returning the current timestep on a 0-1000 scale, read from the
    transformer's own ``timestep`` argument (works for pipelines that keep no attribute)."""
    state = {"t": 1000.0}

    def pre_hook(module, args, kwargs):
        t = kwargs.get("timestep", None)
        if t is None and args and len(args) > 1 and torch.is_tensor(args[1]):
            t = args[1]
        if torch.is_tensor(t):
            v = float(t.flatten()[0])
            state["t"] = v * 1000.0 if v <= 1.0 else v

    handle = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return (lambda: state["t"]), handle


def _registry(module):
    """``module``'s diffusers ``HookRegistry``, or None."""
    from diffusers.hooks import HookRegistry

    reg = getattr(module, "_diffusers_hook", None)
    return reg if isinstance(reg, HookRegistry) else None


def _registries(transformer) -> list:
    """(module, its registry) of the transformer and every submodule that has one."""
    return [(m, reg) for m in transformer.modules() if (reg := _registry(m)) is not None]


def refresh_registry(transformer):
    """diffusers caches the list of child hook registries on the transformer's registry the
    first time a cache context is set; hooks added to blocks later would never get a context.
    Drop that cache after hooks are added or removed."""
    for _, registry in _registries(transformer):
        registry._child_registries_cache = None


def remove_hooks(transformer, *names):
    """Take hooks ``names`` off every registry under the transformer: the block hooks' registries
    hang on the blocks, and the transformer has none of its own until a call sets a context."""
    for _, registry in _registries(transformer):
        for name in names:
            if name in registry.hooks:
                registry.remove_hook(name, recurse=False)
    refresh_registry(transformer)
    # leave no empty registries behind: cache-dit skips its pattern checks on modules that have one
    for module, reg in _registries(transformer):
        if not reg.hooks:
            del module._diffusers_hook


def finish_install(pipe, adapter, hook_names, *handles):
    """After a diffusers ``apply_*`` call: refresh the hook registry, give the hooks a cache context
    when the pipeline sets none; the undo takes off the context, hooks, ``handles``, adapter patch."""
    refresh_registry(pipe.transformer)
    context_undo = ensure_context(pipe.transformer, 2 if adapter.info.has_separate_cfg else 1, pipe=pipe)

    def undo():
        context_undo()
        remove_hooks(pipe.transformer, *hook_names)
        for handle in handles:
            handle.remove()
        adapter.unpatch()

    return undo


def install_block_hooks(pipe, adapter, module, hook_names, apply):
    """The diffusers block-hook strategies (FirstBlockCache, MagCache): patch the adapter, register
    the block classes in diffusers' ``TransformerBlockRegistry``, run ``apply()`` with our block-list
    names known to ``module``; the undo (also on a failure half-way) takes the registry entries out."""
    adapter.patch()
    entries = adapter.register_diffusers_blocks()
    try:
        with adapter.diffusers_identifiers(module):
            apply()
            return finish_install(pipe, adapter, hook_names, *reversed(entries))
    except BaseException:
        remove_hooks(pipe.transformer, *hook_names)
        for entry in reversed(entries):
            entry.remove()
        adapter.unpatch()
        raise


def attention_lists(adapter) -> list[str]:
    """Regex identifiers of our block lists' attention modules (diffusers matches names)."""
    import re

    return [f"^{re.escape(p.path)}.*attn" for p in adapter.info.block_lists]


def has_diffusers_attention(adapter) -> str | None:
    from diffusers.hooks._common import _ATTENTION_CLASSES

    for _, blocks, _ in adapter.block_lists():
        if any(isinstance(m, _ATTENTION_CLASSES) for m in blocks[0].modules()):
            return None
    return "no diffusers Attention modules in the blocks (the attention hooks match only those)"


def needs_top_level(adapter) -> str | None:
    if not adapter.top_level_lists_only():
        return "block lists are not direct children of the transformer (diffusers' block hooks look only there)"
    return None


def hook_order(adapter) -> list[tuple[str, str]]:
    """(path, pattern) of our block lists in the order diffusers' block hooks walk them: the
    order of the transformer's children, not the order of the calls."""
    order = {name: i for i, (name, _) in enumerate(adapter.pipe.transformer.named_children())}
    return sorted(((p.path, p.pattern) for p in adapter.info.block_lists), key=lambda x: order.get(x[0], len(order)))


def head_and_tail_differ(adapter) -> str | None:
    """diffusers' FirstBlockCache subtracts the head block's output (the first block of the first list)
    from the tail block's (the last block of the last list) and adds the difference back to the head's
    output: both must return the same streams. Returns why not, or None."""
    from ..adapter.source import PATTERN_OUTPUT_INDEX

    lists = hook_order(adapter)
    (head, hp), (tail, tp) = lists[0], lists[-1]
    streams = [2 if PATTERN_OUTPUT_INDEX.get(p, (0, None))[1] is not None else 1 for p in (hp, tp)]
    if streams[0] != streams[1]:
        return (f"FirstBlockCache takes the tail block's residual against the head block's output: {head} "
                f"returns {streams[0]} stream(s) ({hp}), {tail} returns {streams[1]} ({tp})")
    return None


def reset_hook_states(transformer) -> None:
    """Every stateful diffusers hook on the transformer and its submodules back to its initial state
    (what diffusers' ``CacheMixin`` pipelines do after a call through ``maybe_free_model_hooks``)."""
    registry = _registry(transformer)
    if registry is not None:
        registry.reset_stateful_hooks(recurse=True)
    else:
        for _, reg in _registries(transformer):
            reg.reset_stateful_hooks(recurse=False)


def ensure_context(transformer, slots: int = 1, pipe=None):
    """A default cache context for each transformer call that has none (pipelines outside diffusers
    set none); with separate CFG (``slots`` = 2) the calls alternate between two contexts so the
    branches' states never mix. With ``pipe``, every pipeline call starts from a clean state
    (``reset_hook_states``, the first slot). Returns an undo callable."""
    from diffusers.hooks.hooks import CacheContext, StateManager, _set_cache_context

    def managers():
        for _, registry in _registries(transformer):
            for hook in registry.hooks.values():
                yield from (a for a in vars(hook).values() if isinstance(a, StateManager))

    state = {"set": False, "calls": 0}

    def pre(module, args, kwargs):
        state["set"] = any(m._context is None for m in managers())
        if state["set"]:
            _set_cache_context(transformer, CacheContext(f"ditbook_{state['calls'] % max(1, slots)}"))
            state["calls"] += 1

    def post(module, args, kwargs, output):
        if state["set"]:
            _set_cache_context(transformer, None)
            state["set"] = False

    handles = [transformer.register_forward_pre_hook(pre, with_kwargs=True),
               transformer.register_forward_hook(post, with_kwargs=True)]
    if pipe is not None:
        from .. import hooks

        def fresh_generation(original, *args, **kwargs):
            reset_hook_states(transformer)
            state["calls"] = 0
            return original(*args, **kwargs)

        handles.append(hooks.wrap_call(pipe, "ditbook.cache-state-per-call", fresh_generation))
    return lambda: [h.remove() for h in reversed(handles)]
