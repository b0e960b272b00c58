"""The one training step-and-log loop of the reference models' training scripts
(``train_reference``, ``train_video_reference``): AdamW, linear warm-up then cosine decay, gradients
clipped to norm 1, the recorded value logged every 100 steps (mean of the last 100); and the GPU
determinism switches, set through torch's own switches and put back after."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import numpy as np
import torch


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def optimise(module, step_loss: Callable, *, steps: int, lr: float, warmup: int, weight_decay: float, seed: int,
             log: Callable[[str], None], label: str, recorded: str = "loss") -> list[float]:
    """Train ``module`` for ``steps`` steps. ``step_loss(g)`` draws one batch from the generator
    ``g`` (seeded with ``seed``) and returns ``(loss to minimise, value to record)``; returns the
    recorded values, logged as ``<label> step <n> <recorded> <mean>``."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    values: list[float] = []
    module.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss, value = step_loss(g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        values.append(value.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"{label} step {step} {recorded} {np.mean(values[-100:]):.4f}")
    module.eval()
    return values


@contextlib.contextmanager
def deterministic(device: str):
    """On a GPU: deterministic cuDNN without benchmarking, no TF32 in cuDNN or matmuls, for the
    block; everything as it was afterwards. On the CPU: nothing."""
    if device == "cpu":
        yield
        return
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # matmuls in full fp32 (no TF32)
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


__all__ = ["deterministic", "lr_at", "optimise"]
