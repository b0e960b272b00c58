"""What the reference models' training scripts (``train_reference``, ``train_video_reference``) share:
the one step-and-log loop (AdamW, linear warm-up then cosine decay, gradients clipped to norm 1, the
recorded value logged every 100 steps as the mean of the last 100), the GPU determinism switches (put
back after), the flow-matching times, a VAE pass, the timed log and the saved run with its record."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
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


def flow_times(g: torch.Generator, batch: int) -> torch.Tensor:
    """Half uniform, half logit-normal times: all of [0, 1] covered, the middle more."""
    return torch.where(torch.rand(batch, generator=g) < 0.5, torch.rand(batch, generator=g),
                       torch.sigmoid(torch.randn(batch, generator=g)))


def vae_pass(vae, x: torch.Tensor, g: torch.Generator, device: str):
    """(posterior, latents sampled from it, reconstruction) of ``x``."""
    post = vae.encode(x).latent_dist
    z = post.mean + post.std * torch.randn(post.mean.shape, generator=g).to(device)
    return post, z, vae.decode(z).sample


def encode_means(vae, images: torch.Tensor, device: str, chunk: int) -> torch.Tensor:
    """The posterior means of ``images``, encoded ``chunk`` at a time, on the CPU."""
    with torch.no_grad():
        return torch.cat([vae.encode(images[i : i + chunk].to(device)).latent_dist.mean.cpu()
                          for i in range(0, len(images), chunk)])


def clock() -> tuple[float, Callable[[str], None]]:
    """(start time, ``log(msg)``: the message printed after the seconds since the start)."""
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    return start, log


def save_run(pipe, out: Path, cfg, head: dict, losses: tuple[list, list], seconds: dict, log) -> dict:
    """Save ``pipe`` to ``out`` and ``training.json`` beside it: ``head``, the parameter counts, the
    final (vae, transformer) ``losses``, ``seconds``, the folder size and the platform."""
    pipe.to("cpu")
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    gpu = cfg.device.startswith("cuda")
    record = {**head, "transformer_params": sum(p.numel() for p in pipe.transformer.parameters()),
              "vae_params": sum(p.numel() for p in pipe.vae.parameters()),
              "vae_final_rec_loss": float(np.mean(losses[0][-100:])),
              "transformer_final_loss": float(np.mean(losses[1][-100:])), **seconds, "folder_mb": round(size_mb, 2),
              "torch": torch.__version__, "threads": cfg.threads,
              "hardware": torch.cuda.get_device_name() if gpu else f"cpu, {cfg.threads} threads"}
    (out.parent / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved to {out} ({size_mb:.1f} MB)")
    return record


__all__ = ["clock", "deterministic", "encode_means", "flow_times", "lr_at", "optimise", "save_run", "vae_pass"]
