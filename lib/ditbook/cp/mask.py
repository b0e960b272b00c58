"""Attention masks under Ulysses, fitted to what each rank's attention holds after the all-to-all (every rank's queries
and keys in rank order, for ``1/degree`` of the heads): a mask over all ``H`` heads keeps the rank's head chunk;
query rows or keys of the rank's own tokens are gathered from every rank; a length-1 axis broadcasts. ``fit_mask``
does it for one call; ``install_mask_fit`` wraps cache-dit's native CP attention entry so every call fits its mask
first. Ulysses alone; ``cp.dryrun`` re-enacts the same rules."""

from __future__ import annotations

import torch

from ..hooks import WrapGroup

MASK_WRAP = "ditbook.cp-mask-fit"


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    from .uneven import padded_all_gather

    dtype = x.dtype
    # gloo gathers no bool tensors: as bytes, and back
    y = x.to(torch.uint8) if dtype == torch.bool else x
    out = padded_all_gather(y, dim, group)
    return out.to(dtype) if dtype == torch.bool else out


def fit_mask(mask, query: torch.Tensor, key: torch.Tensor, rank: int, degree: int, gather) -> torch.Tensor:
    """``mask`` as rank ``rank``'s Ulysses attention needs it (``query`` / ``key``: the rank's own)."""
    if not torch.is_tensor(mask) or mask.dim() < 2 or degree < 2:
        return mask
    s_q, heads, s_k = query.shape[1], query.shape[2], key.shape[1]
    if mask.dim() == 4 and mask.shape[-2] == s_q and s_q > 1:
        mask = gather(mask, -2)
    if mask.shape[-1] == s_k and s_k > 1:
        mask = gather(mask, -1)
    if mask.dim() == 4 and mask.shape[1] == heads and heads > 1 and heads % degree == 0:
        share = heads // degree
        mask = mask.narrow(1, rank * share, share)
    return mask


def _fitting(original, query, key, value, attn_mask=None, *args, **kwargs):
    cfg = kwargs.get("_cp_config")
    if torch.is_tensor(attn_mask) and cfg is not None and getattr(cfg, "ring_degree", 1) == 1 \
            and getattr(cfg, "ulysses_degree", 1) > 1:
        group = cfg._ulysses_mesh.get_group()
        attn_mask = fit_mask(attn_mask, query, key, cfg._ulysses_local_rank, cfg.ulysses_degree,
                             lambda x, dim: _gather(x, dim, group))
    return original(query, key, value, attn_mask, *args, **kwargs)


def install_mask_fit(undo: WrapGroup | None = None):
    """Wrap cache-dit's native CP attention entry to fit each mask; idempotent."""
    from cache_dit.attention.backends import native

    from ..hooks import is_wrapped, wrap_method

    if is_wrapped(native, MASK_WRAP, "_context_parallel_attention"):
        return None
    handle = wrap_method(native, MASK_WRAP, _fitting, attr="_context_parallel_attention")
    if undo is not None:
        undo.track(handle)
    return handle
