"""Tiny FluxPipeline: FluxTransformer2DModel (dual + single stream blocks, RoPE, guidance
embedding), AutoencoderKL, CLIP and T5 text encoders with offline tokenizers.

``FluxSize`` holds the knobs; the zoo uses ``FluxSize()`` random-initialized, the shipped
reference model (``train_reference``) a slightly larger one that it trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import vocab
from .parts import generation, make_clip, make_t5, make_vae


@dataclass(frozen=True)
class FluxSize:
    heads: int = 2
    head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim
    dual_blocks: int = 1
    single_blocks: int = 1
    text_dim: int = 32  # T5 d_model == joint_attention_dim
    clip_dim: int = 32  # CLIP hidden size == pooled_projection_dim
    text_layers: int = 1
    vae_channels: tuple[int, ...] = (16, 32, 32)  # 3 levels: 4x spatial compression
    latent_channels: int = 4
    clip_max_length: int = 16


def make_transformer(size: FluxSize):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=4 * size.latent_channels,  # 2x2 latent patches packed by the pipeline
        num_layers=size.dual_blocks, num_single_layers=size.single_blocks, attention_head_dim=size.head_dim,
        num_attention_heads=size.heads, joint_attention_dim=size.text_dim, pooled_projection_dim=size.clip_dim,
        guidance_embeds=True, axes_dims_rope=size.axes_dims_rope)


def build_pipeline(size: FluxSize = FluxSize(), seed: int = 0, transformer=None, vae=None):
    """A complete FluxPipeline; pass ``transformer``/``vae`` to use trained ones."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    torch.manual_seed(seed)
    tok = vocab.clip_tokenizer(size.clip_max_length)
    tok2 = vocab.t5_tokenizer()
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae if vae is not None else make_vae(size.vae_channels, size.latent_channels),
        text_encoder=make_clip(tok, size.clip_dim, size.text_layers, size.clip_max_length), tokenizer=tok,
        text_encoder_2=make_t5(tok2, size.text_dim, size.text_layers), tokenizer_2=tok2,
        transformer=transformer if transformer is not None else make_transformer(size))


GENERATION = generation(negative_prompt=None, guidance_scale=3.5)
