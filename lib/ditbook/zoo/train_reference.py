"""Train the shipped reference model: a small text-to-image FluxPipeline on rendered shapes.

    python -m ditbook.zoo.train_reference --device cuda --out models/reference/pipeline

(the shipped weights: about 5 minutes on one H200; ``--device cpu``, the default, runs the same
schedule but takes well over an hour on 2 cores). Three stages, seeded by ``--seed``:
  1. render ``images`` 64x64 shape pictures (``shapes.py``) and train a tiny AutoencoderKL on
     them (reconstruction + a small KL term); set its shift/scaling factors from the latents;
  2. encode each prompt once with the (random, frozen) CLIP and T5 encoders: a random encoder
     still gives each prompt its own embedding, which is all the transformer needs;
  3. train the FluxTransformer2DModel with rectified flow matching (x_t = (1-t) x0 + t noise,
     target noise - x0), 15% prompt dropout to the empty prompt so true CFG works, random
     guidance values so any ``guidance_scale`` is in distribution.
Then save the whole pipeline with ``save_pretrained`` and a ``training.json`` of what was done.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import flux, shapes
from .training import clock, deterministic, encode_means, flow_times, optimise, save_run, vae_pass

SIZE = flux.FluxSize(heads=4, head_dim=32, axes_dims_rope=(8, 12, 12), dual_blocks=2, single_blocks=4, text_dim=64,
                     clip_dim=64, text_layers=2, vae_channels=(16, 32, 32), latent_channels=4, clip_max_length=16)
MAX_SEQUENCE_LENGTH = 16  # T5 tokens; the card passes the same value at generation time


@dataclass
class TrainConfig:
    seed: int = 0
    images: int = 8192
    vae_steps: int = 3000
    vae_batch: int = 32
    vae_lr: float = 1e-3
    vae_kl: float = 1e-6
    steps: int = 6000
    batch: int = 128
    lr: float = 5e-4
    warmup: int = 200
    prompt_dropout: float = 0.15
    threads: int = 2
    device: str = "cpu"


def train_vae(vae, images: torch.Tensor, cfg: TrainConfig, log) -> list[float]:
    def step_loss(g):
        x = images[torch.randint(0, len(images), (cfg.vae_batch,), generator=g)].to(cfg.device)
        post, z, y = vae_pass(vae, x, g, cfg.device)
        rec = (y - x).abs().mean() + (y - x).pow(2).mean()
        kl = post.kl().mean() / z[0].numel()
        return rec + cfg.vae_kl * kl, rec

    return optimise(vae, step_loss, steps=cfg.vae_steps, lr=cfg.vae_lr, warmup=50, weight_decay=0.0,
                    seed=cfg.seed + 1, log=log, label="vae", recorded="rec")


def train_transformer(transformer, latents, scene_idx, text, cfg: TrainConfig, log) -> list[float]:
    """latents: (N, C, H, W) normalized; text: (prompt_embeds, pooled) per scene, last = empty prompt."""
    from diffusers import FluxPipeline

    embeds, pooled = text
    empty = len(embeds) - 1
    n, c, h, w = latents.shape
    dev = cfg.device
    img_ids = FluxPipeline._prepare_latent_image_ids(cfg.batch, h // 2, w // 2, dev, torch.float32)
    txt_ids = torch.zeros(embeds.shape[1], 3, device=dev)
    embeds, pooled = embeds.to(dev), pooled.to(dev)

    def step_loss(g):
        pick = torch.randint(0, n, (cfg.batch,), generator=g)
        x0 = FluxPipeline._pack_latents(latents[pick], cfg.batch, c, h, w).to(dev)
        cond = scene_idx[pick].clone()
        cond[torch.rand(cfg.batch, generator=g) < cfg.prompt_dropout] = empty
        t = flow_times(g, cfg.batch)
        noise = torch.randn(x0.shape, generator=g).to(dev)
        t = t.to(dev)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        guidance = (1.0 + 4.0 * torch.rand(cfg.batch, generator=g)).to(dev)
        pred = transformer(hidden_states=xt, timestep=t, guidance=guidance, pooled_projections=pooled[cond.to(dev)],
                           encoder_hidden_states=embeds[cond.to(dev)], txt_ids=txt_ids, img_ids=img_ids).sample
        loss = (pred - (noise - x0)).pow(2).mean()
        return loss, loss

    return optimise(transformer, step_loss, steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, weight_decay=0.01,
                    seed=cfg.seed + 2, log=log, label="transformer")


def train(out: Path, cfg: TrainConfig) -> dict:
    with deterministic(cfg.device):
        return _train(out, cfg)


def _train(out: Path, cfg: TrainConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start, log = clock()
    pipe = flux.build_pipeline(SIZE, seed=cfg.seed)
    images_u8, order, scenes = shapes.dataset(cfg.images, cfg.seed)
    images = torch.from_numpy(images_u8).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    log(f"rendered {len(images)} images of {len(scenes)} scenes")

    pipe.vae.to(cfg.device)
    pipe.transformer.to(cfg.device)
    vae_losses = train_vae(pipe.vae, images, cfg, log)
    raw = encode_means(pipe.vae, images, cfg.device, 256)
    shift, scale = float(raw.mean()), float(1.0 / raw.std())
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (raw - shift) * scale
    t_vae = time.time() - start
    log(f"vae done: shift {shift:.4f} scale {scale:.4f}")

    with torch.no_grad():
        prompts = [s.prompt for s in scenes] + [""]
        embeds, pooled, _ = pipe.encode_prompt(prompts, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH)
    tr_losses = train_transformer(pipe.transformer, latents, torch.tensor(order), (embeds, pooled), cfg, log)
    t_total = time.time() - start
    head = {"command": f"python -m ditbook.zoo.train_reference --out {out} --seed {cfg.seed} --device {cfg.device}",
            "config": asdict(cfg), "model_size": asdict(SIZE)}
    seconds = {"vae_seconds": round(t_vae, 1), "total_seconds": round(t_total, 1)}
    return save_run(pipe, out, cfg, head, (vae_losses, tr_losses), seconds, log)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/reference/pipeline"))
    for name, value in asdict(TrainConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    train(args.out, cfg)


if __name__ == "__main__":
    main()
