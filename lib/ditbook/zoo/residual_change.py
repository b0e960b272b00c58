"""How much the first transformer block's residual changes between consecutive denoising
steps — the signal first-block caches (FBCache, DBCache) threshold on.

For each transformer call, residual = output hidden_states - input hidden_states of block 0;
the change at step i is mean|r_i - r_{i-1}| / mean|r_{i-1}|. Trained DiTs sit near 0.05-0.2,
random-initialized ones near 0.4-0.6.
"""

from __future__ import annotations

import torch


def _first_block(transformer) -> torch.nn.Module:
    for name in ("transformer_blocks", "blocks", "layers"):
        blocks = getattr(transformer, name, None)
        if blocks is not None and len(blocks) > 0:
            return blocks[0]
    raise ValueError(f"{type(transformer).__name__} has no transformer_blocks/blocks/layers list")


def first_block_residual_changes(pipe, **call_kwargs) -> list[float]:
    """Run ``pipe(**call_kwargs)`` once and return the relative L1 change of block 0's
    hidden-state residual between consecutive transformer calls (len = calls - 1). Call
    without true CFG, so that consecutive calls are consecutive steps."""
    residuals: list[torch.Tensor] = []

    def hook(module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        outs = output if isinstance(output, (tuple, list)) else (output,)
        match = [o for o in outs if isinstance(o, torch.Tensor) and o.shape == hidden.shape]
        residuals.append((match[-1] - hidden).detach().float().cpu())

    handle = _first_block(pipe.transformer).register_forward_hook(hook, with_kwargs=True)
    try:
        pipe(**call_kwargs)
    finally:
        handle.remove()
    return [
        float((b - a).abs().mean() / a.abs().mean().clamp_min(1e-12)) for a, b in zip(residuals[:-1], residuals[1:])
    ]
