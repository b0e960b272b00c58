"""What diffusers' cache hooks need on any model, shared by the diffusers_* strategies:
block classes registered while a strategy is on (``install_block_hooks``), our block-list names known to
the hook while it is applied, the current timestep for hooks that skip by timestep, and removal
through the hook registry (the same calls as diffusers' ``CacheMixin.disable_cache``)."""

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


def refresh_registry(transformer):
    """diffusers caches the list of child hook registries on the transformer's registry the
    first time a cache context is set; hooks added to blocks later would never get a context.
    Drop that cache after hooks are added or removed."""
    from diffusers.hooks import HookRegistry

    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            registry._child_registries_cache = None


def remove_hooks(transformer, *names):
    from diffusers.hooks import HookRegistry

    registry = getattr(transformer, "_diffusers_hook", None)
    if isinstance(registry, HookRegistry):
        for name in names:
            registry.remove_hook(name, recurse=True)
    refresh_registry(transformer)
    # leave no empty registries behind: cache-dit skips its pattern checks on modules that have one
    for module in transformer.modules():
        reg = getattr(module, "_diffusers_hook", None)
        if isinstance(reg, HookRegistry) and not reg.hooks:
            del module._diffusers_hook


def finish_install(pipe, adapter, hook_names, *handles):
    """After a diffusers ``apply_*`` call: refresh the hook registry, give the hooks a cache
    context when the pipeline sets none, and return the undo (context, hooks by name, the
    per-instance ``handles``, then the adapter's patch), the same for every diffusers strategy."""
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
    the block classes in diffusers' ``TransformerBlockRegistry`` (``hooks.set_item`` handles), run
    ``apply()`` with our block-list names known to ``module``, and return the undo that also takes
    the registry entries out, so the registry is exactly as before once the strategy is off. A
    failure half-way undoes what went on and re-raises."""
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


def reset_hook_states(transformer) -> None:
    """Every stateful diffusers hook on the transformer and its submodules back to its initial
    state (``HookRegistry.reset_stateful_hooks``: what diffusers' ``CacheMixin`` pipelines do
    through ``maybe_free_model_hooks`` after a call, which a transformer without ``CacheMixin`` or a
    third-party pipeline never gets)."""
    from diffusers.hooks import HookRegistry

    registry = getattr(transformer, "_diffusers_hook", None)
    if isinstance(registry, HookRegistry):
        registry.reset_stateful_hooks(recurse=True)
    else:
        for module in transformer.modules():
            reg = getattr(module, "_diffusers_hook", None)
            if isinstance(reg, HookRegistry):
                reg.reset_stateful_hooks(recurse=False)


def ensure_context(transformer, slots: int = 1, pipe=None):
    """Pipelines outside diffusers do not wrap their transformer call in
    ``transformer.cache_context(...)``; set a default context for that call when none is set.
    With separate CFG (``slots`` = 2 calls per step) the calls alternate between two contexts so
    conditional and unconditional states never mix. With ``pipe``, every pipeline call starts from
    a clean state (``reset_hook_states``, the alternation from its first slot): no state of one
    generation reaches the next (``ditbook.hooks.wrap_call``). Returns an undo callable."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import CacheContext, StateManager, _set_cache_context

    def managers():
        for module in transformer.modules():
            registry = getattr(module, "_diffusers_hook", None)
            if isinstance(registry, HookRegistry):
                for hook in registry.hooks.values():
                    for attr in vars(hook).values():
                        if isinstance(attr, StateManager):
                            yield attr

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
