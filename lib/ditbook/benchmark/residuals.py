"""Residual change per denoising step at the first transformer block: the relative L1 change of
its residual between consecutive transformer calls, what first-block caches threshold on.
"""

from __future__ import annotations

from typing import Any, Callable


def first_block(transformer):
    """The first block of the transformer's outermost non-empty ``nn.ModuleList``."""
    import torch.nn as nn

    lists = [(name.count("."), name, m) for name, m in transformer.named_modules()
             if name and isinstance(m, nn.ModuleList) and len(m) > 0]
    if lists:
        _, name, blocks = min(lists, key=lambda t: t[0])
        return f"{name}.0", blocks[0]
    raise ValueError(f"{type(transformer).__name__} has no nn.ModuleList of blocks")


def _image_stream(output, like):
    outs = output if isinstance(output, (tuple, list)) else (output,)
    for o in outs:
        if hasattr(o, "shape") and o.shape == like.shape:
            return o
    return None


def residual_changes(pipe, call: Callable[[], Any]) -> dict:
    """Run ``call()`` once and return ``{"block": name, "changes": [per call after the first]}``."""
    import torch

    name, block = first_block(pipe.transformer)
    residuals: list = []
    inputs: list = []

    def pre(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        inputs.append(hs)

    def post(module, args, kwargs, output):
        hs = inputs.pop() if inputs else None
        if hs is None:
            return
        out = _image_stream(output, hs)
        if out is not None:
            residuals.append((out - hs).detach().float().cpu())

    h1 = block.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = block.register_forward_hook(post, with_kwargs=True)
    try:
        with torch.inference_mode():
            call()
    finally:
        h1.remove()
        h2.remove()
    changes = []
    for prev, cur in zip(residuals, residuals[1:]):
        denom = prev.abs().mean().item()
        changes.append(float((cur - prev).abs().mean().item() / denom) if denom > 0 else float("nan"))
    return {"block": name, "changes": changes}


__all__ = ["first_block", "residual_changes"]
