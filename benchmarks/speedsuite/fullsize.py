"""Full-size pipeline shapes with random weights, for speed work on a GPU.

Speed depends on shapes, not on the values of the weights, and no checkpoint can be downloaded
on the GPU hosts, so these builders make pipelines with the published architecture sizes and
random weights, directly on the target device in the target dtype (no CPU initialisation, no
fp32 copy). Text encoders are left out: the benchmarks pass prompt embeddings of the real
shape, so text encoding is not part of the measured time (it is reported separately where a
stage has it).

Shapes (from the models' published ``config.json`` files on the Hugging Face hub):

- FLUX.1-dev transformer: 19 double-stream + 38 single-stream blocks, 24 heads x 128,
  joint_attention_dim 4096, pooled 768, guidance embedding, RoPE axes (16, 56, 56); VAE with
  16 latent channels and block_out_channels (128, 256, 512, 512).
- Qwen-Image transformer: 60 blocks, 24 heads x 128, joint_attention_dim 3584, no guidance
  embedding; its own causal 3D VAE (diffusers' defaults for ``AutoencoderKLQwenImage``).
- ``scale`` shrinks the transformer for the scale table (tiny / small / full).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                      num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                      num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                      use_dynamic_shifting=True)

# transformer sizes of the scale table: (double blocks, single blocks, heads) for Flux
FLUX_SCALES = {"tiny": (1, 2, 4), "small": (4, 8, 12), "full": (19, 38, 24)}
TEXT_TOKENS = 512  # T5 tokens of a FLUX.1-dev prompt at max_sequence_length 512


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _make(cls, config: dict, device: str, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = cls(**config)
    return model.to(device=device, dtype=dtype).eval()


def flux_config(scale: str = "full") -> dict:
    double, single, heads = FLUX_SCALES[scale]
    return {**FLUX_DEV, "num_layers": double, "num_single_layers": single, "num_attention_heads": heads}


@dataclass
class FullSizePipeline:
    """A pipeline and the call arguments that stand in for its text encoders."""

    pipe: object
    name: str
    call_kwargs: dict
    transformer_params: int

    def __call__(self, seed: int = 0, **overrides):
        kwargs = {**self.call_kwargs, **overrides}
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return self.pipe(generator=gen, **kwargs)


def flux_pipeline(scale: str = "full", device: str = "cuda", dtype=torch.bfloat16, *, height: int = 1024,
                  width: int = 1024, steps: int = 28, seed: int = 0, text_tokens: int = TEXT_TOKENS,
                  true_cfg_scale: float = 1.0) -> FullSizePipeline:
    """A FLUX.1-dev-shaped FluxPipeline with random weights (text encoders skipped)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    cfg = flux_config(scale)
    transformer = _make(FluxTransformer2DModel, cfg, device, dtype, seed)
    vae = _make(AutoencoderKL, FLUX_VAE, device, dtype, seed + 1)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    embeds = torch.randn(1, text_tokens, cfg["joint_attention_dim"], generator=g).to(device, dtype)
    pooled = torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(device, dtype)
    kwargs = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=height, width=width,
                  num_inference_steps=steps, guidance_scale=3.5, output_type="pt")
    if true_cfg_scale > 1:
        kwargs.update(true_cfg_scale=true_cfg_scale, negative_prompt_embeds=torch.randn_like(embeds) * 0.5,
                      negative_pooled_prompt_embeds=torch.randn_like(pooled) * 0.5)
    params = sum(p.numel() for p in transformer.parameters())
    return FullSizePipeline(pipe, f"flux-{scale}", kwargs, params)


def qwen_image_pipeline(device: str = "cuda", dtype=torch.bfloat16, *, num_layers: int = 60, height: int = 1024,
                        width: int = 1024, steps: int = 10, seed: int = 0, text_tokens: int = 128,
                        true_cfg_scale: float = 4.0) -> FullSizePipeline:
    """A Qwen-Image-shaped QwenImagePipeline with random weights; true CFG = two calls per step."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    cfg = {**QWEN_IMAGE, "num_layers": num_layers}
    transformer = _make(QwenImageTransformer2DModel, cfg, device, dtype, seed)
    vae = _make(AutoencoderKLQwenImage, {}, device, dtype, seed + 1)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), vae=vae,
                             text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    embeds = torch.randn(1, text_tokens, cfg["joint_attention_dim"], generator=g).to(device, dtype)
    mask = torch.ones(1, text_tokens, dtype=torch.long, device=device)
    neg = (torch.randn(1, text_tokens // 2, cfg["joint_attention_dim"], generator=g) * 0.5).to(device, dtype)
    neg_mask = torch.ones(1, text_tokens // 2, dtype=torch.long, device=device)
    kwargs = dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                  negative_prompt_embeds_mask=neg_mask, true_cfg_scale=true_cfg_scale, height=height,
                  width=width, num_inference_steps=steps, output_type="pt")
    params = sum(p.numel() for p in transformer.parameters())
    return FullSizePipeline(pipe, "qwen-image", kwargs, params)


def gqa_shapes() -> dict:
    """The GQA case of issue 8: 48 query / 12 KV heads, head dim 128, about 4608 tokens."""
    return {"batch": 1, "heads": 48, "kv_heads": 12, "head_dim": 128, "tokens": 4608}
