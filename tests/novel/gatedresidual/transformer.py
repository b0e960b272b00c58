"""Blocks return only their residual branch; the loop adds it to the running tensor with a learned
per-block gate: ``x = x + g[i] * blk(x, t)``."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


class ResidualBranch(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.film = nn.Linear(dim, 2 * dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, t):
        b, n, d = x.shape
        gamma, beta = self.film(t)[:, None].chunk(2, dim=-1)
        h = self.norm(x) * (1 + gamma) + beta
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return a + self.ff(h + a)


class GatedResidualDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=4, vocab=64, text_len=8):
        super().__init__()
        self.inp = nn.Linear(4 * in_channels, dim)
        self.txt = nn.Embedding(vocab, dim)
        self.tm = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([ResidualBranch(dim, heads) for _ in range(depth)])
        self.g = nn.Parameter(torch.full((depth,), 0.5))
        self.outp = nn.Linear(dim, 4 * in_channels)

    def forward(self, latents, text_ids, timestep):
        b, c, h, w = latents.shape
        x = self.inp(latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c))
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
        a = timestep.float()[:, None] * 1000 * f[None]
        t = self.tm(torch.cat([a.cos(), a.sin()], dim=-1)) + self.txt(text_ids).mean(dim=1)
        for i, blk in enumerate(self.blocks):
            x = x + self.g[i] * blk(x, t)
        x = self.outp(x)
        return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
