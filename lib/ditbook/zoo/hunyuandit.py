"""Tiny HunyuanDiTPipeline: HunyuanDiT2DModel (long skip connections from the first half of the
blocks to the second), AutoencoderKL, a BERT and a T5 encoder; no safety checker."""

from __future__ import annotations

import torch

from . import vocab
from .parts import generation, make_t5, make_vae


def make_bert(tokenizer, dim: int = 32):
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=dim, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=2 * dim, max_position_embeddings=128,
                                pad_token_id=tokenizer.pad_token_id))


def build_pipeline(seed: int = 0):
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline

    torch.manual_seed(seed)
    bert_tok, t5_tok = vocab.bert_tokenizer(77), vocab.t5_tokenizer()
    transformer = HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=16, hidden_size=32,
        num_layers=4,  # blocks 3.. take a skip from blocks ..1
        mlp_ratio=2.0, cross_attention_dim=32,  # BERT width
        cross_attention_dim_t5=32,  # T5 width (pooled with 8 heads)
        pooled_projection_dim=16, text_len=77, text_len_t5=256)  # the pipeline pads BERT to 77 tokens, T5 to 256
    return HunyuanDiTPipeline(
        vae=make_vae((16, 16, 32, 32), 4),  # 8x: the pipeline's RoPE grid assumes it
        text_encoder=make_bert(bert_tok), tokenizer=bert_tok, transformer=transformer,
        scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.03, clip_sample=False,
                                prediction_type="v_prediction", steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        text_encoder_2=make_t5(t5_tok, 32, 1), tokenizer_2=t5_tok)


GENERATION = generation(height=64, width=64, guidance_scale=5.0, extra={"use_resolution_binning": False})
