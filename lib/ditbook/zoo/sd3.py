"""Tiny StableDiffusion3Pipeline: SD3Transformer2DModel (joint attention), AutoencoderKL with 16
latent channels, two CLIP encoders with projection and a T5 encoder."""

from __future__ import annotations

import torch

from . import vocab
from .parts import generation, make_clip, make_t5, make_vae


def build_pipeline(seed: int = 0):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    clip_tok, t5_tok = vocab.clip_tokenizer(16), vocab.t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=64,  # T5 width; the two CLIPs (32 + 32) are padded to it
        caption_projection_dim=32, pooled_projection_dim=64,  # two CLIP projections of 32
        pos_embed_max_size=16)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=make_vae((16, 32), 16),
        text_encoder=make_clip(clip_tok, 32, 1, 16, projection=True), tokenizer=clip_tok,
        text_encoder_2=make_clip(clip_tok, 32, 1, 16, projection=True), tokenizer_2=clip_tok,
        text_encoder_3=make_t5(t5_tok, 64, 1), tokenizer_3=t5_tok)


GENERATION = generation(negative_prompt="blurry", guidance_scale=3.0)
