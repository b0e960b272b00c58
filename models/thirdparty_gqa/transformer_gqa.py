"""GQATransformer2DModel — an example of a user's own diffusion transformer, not part of diffusers.

It stands for the code a user brings: a diffusers ``ModelMixin, ConfigMixin`` subclass (so
``from_pretrained`` / ``save_pretrained`` work) with choices diffusers' own models do not make:

* grouped-query attention (GQA): 8 query heads share 2 key/value heads, in self attention over
  the image tokens and in cross attention to the text tokens (``scaled_dot_product_attention``
  with ``enable_gqa=True``);
* image tokens attend to the text by **cross attention** (text tokens are not updated), each
  block being: adaLN-modulated self attention -> cross attention -> adaLN-modulated MLP;
* blocks take **keyword-only** arguments, and the transformer's block loop does extra work per
  iteration: it adds a learned per-block-index embedding to ``hidden_states`` before each block.

Shapes: latents (B, C, H, W) -> patches (B, N, D); text (B, L, text_dim); timestep (B,) in [0, 1].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


def sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(N,) positions -> (N, dim) sine/cosine features."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=positions.device) / (dim // 2))
    angles = positions.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def sincos_2d(height: int, width: int, dim: int, device) -> torch.Tensor:
    """Fixed 2D position embedding (height*width, dim): half the channels for rows, half for columns."""
    ys, xs = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    return torch.cat([sincos_1d(ys.flatten(), dim // 2), sincos_1d(xs.flatten(), dim // 2)], dim=-1)


class GQAAttention(nn.Module):
    """Multi-head attention with fewer key/value heads than query heads."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, kv_dim: int | None = None):
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dim // num_heads
        kv_dim = kv_dim or dim
        self.to_q = nn.Linear(dim, num_heads * self.head_dim)
        self.to_k = nn.Linear(kv_dim, num_kv_heads * self.head_dim)
        self.to_v = nn.Linear(kv_dim, num_kv_heads * self.head_dim)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.to_out = nn.Linear(num_heads * self.head_dim, dim)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = hidden_states if context is None else context
        b, n, _ = hidden_states.shape
        q = self.norm_q(self.to_q(hidden_states).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.norm_k(self.to_k(context).view(b, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.to_v(context).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # (b, heads, n, head_dim)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class GQABlock(nn.Module):
    """adaLN self attention (GQA) -> cross attention to text (GQA) -> adaLN MLP."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, text_dim: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = GQAAttention(dim, num_heads, num_kv_heads)
        self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = GQAAttention(dim, num_heads, num_kv_heads, kv_dim=text_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.modulation = nn.Linear(dim, 6 * dim)

    def forward(self, *, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(temb))[:, None].chunk(6, dim=-1)
        x = self.norm1(hidden_states) * (1 + scale1) + shift1
        hidden_states = hidden_states + gate1 * self.attn(x)
        hidden_states = hidden_states + self.cross_attn(self.norm_cross(hidden_states), context=encoder_hidden_states)
        x = self.norm2(hidden_states) * (1 + scale2) + shift2
        return hidden_states + gate2 * self.mlp(x)


class GQATransformer2DModel(ModelMixin, ConfigMixin):
    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(
        self,
        in_channels: int = 4,
        patch_size: int = 2,
        hidden_size: int = 64,
        num_layers: int = 4,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 2,
        text_dim: int = 32,
        mlp_ratio: float = 2.0,
    ):
        super().__init__()
        self.patch_embed = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.time_embed = nn.Sequential(nn.Linear(256, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.text_pool = nn.Linear(text_dim, hidden_size)
        self.block_embed = nn.Embedding(num_layers, hidden_size)
        self.blocks = nn.ModuleList(
            [GQABlock(hidden_size, num_attention_heads, num_key_value_heads, text_dim, mlp_ratio) for _ in range(num_layers)]
        )
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.modulation_out = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj_out = nn.Linear(hidden_size, patch_size * patch_size * in_channels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        return_dict: bool = True,
    ):
        b, c, h, w = hidden_states.shape
        p = self.config.patch_size
        x = self.patch_embed(hidden_states).flatten(2).transpose(1, 2)  # (b, n, d)
        x = x + sincos_2d(h // p, w // p, x.shape[-1], x.device).to(x.dtype)[None]
        t = sincos_1d(timestep * 1000.0, 256).to(x.dtype)
        temb = self.time_embed(t) + self.text_pool(encoder_hidden_states.mean(dim=1))

        for index, block in enumerate(self.blocks):
            # extra work in the loop: a learned embedding of the block's index
            x = x + self.block_embed.weight[index]
            x = block(hidden_states=x, encoder_hidden_states=encoder_hidden_states, temb=temb)

        shift, scale = self.modulation_out(F.silu(temb))[:, None].chunk(2, dim=-1)
        x = self.proj_out(self.norm_out(x) * (1 + scale) + shift)  # (b, n, p*p*c)
        x = x.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        if not return_dict:
            return (x,)
        return Transformer2DModelOutput(sample=x)
