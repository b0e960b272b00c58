"""A cross-attention DiT with learned register tokens (prepended before the blocks, dropped after)
and grouped-query self attention (4 query heads, 2 key/value heads)."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn


class GQABlock(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.mod = nn.Linear(dim, 3 * dim)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(dim, elementwise_affine=False) for _ in range(3))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = nn.Linear(dim, dim)
        self.cq, self.ckv, self.co = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb):
        b, n, d = hidden_states.shape
        shift, scale, gate = self.mod(temb)[:, None].chunk(3, dim=-1)
        h = self.norm1(hidden_states) * (1 + scale) + shift
        q = self.q(h).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        x = hidden_states + gate * self.o(a.transpose(1, 2).reshape(b, n, d))
        cq = self.cq(self.norm2(x)).view(b, n, self.heads, self.hd).transpose(1, 2)
        ck, cv = self.ckv(encoder_hidden_states).view(b, -1, 2, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        x = x + self.co(F.scaled_dot_product_attention(cq, ck, cv).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm3(x))


class RegisterDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, kv_heads=2, depth=3, num_registers=2, vocab=64, text_len=8):
        super().__init__()
        self.x_embed = nn.Linear(4 * in_channels, dim)
        self.register_tokens = nn.Parameter(torch.randn(1, num_registers, dim) * 0.02)
        self.caption = nn.Embedding(vocab, dim)
        self.t_embed = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.transformer_blocks = nn.ModuleList([GQABlock(dim, heads, kv_heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4 * in_channels)

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict=True):
        b, c, h, w = hidden_states.shape
        x = self.x_embed(hidden_states.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c))
        x = torch.cat([self.register_tokens.expand(b, -1, -1), x], dim=1)
        ctx = self.caption(encoder_hidden_states)
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
        a = timestep.float()[:, None] * 1000 * f[None]
        temb = self.t_embed(torch.cat([a.cos(), a.sin()], dim=-1))
        for block in self.transformer_blocks:
            x = block(x, ctx, temb)
        x = self.proj_out(self.norm_out(x[:, self.config.num_registers:]))
        out = x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)
