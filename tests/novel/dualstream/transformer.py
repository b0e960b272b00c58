"""A two-stream DiT whose blocks take and return (txt, img) — text first — with joint attention."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


def timestep_features(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    ang = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


class JointBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.img_mod = nn.Linear(dim, 2 * dim)
        self.txt_mod = nn.Linear(dim, 2 * dim)
        self.img_qkv = nn.Linear(dim, 3 * dim)
        self.txt_qkv = nn.Linear(dim, 3 * dim)
        self.img_out = nn.Linear(dim, dim)
        self.txt_out = nn.Linear(dim, dim)
        self.img_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.txt_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, txt, img, vec):
        b, n_img, d = img.shape
        n_txt = txt.shape[1]
        i_shift, i_scale = self.img_mod(vec)[:, None].chunk(2, dim=-1)
        t_shift, t_scale = self.txt_mod(vec)[:, None].chunk(2, dim=-1)
        qkv = torch.cat([self.txt_qkv(self.norm(txt) * (1 + t_scale) + t_shift),
                         self.img_qkv(self.norm(img) * (1 + i_scale) + i_shift)], dim=1)
        q, k, v = qkv.view(b, n_txt + n_img, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n_txt + n_img, d)
        txt = txt + self.txt_out(out[:, :n_txt])
        img = img + self.img_out(out[:, n_txt:])
        txt = txt + self.txt_mlp(self.norm(txt))
        img = img + self.img_mlp(self.norm(img))
        return txt, img


class DualStreamDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=3, vocab=64, text_len=8):
        super().__init__()
        self.patch_in = nn.Linear(in_channels * 4, dim)
        self.text_table = nn.Embedding(vocab, dim)
        self.time_mlp = nn.Sequential(nn.Linear(32, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.layers = nn.ModuleList([JointBlock(dim, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(dim)
        self.patch_out = nn.Linear(dim, in_channels * 4)

    def forward(self, latents, text_ids, t):
        b, c, h, w = latents.shape
        img = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
        img = self.patch_in(img)
        txt = self.text_table(text_ids)
        vec = self.time_mlp(timestep_features(t, 32).to(img.dtype))
        for layer in self.layers:
            txt, img = layer(txt, img, vec)
        img = self.patch_out(self.final_norm(img))
        return img.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
