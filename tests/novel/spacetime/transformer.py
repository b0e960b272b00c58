"""A video DiT with space-time factorized attention: each block reshapes the (B, F*N, D) tokens to
frames for spatial attention, then to per-location sequences for temporal attention."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


class FactorizedBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n_s, self.n_t, self.n_c, self.n_f = (nn.LayerNorm(dim) for _ in range(4))
        self.qkv_s, self.qkv_t = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.o_s, self.o_t = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_c, self.kv_c, self.o_c = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mod = nn.Linear(dim, 2 * dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def attend(self, x, qkv, out):
        b, n, d = x.shape
        q, k, v = qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))

    def forward(self, hidden_states, context, temb, frames):
        b, fn, d = hidden_states.shape
        n = fn // frames
        shift, scale = self.mod(temb)[:, None].chunk(2, dim=-1)
        x = hidden_states * (1 + scale) + shift
        s = x.reshape(b * frames, n, d)                                   # spatial: tokens of one frame
        s = s + self.attend(self.n_s(s), self.qkv_s, self.o_s)
        t = s.reshape(b, frames, n, d).transpose(1, 2).reshape(b * n, frames, d)   # temporal: one location
        t = t + self.attend(self.n_t(t), self.qkv_t, self.o_t)
        x = t.reshape(b, n, frames, d).transpose(1, 2).reshape(b, fn, d)
        hd = d // self.heads
        q = self.q_c(self.n_c(x)).view(b, fn, self.heads, hd).transpose(1, 2)
        k, v = self.kv_c(context).view(b, -1, 2, self.heads, hd).permute(2, 0, 3, 1, 4)
        x = x + self.o_c(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, fn, d))
        return x + self.ff(self.n_f(x))


class SpaceTimeDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=2, vocab=64, text_len=8):
        super().__init__()
        self.patch = nn.Linear(4 * in_channels, dim)
        self.frame_pos = nn.Parameter(torch.zeros(1, 8, 1, dim))
        self.text = nn.Embedding(vocab, dim)
        self.temb = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([FactorizedBlock(dim, heads) for _ in range(depth)])
        self.unpatch = nn.Linear(dim, 4 * in_channels)

    def forward(self, video_latents, text_ids, timestep):
        b, c, f, h, w = video_latents.shape
        x = video_latents.permute(0, 2, 1, 3, 4).reshape(b, f, c, h // 2, 2, w // 2, 2)
        x = x.permute(0, 1, 3, 5, 2, 4, 6).reshape(b, f, h * w // 4, 4 * c)
        x = (self.patch(x) + self.frame_pos[:, :f]).reshape(b, f * h * w // 4, -1)
        ctx = self.text(text_ids)
        half = self.config.dim // 2
        fr = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
        a = timestep.float()[:, None] * 1000 * fr[None]
        temb = self.temb(torch.cat([a.cos(), a.sin()], dim=-1))
        for block in self.blocks:
            x = block(x, ctx, temb, f)
        x = self.unpatch(x).view(b, f, h // 2, w // 2, c, 2, 2)
        return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)
