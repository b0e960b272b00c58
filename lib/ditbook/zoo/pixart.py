"""Tiny PixArtSigmaPipeline: PixArtTransformer2DModel (self + cross attention, adaLN-single),
AutoencoderKL and a T5 encoder."""

from __future__ import annotations

import torch

from . import vocab
from .parts import generation, make_t5, make_vae


def build_pipeline(seed: int = 0):
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    torch.manual_seed(seed)
    tok = vocab.t5_tokenizer()
    transformer = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,  # learned sigma
        num_layers=2, cross_attention_dim=32, caption_channels=32, sample_size=16, patch_size=2,
        norm_type="ada_norm_single", use_additional_conditions=False)
    return PixArtSigmaPipeline(tokenizer=tok, text_encoder=make_t5(tok, 32, 1), vae=make_vae((16, 32), 4),
                               transformer=transformer, scheduler=DPMSolverMultistepScheduler())


GENERATION = generation(guidance_scale=4.5,
                        extra={"max_sequence_length": 16, "use_resolution_binning": False, "clean_caption": False})
