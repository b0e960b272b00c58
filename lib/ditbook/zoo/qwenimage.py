"""Tiny QwenImagePipeline: QwenImageTransformer2DModel (dual-stream MMDiT), AutoencoderKLQwenImage
and a Qwen2.5-VL text encoder with a byte-level BPE tokenizer. True CFG: with a negative prompt
and ``true_cfg_scale > 1`` the pipeline calls the transformer twice per step (cond, uncond)."""

from __future__ import annotations

import torch

from . import vocab
from .parts import generation


def make_qwen_vl(tokenizer, dim: int = 32):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    text = {"vocab_size": len(tokenizer), "hidden_size": dim, "intermediate_size": 2 * dim, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>")}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": dim,
              "fullatt_block_indexes": [0]}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|image_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>")))


def build_pipeline(seed: int = 0):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    torch.manual_seed(seed)
    tok = vocab.qwen2_tokenizer()
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4,  # 4 latent channels x 2x2 packing
        num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6))
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=vae,
                             text_encoder=make_qwen_vl(tok), tokenizer=tok, transformer=transformer)


GENERATION = generation(negative_prompt="blurry", true_cfg_scale=4.0, extra={"max_sequence_length": 64})
