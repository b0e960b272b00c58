"""Tiny WanPipeline (text-to-video): WanTransformer3DModel (self attention with 3D RoPE, cross
attention to the text), AutoencoderKLWan (causal 3D VAE) and a UMT5 encoder."""

from __future__ import annotations

import torch

from . import vocab
from .parts import generation, make_t5


def build_pipeline(seed: int = 0):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    tok = vocab.t5_tokenizer()
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    return WanPipeline(tokenizer=tok, text_encoder=make_t5(tok, 32, 1, umt5=True), vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)


GENERATION = generation(negative_prompt="blurry", guidance_scale=5.0,
                        extra={"max_sequence_length": 16, "num_frames": 5})
