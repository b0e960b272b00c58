"""Hierarchical DiT: the blocks live in ``stages[i].blocks``; the Stage containers are never called —
the transformer's forward walks them (``for stage in self.stages: for blk in stage.blocks``)."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


class CrossBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ada = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_c, self.kv_c = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.proj, self.proj_c = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def split(self, t):
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x, cond, emb):
        shift, scale, gate = self.ada(emb)[:, None].chunk(3, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        q, k, v = (self.split(t) for t in self.qkv(h).chunk(3, dim=-1))
        x = x + gate * self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        kc, vc = (self.split(t) for t in self.kv_c(cond).chunk(2, dim=-1))
        x = x + self.proj_c(F.scaled_dot_product_attention(self.split(self.q_c(self.norm(x))), kc, vc).transpose(1, 2).flatten(2))
        return x + self.ff(self.norm(x))


class Stage(nn.Module):
    """A container: holds a stage's blocks, has no forward of its own."""

    def __init__(self, dim, heads, depth):
        super().__init__()
        self.blocks = nn.ModuleList([CrossBlock(dim, heads) for _ in range(depth)])


class StagedDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, stage_depths=(2, 2), vocab=64, text_len=8):
        super().__init__()
        self.embed = nn.Conv2d(in_channels, dim, kernel_size=2, stride=2)
        self.words = nn.Embedding(vocab, dim)
        self.t_proj = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.stages = nn.ModuleList([Stage(dim, heads, d) for d in stage_depths])
        self.out_norm = nn.LayerNorm(dim)
        self.unembed = nn.Linear(dim, in_channels * 4)

    def time_embedding(self, t):
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        a = t.float()[:, None] * 1000 * f[None]
        return self.t_proj(torch.cat([a.sin(), a.cos()], dim=-1))

    def forward(self, sample, tokens, timestep):
        b, c, h, w = sample.shape
        x = self.embed(sample).flatten(2).transpose(1, 2)
        cond = self.words(tokens)
        emb = self.time_embedding(timestep)
        for stage in self.stages:
            for blk in stage.blocks:
                x = blk(x, cond, emb)
        x = self.unembed(self.out_norm(x))
        return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
