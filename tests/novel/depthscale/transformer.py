"""A DiT that reads ``len(self.blocks)`` outside its block loop: the skip-branch scale depends on
depth, and the mid-depth feature is kept for the output head."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.n2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb):
        b, n, d = hidden_states.shape
        s1, c1, g1, s2, c2, g2 = self.adaLN(temb)[:, None].chunk(6, dim=-1)
        h = torch.cat([encoder_hidden_states, self.n1(hidden_states) * (1 + c1) + s1], dim=1)
        q, k, v = self.qkv(h).view(b, h.shape[1], 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h.shape[1], d)
        x = hidden_states + g1 * self.proj(a[:, encoder_hidden_states.shape[1]:])
        return x + g2 * self.mlp(self.n2(x) * (1 + c2) + s2)


class DepthScaledDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=4, vocab=64, text_len=8):
        super().__init__()
        self.x_in = nn.Linear(in_channels * 4, dim)
        self.txt_in = nn.Embedding(vocab, dim)
        self.t_in = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.head = nn.Linear(dim, in_channels * 4)

    def forward(self, hidden_states, text_ids, timestep, return_dict=True):
        b, c, h, w = hidden_states.shape
        x = hidden_states.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        x = self.x_in(x)
        ctx = self.txt_in(text_ids)
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
        a = timestep.float()[:, None] * 1000 * f[None]
        temb = self.t_in(torch.cat([a.cos(), a.sin()], dim=-1))
        skip_scale = 1.0 / math.sqrt(len(self.blocks))
        x_in = x
        for block in self.blocks:
            x = block(x, ctx, temb)
        x = x + skip_scale * x_in
        out = self.head(F.layer_norm(x, (x.shape[-1],)))
        out = out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)
