"""Tiny models for the cache tests (and tests of the loop fold itself).

``TinyGQATransformer`` is written like third-party code: GQA attention (4 query heads, 2 KV
heads), blocks called with keyword arguments named ``x`` / ``context`` (not diffusers' names),
returning ``(context, x)``, and a loop that does extra work per block (a per-block embedding
added to the conditioning and a learned gate on the output). ``TinyPipeline`` is a minimal
flow-matching pipeline around any transformer with ``(hidden_states, encoder_hidden_states,
timestep)``. Both are saved with ``save_pretrained`` so the real loading path runs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import ConfigMixin, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from torch import nn


class TinyGQAAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, kv_heads * self.head_dim)
        self.to_v = nn.Linear(dim, kv_heads * self.head_dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, joint):
        b, n, _ = joint.shape
        q = self.to_q(joint).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.to_k(joint).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.to_v(joint).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class TinyGQABlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.modulation = nn.Linear(dim, 2 * dim)
        self.attn = TinyGQAAttention(dim, heads, kv_heads)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, context, temb):
        shift, scale = self.modulation(temb).chunk(2, dim=-1)
        joint = torch.cat([context, self.norm(x) * (1 + scale[:, None]) + shift[:, None]], dim=1)
        out = self.attn(joint)
        context = context + out[:, : context.shape[1]]
        x = x + out[:, context.shape[1]:]
        x = x + self.ff(x)
        return context, x


@dataclass
class TinyOutput(BaseOutput):
    sample: torch.Tensor


class TinyGQATransformer(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 32, layers: int = 6, heads: int = 4, kv_heads: int = 2,
                 text_dim: int = 16, block_scale: float = 0.2):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.context_in = nn.Linear(text_dim, dim)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([TinyGQABlock(dim, heads, kv_heads) for _ in range(layers)])
        self.block_embed = nn.Parameter(torch.randn(layers, dim) * 0.1)
        self.gates = nn.Parameter(torch.full((layers,), 1.0))
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)
        with torch.no_grad():  # a calm model: blocks change the stream a little per step
            for blk in self.blocks:
                blk.attn.to_out.weight.mul_(block_scale)
                blk.ff[2].weight.mul_(block_scale)

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict: bool = True):
        x = self.proj_in(hidden_states)
        context = self.context_in(encoder_hidden_states)
        temb = self.time_embed(timestep.reshape(-1, 1).to(x.dtype))
        for i, block in enumerate(self.blocks):
            context, x = block(x=x, context=context, temb=temb + self.block_embed[i])
            x = x * self.gates[i]
        out = self.proj_out(self.norm_out(x))
        if not return_dict:
            return (out,)
        return TinyOutput(sample=out)


class TinyPipelineOutput(BaseOutput):
    images: np.ndarray


class TinyPipeline(DiffusionPipeline):
    """Flow matching over (tokens, channels) latents; a prompt is embedded by a seeded hash."""

    model_cpu_offload_seq = "transformer"

    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def embed(self, prompt: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        return torch.randn(1, 4, self.transformer.config.text_dim, generator=g)

    @torch.no_grad()
    def __call__(self, prompt: str = "", num_inference_steps: int = 8, height: int = 16, width: int = 16,
                 generator=None, output_type: str = "np"):
        c = self.transformer.config.in_channels
        h, w = height // 2, width // 2
        latents = torch.randn(1, h * w, c, generator=generator)
        context = self.embed(prompt)
        self.scheduler.set_timesteps(num_inference_steps)
        for t in self.progress_bar(self.scheduler.timesteps):
            v = self.transformer(hidden_states=latents, encoder_hidden_states=context,
                                 timestep=(t / 1000).expand(1)).sample
            latents = self.scheduler.step(v, t, latents).prev_sample
        img = torch.sigmoid(latents[..., :3]).reshape(1, h, w, 3)
        img = img.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
        return TinyPipelineOutput(images=img.float().numpy())


def build_tiny(folder, seed: int = 0, layers: int = 6):
    """Save a TinyPipeline with a TinyGQATransformer to ``folder`` and return the pipeline."""
    from ditbook.card import import_class

    # the classes as ditbook imports them from this file (the module name saved in
    # model_index.json must be the one a fresh process gets when it loads the card)
    transformer_cls = import_class(__file__, "TinyGQATransformer")
    pipeline_cls = import_class(__file__, "TinyPipeline")
    torch.manual_seed(seed)
    pipe = pipeline_cls(transformer_cls(layers=layers), FlowMatchEulerDiscreteScheduler())
    pipe.save_pretrained(folder)
    return pipe


def test_fold_plan_reads_the_loop():
    from ditbook.adapter.loopfold import plan_fold

    fold = plan_fold(TinyGQATransformer, "blocks")
    assert fold.block_var == "block" and fold.index_var == "i"
    assert fold.carried == ["x", "context"]  # order of the block call's arguments
    assert set(fold.inputs) == {"temb"}
    assert fold.extra_statements == 1 and fold.keyword_call
    assert fold.pattern == "Pattern_0"
