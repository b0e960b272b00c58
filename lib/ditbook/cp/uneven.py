"""Uneven context-parallel shares (cache-dit's ``ulysses_anything``) on every process-group backend.

A token count the degree does not divide is split into ``torch.tensor_split``'s shares. cache-dit's uneven gather is one
``dist.all_gather`` of unequal tensors, which NCCL takes but gloo refuses: elsewhere ``gather_unevenly`` makes each
gather hook pad every share to the largest, all-gather, and cut the padding off (it never reaches a block)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..hooks import WrapGroup, swap_attribute


def padded_all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` joined along ``dim`` in rank order, lengths unequal: padded, gathered, cut back."""
    world = dist.get_world_size(group)
    size = torch.tensor([x.shape[dim]], dtype=torch.long, device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lens = [int(s.item()) for s in sizes]
    longest = max(lens)
    x = x.contiguous()
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim)


def _gather_post(hook, original):
    """One cache-dit gather hook's ``post_forward`` gathering by ``padded_all_gather``."""
    def post(module, output):
        cfg = hook.parallel_config
        if not getattr(cfg, "ulysses_anything", False):
            return original(module, output)
        is_tensor = torch.is_tensor(output)
        outs = [output] if is_tensor else list(output) if isinstance(output, (list, tuple)) else None
        if outs is None or not all(torch.is_tensor(o) for o in outs) or len(outs) != len(hook.metadata):
            return original(module, output)  # cache-dit's own error for what it cannot gather
        group = cfg._flattened_mesh.get_group()
        for i, cpm in enumerate(hook.metadata):
            if cpm is not None:
                outs[i] = padded_all_gather(outs[i], cpm.gather_dim, group)
        return outs[0] if is_tensor else type(output)(outs)
    return post


def _around_none_post(hook, original):
    """A gather hook's ``post_forward`` gathering an output's tensors around its ``None`` entries."""
    def post(module, output):
        if not isinstance(output, (list, tuple)) or all(o is not None for o in output):
            return original(module, output)
        slots = [i for i, o in enumerate(output) if o is not None]
        if not slots or not all(torch.is_tensor(output[i]) for i in slots) or len(slots) != len(hook.metadata):
            return original(module, output)  # cache-dit's own error for what it cannot gather
        got = original(module, tuple(output[i] for i in slots))
        outs = list(output)
        for i, g in zip(slots, [got] if torch.is_tensor(got) else list(got)):
            outs[i] = g
        return type(output)(outs)
    return post


def _passing_none_post(original):
    """A split hook's ``post_forward`` letting an output with ``None`` entries pass (it splits no output)."""
    def post(module, output):
        if isinstance(output, (list, tuple)) and any(o is None for o in output):
            return output
        return original(module, output)
    return post


def _cp_hooks(transformer):
    """(module name, hook) of every cache-dit hook on ``transformer``'s modules."""
    for name, module in transformer.named_modules():
        registry = getattr(module, "_cache_dit_hook", None)
        for hook in list(getattr(registry, "hooks", {}).values()):
            yield name or "<transformer>", hook


def _swap_post(ref, post, undo: WrapGroup | None) -> None:
    """Replace the ``post_forward`` cache-dit's registry calls (kept in the hook's function reference)."""
    handle = swap_attribute(ref, "post_forward", post)
    if undo is not None:
        undo.track(handle)


def gather_around_none(transformer, undo: WrapGroup | None = None) -> list[str]:
    """After CP is enabled: cache-dit's split and gather hooks let outputs with ``None`` entries pass."""
    from cache_dit.distributed.core._context_parallel import _ContextParallelGatherHook, _ContextParallelSplitHook

    changed = []
    for name, hook in _cp_hooks(transformer):
        ref = getattr(hook, "fn_ref", None)
        if isinstance(hook, _ContextParallelSplitHook) and ref is not None and not any(
                getattr(c, "split_output", False) for c in hook.metadata.values()):
            _swap_post(ref, _passing_none_post(ref.post_forward), undo)
        elif isinstance(hook, _ContextParallelGatherHook):
            _swap_post(ref, _around_none_post(hook, ref.post_forward), undo)
        else:
            continue
        changed.append(name)
    return changed


def gather_unevenly(transformer, undo: WrapGroup | None = None) -> list[str]:
    """After CP is enabled with ``ulysses_anything`` off NCCL: gathers pad unequal shares."""
    from cache_dit.distributed.core._context_parallel import _ContextParallelGatherHook

    changed = []
    for name, hook in _cp_hooks(transformer):
        if not isinstance(hook, _ContextParallelGatherHook):
            continue
        cfg = hook.parallel_config
        if not getattr(cfg, "ulysses_anything", False) or dist.get_backend(cfg._flattened_mesh.get_group()) == "nccl":
            continue
        _swap_post(hook.fn_ref, _gather_post(hook, hook.fn_ref.post_forward), undo)
        changed.append(name)
    return changed
