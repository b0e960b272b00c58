"""Tiny components shared by the zoo builders: an AutoencoderKL, CLIP and T5/UMT5 text encoders
sized to the offline tokenizers of ``vocab.py``, and the cards' generation defaults."""

from __future__ import annotations


def generation(**changes) -> dict:
    """A card's generation defaults (two prompts, two seeds, 2 steps at 32x32) with ``changes``."""
    return {"prompts": ["a red circle on the left", "a blue square in the center"], "negative_prompt": "",
            "seeds": [0, 1], "height": 32, "width": 32, "steps": 2, "guidance_scale": 1.0, "true_cfg_scale": 1.0,
            "extra": {"max_sequence_length": 16}, **changes}


def make_vae(channels: tuple[int, ...], latent_channels: int, groups: int = 8):
    from diffusers import AutoencoderKL

    n = len(channels)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=channels, layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=groups, sample_size=64, shift_factor=0.0,
                         scaling_factor=1.0)


def make_clip(tokenizer, dim: int, layers: int, max_positions: int, projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=2 * dim,
                            num_hidden_layers=layers, num_attention_heads=2, max_position_embeddings=max_positions,
                            projection_dim=dim, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def make_t5(tokenizer, dim: int, layers: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    cfg_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model_cls(cfg_cls(vocab_size=len(tokenizer), d_model=dim, d_kv=dim // 2, d_ff=2 * dim, num_layers=layers,
                             num_heads=2, relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))
