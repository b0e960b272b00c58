"""Blocks return a dict of their streams; the transformer returns a ModelOutput and the pipeline
reads ``.sample`` (it never passes ``return_dict=False``)."""
import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn


class DictBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(dim, 4 * dim)
        self.ln = nn.LayerNorm(dim, elementwise_affine=False)
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def heads_first(self, t):
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, image_tokens, text_tokens, cond):
        n_txt = text_tokens.shape[1]
        shift, scale, gate, gate_ff = self.mod(cond)[:, None].chunk(4, dim=-1)
        x = torch.cat([text_tokens, image_tokens], dim=1)
        h = self.ln(x) * (1 + scale) + shift
        q, k, v = (self.heads_first(p(h)) for p in (self.to_q, self.to_k, self.to_v))
        x = x + gate * self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        x = x + gate_ff * self.ff(self.ln(x))
        return {"image_tokens": x[:, n_txt:], "text_tokens": x[:, :n_txt]}


class DictOutputDiT(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=3, vocab=64, text_len=8):
        super().__init__()
        self.patchify = nn.Conv2d(in_channels, dim, 2, 2)
        self.embed_text = nn.Embedding(vocab, dim)
        self.embed_t = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DictBlock(dim, heads) for _ in range(depth)])
        self.unpatchify = nn.ConvTranspose2d(dim, in_channels, 2, 2)

    def forward(self, hidden_states, encoder_ids, timestep, return_dict=True):
        b, c, h, w = hidden_states.shape
        img = self.patchify(hidden_states).flatten(2).transpose(1, 2)
        txt = self.embed_text(encoder_ids)
        half = self.config.dim // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
        a = timestep.float()[:, None] * 1000 * f[None]
        cond = self.embed_t(torch.cat([a.cos(), a.sin()], dim=-1))
        for block in self.blocks:
            out = block(img, txt, cond)
            img, txt = out["image_tokens"], out["text_tokens"]
        sample = self.unpatchify(img.transpose(1, 2).reshape(b, -1, h // 2, w // 2))
        if not return_dict:
            return (sample,)
        return Transformer2DModelOutput(sample=sample)
