"""Shapes no degree of two divides: 3 attention heads, 9 image tokens (a 3x3 patch grid),
5 text tokens; joint attention over text and image."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn


class OddBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ada = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb):
        n_txt = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        b, n, d = x.shape
        shift, scale = self.ada(temb)[:, None].chunk(2, dim=-1)
        q, k, v = self.qkv(self.norm(x) * (1 + scale) + shift).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        x = x + self.ff(self.norm(x))
        return x[:, :n_txt], x[:, n_txt:]


class OddShapeDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=24, heads=3, depth=3, vocab=61, text_len=5):
        super().__init__()
        self.patch = nn.Linear(4 * in_channels, dim)
        self.text = nn.Embedding(vocab, dim)
        self.temb = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.transformer_blocks = nn.ModuleList([OddBlock(dim, heads) for _ in range(depth)])
        self.unpatch = nn.Linear(dim, 4 * in_channels)

    def forward(self, hidden_states, encoder_ids, timestep, return_dict=True):
        b, c, h, w = hidden_states.shape
        x = self.patch(hidden_states.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c))
        ctx = self.text(encoder_ids)
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
        a = timestep.float()[:, None] * 1000 * f[None]
        temb = self.temb(torch.cat([a.cos(), a.sin()], dim=-1))
        for block in self.transformer_blocks:
            ctx, x = block(x, ctx, temb)
        out = self.unpatch(x).view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)
