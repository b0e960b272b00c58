"""The SD3.5-reference shape: the user's ModelMixin holds the network (``self.model``) and a sampler's
entry ``apply_model`` (sigma -> timestep, output -> denoised) that ``forward`` only hands every
argument to; the network's loop carries the text first (``context, x = block(context, x, c=c)``), its
blocks do joint attention through a plain function, and the last block returns no text (``None``)."""
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


def joint_attention(q, k, v, heads):
    b, n, d = q.shape
    q, k, v = (t.view(b, -1, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class JointBlock(nn.Module):
    def __init__(self, dim, heads, last=False):
        super().__init__()
        self.heads, self.last = heads, last
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.mod = nn.Linear(dim, 2 * dim)
        self.qkv_c, self.qkv_x = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out_c, self.out_x = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, *args, **kwargs):
        context, x = args
        scale, shift = self.mod(kwargs["c"])[:, None].chunk(2, dim=-1)
        qc, kc, vc = self.qkv_c(self.norm(context)).chunk(3, dim=-1)
        qx, kx, vx = self.qkv_x(self.norm(x) * (1 + scale) + shift).chunk(3, dim=-1)
        out = joint_attention(torch.cat([qc, qx], 1), torch.cat([kc, kx], 1), torch.cat([vc, vx], 1), self.heads)
        x = x + self.out_x(out[:, context.shape[1]:])
        x = x + self.mlp(self.norm(x))
        return (None if self.last else context + self.out_c(out[:, : context.shape[1]])), x


class TextFirstNet(nn.Module):
    def __init__(self, channels=4, dim=32, heads=4, depth=3, text_dim=16, tokens=16):
        super().__init__()
        self.x_in, self.c_in = nn.Linear(channels, dim), nn.Linear(text_dim, dim)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.1)
        self.t_in = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.joint_blocks = nn.ModuleList([JointBlock(dim, heads, last=i == depth - 1) for i in range(depth)])
        self.final = nn.Linear(dim, channels)

    def forward(self, x, t, context):
        x, context = self.x_in(x) + self.pos[:, : x.shape[1]], self.c_in(context)
        c = self.t_in(t[:, None])
        for block in self.joint_blocks:
            context, x = block(context, x, c=c)
        return self.final(x)


class TextFirstTransformer(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, channels=4, dim=32, heads=4, depth=3, text_dim=16, tokens=16):
        super().__init__()
        self.model = TextFirstNet(channels, dim, heads, depth, text_dim, tokens)

    def apply_model(self, x, sigma, context):
        return x - self.model(x, sigma * 1000, context) * sigma[:, None, None]

    def forward(self, *args, **kwargs):
        return self.apply_model(*args, **kwargs)
