"""Train the video reference model: a small text-to-video WanPipeline on rendered moving shapes.

    python -m ditbook.zoo.train_video_reference --device cuda --out models/video_reference/pipeline

(the default schedule is sized for one H200: a few minutes; ``--device cpu``, the default, runs
the same schedule but takes hours on 2 cores; ``--quick`` is a seconds-long schedule for tests).
Three stages, seeded by ``--seed``:
  1. render ``clips`` 9-frame 32x32 clips of a shape moving left/right/up/down (``moving_shapes.py``)
     and train a small AutoencoderKLWan on them (causal 3D VAE, 4x in space and time: 9x32x32 ->
     3x8x8; reconstruction, the shape's pixels weighted up, + a small KL term); register the
     per-channel ``latents_mean`` / ``latents_std`` of its latents in its config (WanPipeline
     un-normalizes with them before decoding);
  2. encode each prompt once with the (random, frozen) UMT5 encoder;
  3. train the WanTransformer3DModel with rectified flow matching (x_t = (1-t) x0 + t noise,
     timestep 1000 t, target noise - x0: what the pipeline's Euler scheduler integrates), with
     15% prompt dropout to the empty prompt or to the card's negative prompt, so Wan's CFG
     (``guidance_scale`` > 1: a second transformer call with the negative prompt) works.
Then save the whole pipeline with ``save_pretrained`` and a ``training.json`` of what was done.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import moving_shapes, vocab
from .parts import make_t5
from .training import clock, deterministic, encode_means, flow_times, optimise, save_run, vae_pass

MAX_SEQUENCE_LENGTH = 24  # UMT5 tokens ("moving", "up", "down" are spelled in characters); the card passes it too
NEGATIVE_PROMPT = "blurry low quality"  # trained as an unconditional prompt, like the empty one


@dataclass(frozen=True)
class WanSize:
    heads: int = 4
    head_dim: int = 32
    layers: int = 4
    ffn_dim: int = 256
    freq_dim: int = 64
    text_dim: int = 64
    text_layers: int = 2
    vae_base_dim: int = 16
    vae_dim_mult: tuple = (1, 2, 2)  # two 2x downsamplings in space ...
    vae_temporal_down: tuple = (True, True)  # ... and both in time too: 4x
    z_dim: int = 16


SIZE = WanSize()


@dataclass
class TrainConfig:
    seed: int = 0
    clips: int = 6000
    vae_steps: int = 1600
    vae_batch: int = 16
    vae_lr: float = 1e-3
    vae_kl: float = 1e-6
    vae_shape_weight: float = 5.0  # the shape covers ~7% of a frame: its pixels weigh this much more
    steps: int = 5000
    batch: int = 256
    lr: float = 5e-4
    warmup: int = 200
    prompt_dropout: float = 0.15
    threads: int = 2
    device: str = "cpu"


# a schedule of seconds on the CPU: checks the whole path (render, train, save), learns nothing
QUICK = dict(clips=24, vae_steps=2, vae_batch=2, steps=2, batch=4, warmup=1)


def build_pipeline(size: WanSize = SIZE, seed: int = 0):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    tok = vocab.t5_tokenizer()
    down = 2 ** (len(size.vae_dim_mult) - 1)
    vae = AutoencoderKLWan(base_dim=size.vae_base_dim, z_dim=size.z_dim, dim_mult=list(size.vae_dim_mult),
                           num_res_blocks=1, temperal_downsample=list(size.vae_temporal_down),
                           latents_mean=[0.0] * size.z_dim, latents_std=[1.0] * size.z_dim,
                           scale_factor_spatial=down, scale_factor_temporal=2 ** sum(size.vae_temporal_down))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=size.heads, attention_head_dim=size.head_dim,
        in_channels=size.z_dim, out_channels=size.z_dim, text_dim=size.text_dim, freq_dim=size.freq_dim,
        ffn_dim=size.ffn_dim, num_layers=size.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    return WanPipeline(tokenizer=tok, text_encoder=make_t5(tok, size.text_dim, size.text_layers, umt5=True), vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)


def to_video_tensor(clips_u8: np.ndarray) -> torch.Tensor:
    """(N, F, H, W, 3) uint8 -> (N, 3, F, H, W) float in [-1, 1], the VAE's input."""
    return torch.from_numpy(clips_u8).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def train_vae(vae, clips: torch.Tensor, cfg: TrainConfig, log) -> list[float]:
    background = torch.tensor(moving_shapes.BACKGROUND, device=cfg.device).view(1, 3, 1, 1, 1) / 127.5 - 1.0

    def step_loss(g):
        x = clips[torch.randint(0, len(clips), (cfg.vae_batch,), generator=g)].to(cfg.device)
        post, z, y = vae_pass(vae, x, g, cfg.device)
        err = (y - x).abs() + (y - x).pow(2)
        rec = err.mean()
        weight = 1.0 + (cfg.vae_shape_weight - 1.0) * ((x - background).abs().sum(1, keepdim=True) > 0.1)
        kl = post.kl().mean() / z[0].numel()
        return (weight * err).mean() + cfg.vae_kl * kl, rec

    return optimise(vae, step_loss, steps=cfg.vae_steps, lr=cfg.vae_lr, warmup=min(50, cfg.vae_steps),
                    weight_decay=0.0, seed=cfg.seed + 1, log=log, label="vae", recorded="rec")


def train_transformer(transformer, latents, scene_idx, embeds, uncond: list[int], cfg: TrainConfig, log) -> list[float]:
    """latents: (N, C, T, H, W) normalized; embeds: one row per scene, then the ``uncond`` rows
    (the empty and the negative prompt) that dropped prompts are replaced by."""
    dev = cfg.device
    n = len(latents)
    embeds = embeds.to(dev)
    uncond_t = torch.tensor(uncond)

    def step_loss(g):
        pick = torch.randint(0, n, (cfg.batch,), generator=g)
        x0 = latents[pick].to(dev)
        cond = scene_idx[pick].clone()
        drop = torch.rand(cfg.batch, generator=g) < cfg.prompt_dropout
        cond[drop] = uncond_t[torch.randint(0, len(uncond), (int(drop.sum()),), generator=g)]
        t = flow_times(g, cfg.batch)
        noise = torch.randn(x0.shape, generator=g).to(dev)
        t = t.to(dev)
        tb = t.view(-1, 1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * noise
        pred = transformer(hidden_states=xt, timestep=t * 1000.0, encoder_hidden_states=embeds[cond.to(dev)],
                           return_dict=False)[0]
        loss = (pred - (noise - x0)).pow(2).mean()
        return loss, loss

    return optimise(transformer, step_loss, steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, weight_decay=0.01,
                    seed=cfg.seed + 2, log=log, label="transformer")


def train(out: Path, cfg: TrainConfig, command: str | None = None) -> dict:
    with deterministic(cfg.device):
        return _train(out, cfg, command)


def _train(out: Path, cfg: TrainConfig, command: str | None = None) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start, log = clock()
    pipe = build_pipeline(SIZE, seed=cfg.seed)
    clips_u8, order, scenes = moving_shapes.dataset(cfg.clips, cfg.seed)
    clips = to_video_tensor(clips_u8)
    log(f"rendered {len(clips)} clips {tuple(clips.shape[1:])} of {len(scenes)} scenes")

    pipe.vae.to(cfg.device)
    pipe.transformer.to(cfg.device)
    vae_losses = train_vae(pipe.vae, clips, cfg, log)
    raw = encode_means(pipe.vae, clips, cfg.device, 64)  # (N, C, T, h, w)
    mean = raw.mean(dim=(0, 2, 3, 4))
    std = raw.std(dim=(0, 2, 3, 4)).clamp_min(1e-6)
    pipe.vae.register_to_config(latents_mean=[round(float(v), 6) for v in mean],
                                latents_std=[round(float(v), 6) for v in std])
    mean_t = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std_t = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents = (raw - mean_t) / std_t
    t_vae = time.time() - start
    log(f"vae done: latents {tuple(raw.shape[1:])}, channel std {[round(float(v), 3) for v in std]}")

    with torch.no_grad():
        prompts = [s.prompt for s in scenes] + ["", NEGATIVE_PROMPT]
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=MAX_SEQUENCE_LENGTH, device="cpu")
    uncond = [len(scenes), len(scenes) + 1]
    tr_losses = train_transformer(pipe.transformer, latents, torch.tensor(order), embeds, uncond, cfg, log)
    t_total = time.time() - start
    default = f"python -m ditbook.zoo.train_video_reference --out {out} --seed {cfg.seed} --device {cfg.device}"
    head = {"command": command or default, "config": asdict(cfg), "model_size": asdict(SIZE),
            "clip": {"frames": moving_shapes.FRAMES, "height": moving_shapes.SIZE, "width": moving_shapes.SIZE},
            "max_sequence_length": MAX_SEQUENCE_LENGTH, "negative_prompt": NEGATIVE_PROMPT}
    seconds = {"vae_seconds": round(t_vae, 1), "transformer_seconds": round(t_total - t_vae, 1),
               "total_seconds": round(t_total, 1)}
    return save_run(pipe, out, cfg, head, (vae_losses, tr_losses), seconds, log)


def main(argv: list[str] | None = None) -> dict:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/video_reference/pipeline"))
    parser.add_argument("--quick", action="store_true", help=f"a seconds-long schedule for tests: {QUICK}")
    for name, value in asdict(TrainConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args(argv)
    cfg = replace(TrainConfig(), **(QUICK if args.quick else {}))
    cfg = replace(cfg, **{k: getattr(args, k) for k in asdict(cfg) if getattr(args, k) is not None})
    command = "python -m ditbook.zoo.train_video_reference " + " ".join(sys.argv[1:] if argv is None else argv)
    return train(args.out, cfg, command)


if __name__ == "__main__":
    main()
