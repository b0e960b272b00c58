"""One block list, several mode methods: ``forward_text_to_image`` and ``forward_edit`` each loop
``self.blocks``; ``forward`` calls exactly one of them per call (an edit when a reference latent is given)."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb):
        n_txt = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        b, n, d = x.shape
        shift, scale = self.mod(temb)[:, None].chunk(2, dim=-1)
        q, k, v = self.qkv(self.norm(x) * (1 + scale) + shift).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        x = x + self.mlp(self.norm(x))
        return x[:, n_txt:], x[:, :n_txt]


class MultiModeDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=3, vocab=64, text_len=8):
        super().__init__()
        self.patch = nn.Linear(4 * in_channels, dim)
        self.ref_patch = nn.Linear(4 * in_channels, dim)
        self.text = nn.Embedding(vocab, dim)
        self.temb = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.unpatch = nn.Linear(dim, 4 * in_channels)

    def tokens(self, lat):
        b, c, h, w = lat.shape
        return lat.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)

    def embed_time(self, t):
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        a = t.float()[:, None] * 1000 * f[None]
        return self.temb(torch.cat([a.cos(), a.sin()], dim=-1))

    def forward_text_to_image(self, x, ctx, temb):
        for blk in self.blocks:
            x, ctx = blk(x, ctx, temb)
        return x

    def forward_edit(self, x, ref, ctx, temb):
        ctx = torch.cat([ctx, ref], dim=1)
        for blk in self.blocks:
            x, ctx = blk(x, ctx, temb)
        return x

    def forward(self, latents, text_ids, timestep, reference=None):
        b, c, h, w = latents.shape
        x = self.patch(self.tokens(latents))
        ctx, temb = self.text(text_ids), self.embed_time(timestep)
        if reference is None:
            x = self.forward_text_to_image(x, ctx, temb)
        else:
            x = self.forward_edit(x, self.ref_patch(self.tokens(reference)), ctx, temb)
        x = self.unpatch(x)
        return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
