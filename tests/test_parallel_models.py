"""Tiny random models on disk with their cards, for the parallel tests (no tests here).

Built here until the zoo ships them: a tiny FluxPipeline, a tiny QwenImagePipeline, and a
third-party GQA transformer (8 query / 2 KV heads, keyword-called blocks, extra work in the
block loop, its own SDPA call) with a small pipeline around it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

THIRDPARTY_SRC = '''
"""A third-party DiT: GQA joint attention calling SDPA itself, keyword-called blocks."""
import math
import torch
import torch.nn.functional as F
from torch import nn
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import BaseOutput


class GQAAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, n_txt, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q = torch.cat([q[:, :, :n_txt], rope(q[:, :, n_txt:], cos, sin)], dim=2)
        k = torch.cat([k[:, :, :n_txt], rope(k[:, :, n_txt:], cos, sin)], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.mod = nn.Linear(dim, 2 * dim)
        self.attn = GQAAttention(dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, *, x, context, temb, rotary):
        shift, scale = self.mod(temb).unsqueeze(1).chunk(2, dim=-1)
        joint = torch.cat([context, x], dim=1)
        h = self.norm(joint) * (1 + scale) + shift
        joint = joint + self.attn(h, context.shape[1], *rotary)
        joint = joint + self.mlp(self.norm(joint))
        return joint[:, context.shape[1]:], joint[:, :context.shape[1]]


class RotaryTable(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.half = head_dim // 2

    def forward(self, h, w):
        pos = torch.arange(h * w, dtype=torch.float32)
        freqs = 1.0 / (100 ** (torch.arange(self.half, dtype=torch.float32) / self.half))
        ang = pos[:, None] * freqs[None]
        return torch.cos(ang), torch.sin(ang)


class ThirdPartyDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=64, heads=8, kv_heads=2, depth=2, text_dim=32, vocab=64):
        super().__init__()
        self.x_embedder = nn.Linear(in_channels * 4, dim)
        self.context_embedder = nn.Linear(text_dim, dim)
        self.text_table = nn.Embedding(vocab, text_dim)
        self.t_embedder = nn.Sequential(nn.Linear(32, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.rotary = RotaryTable(dim // heads)
        self.blocks = nn.ModuleList([Block(dim, heads, kv_heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels * 4)
        self.skip_gate = nn.Parameter(torch.full((depth,), 0.1))

    def forward(self, hidden_states, text_ids, timestep, return_dict=True):
        b, c, H, W = hidden_states.shape
        x = hidden_states.view(b, c, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, H * W // 4, c * 4)
        x = self.x_embedder(x)
        ctx = self.context_embedder(self.text_table(text_ids))
        half = 16
        f = torch.exp(-math.log(1000) * torch.arange(half, dtype=torch.float32) / half)
        ang = timestep.float()[:, None] * 1000 * f[None]
        temb = self.t_embedder(torch.cat([ang.cos(), ang.sin()], dim=-1).to(x.dtype))
        cos, sin = self.rotary(H // 2, W // 2)
        x0 = x
        for i, blk in enumerate(self.blocks):
            x, ctx = blk(x=x, context=ctx, temb=temb, rotary=(cos, sin))
            x = x + self.skip_gate[i] * x0  # extra work in the loop
        x = self.proj_out(self.norm_out(x))
        x = x.view(b, H // 2, W // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, H, W)
        return Transformer2DModelOutput(sample=x) if return_dict else (x,)


class ThirdPartyOutput(BaseOutput):
    images: object


class ThirdPartyPipeline(DiffusionPipeline):
    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def _ids(self, prompt, n=8):
        vals = [ord(ch) % self.transformer.config.vocab for ch in (prompt or "")][:n]
        return torch.tensor([vals + [0] * (n - len(vals))])

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, height=32, width=32, num_inference_steps=4,
                 true_cfg_scale=4.0, generator=None, output_type="np"):
        c = self.transformer.config.in_channels
        lat = torch.randn((1, c, height // 4, width // 4), generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        cond, uncond = self._ids(prompt), self._ids(negative_prompt or "")
        for t in self.scheduler.timesteps:
            ts = (t / 1000).expand(1)
            pred = self.transformer(hidden_states=lat, text_ids=cond, timestep=ts, return_dict=False)[0]
            if true_cfg_scale > 1:
                neg = self.transformer(hidden_states=lat, text_ids=uncond, timestep=ts, return_dict=False)[0]
                pred = neg + true_cfg_scale * (pred - neg)
            lat = self.scheduler.step(pred, t, lat).prev_sample
        img = torch.nn.functional.interpolate(lat[:, :3], scale_factor=4, mode="nearest")
        img = (img.tanh() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        return ThirdPartyOutput(images=img)
'''


def write_card(folder: Path, name: str, pipeline: dict, transformer: dict, generation: dict) -> Path:
    card = {"name": name, "path": str(folder), "pipeline": pipeline, "transformer": transformer,
            "generation": generation, "runtime": {"device": "cpu", "dtype": "float32"}}
    path = folder.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(card, sort_keys=False))
    return path


def tiny_flux(root: Path, true_cfg: bool = False) -> Path:
    from ditbook.zoo.flux import FluxSize, build_pipeline

    folder = root / "tiny_flux"
    if not folder.exists():
        pipe = build_pipeline(FluxSize(dual_blocks=1, single_blocks=1), seed=0)
        pipe.save_pretrained(folder)
    gen = {"prompts": ["a red circle on the left"], "seeds": [0], "height": 32, "width": 32, "steps": 3,
           "guidance_scale": 3.5, "extra": {"max_sequence_length": 16}}
    if true_cfg:
        gen.update(true_cfg_scale=4.0, negative_prompt="blurry")
    return write_card(folder, "tiny_flux_cfg" if true_cfg else "tiny_flux",
                      {"class": "FluxPipeline", "source": "diffusers"},
                      {"class": "FluxTransformer2DModel", "source": "diffusers"}, gen)


def tiny_qwenimage(root: Path) -> Path:
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ditbook.zoo import vocab

    folder = root / "tiny_qwenimage"
    if not folder.exists():
        torch.manual_seed(0)
        tok = vocab.qwen2_tokenizer()
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=4,
                                                  joint_attention_dim=16, guidance_embeds=False,
                                                  axes_dims_rope=(8, 4, 4))
        z_dim = 4
        vae = AutoencoderKLQwenImage(base_dim=z_dim * 6, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.0] * z_dim,
                                     latents_std=[1.0] * z_dim)
        config = Qwen2_5_VLConfig(
            text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 2,
                         "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         "rope_theta": 1000000.0, "vocab_size": len(tok)},
            vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": 16},
            hidden_size=16, vocab_size=len(tok), vision_start_token_id=len(tok) - 3,
            image_token_id=len(tok) - 2, video_token_id=len(tok) - 1)
        te = Qwen2_5_VLForConditionalGeneration(config)
        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=te,
                                 tokenizer=tok, transformer=transformer)
        pipe.save_pretrained(folder)
    gen = {"prompts": ["a blue square"], "seeds": [0], "height": 32, "width": 32, "steps": 3,
           "true_cfg_scale": 4.0, "negative_prompt": "blurry", "extra": {"max_sequence_length": 16}}
    return write_card(folder, "tiny_qwenimage", {"class": "QwenImagePipeline", "source": "diffusers"},
                      {"class": "QwenImageTransformer2DModel", "source": "diffusers"}, gen)


def tiny_thirdparty(root: Path) -> Path:
    folder = root / "tiny_thirdparty"
    src = root / "thirdparty_dit.py"
    src.write_text(THIRDPARTY_SRC)
    if not folder.exists():
        from diffusers import FlowMatchEulerDiscreteScheduler

        from ditbook.card import import_class

        torch.manual_seed(0)
        dit = import_class(str(src), "ThirdPartyDiT")()
        pipe = import_class(str(src), "ThirdPartyPipeline")(transformer=dit, scheduler=FlowMatchEulerDiscreteScheduler())
        pipe.save_pretrained(folder)
    gen = {"prompts": ["a green triangle"], "seeds": [0], "height": 32, "width": 32, "steps": 3,
           "true_cfg_scale": 4.0, "negative_prompt": "blurry"}
    return write_card(folder, "tiny_thirdparty", {"class": "ThirdPartyPipeline", "source": str(src)},
                      {"class": "ThirdPartyDiT", "source": str(src)}, gen)
