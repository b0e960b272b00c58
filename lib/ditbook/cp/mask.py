"""Attention masks under Ulysses: fitted to what each rank's attention holds after the all-to-all.

cache-dit's Ulysses attention passes the mask to the attention as it is, while the all-to-all gives
every rank all the ranks' queries and keys (in rank order) for ``1/degree`` of the heads. A mask the
model built for the attention as one rank sees it before the all-to-all does not fit:

- a mask with a heads axis of all ``H`` heads (diffusers' ``prepare_attention_mask`` repeats a mask
  per head): each rank keeps the heads the all-to-all gives it (rank ``r``: heads
  ``[r*H/P, (r+1)*H/P)``, the all-to-all's head chunks in rank order);
- a mask whose query rows (``dim -2``) or keys (``dim -1``) are the rank's own tokens (built from
  its local sequence length): every rank's rows / keys, gathered in rank order (the order in which
  the all-to-all joins the ranks' tokens); an axis of length 1 broadcasts and is left alone.

``fit_mask`` does that for one call; ``install_mask_fit`` wraps cache-dit's native CP attention entry
(``cache_dit.attention.backends.native._context_parallel_attention``, what the launch's "native"
backend calls, through ``ditbook.hooks``) so every CP attention call of the process fits its mask
first. Ulysses alone (no ring); the dry run (``cp_dryrun``) re-enacts the same rules.
"""

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
    """``mask`` as the Ulysses attention of rank ``rank`` (of ``degree``) needs it. ``query`` and
    ``key`` are the rank's own, before the all-to-all, in diffusers' ``[B, S, H, D]`` layout;
    ``gather(x, dim)`` joins every rank's ``x`` along ``dim`` in rank order."""
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
    """Wrap cache-dit's native CP attention entry so each call's mask is fitted (``fit_mask``);
    returns the handle (kept in ``undo`` when given). Idempotent per process."""
    from cache_dit.attention.backends import native

    from ..hooks import is_wrapped, wrap_method

    if is_wrapped(native, MASK_WRAP, "_context_parallel_attention"):
        return None
    handle = wrap_method(native, MASK_WRAP, _fitting, attr="_context_parallel_attention")
    if undo is not None:
        undo.track(handle)
    return handle
