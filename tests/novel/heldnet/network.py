"""A plain ``nn.Module`` network as reference repositories write it (no diffusers base class): a
dual-stream list over (img, txt), a single-stream list over the joined tokens, attention through a
plain function ``attend`` (no attention module)."""
import torch
import torch.nn.functional as F
from torch import nn


def attend(q, k, v, heads):
    b, n, d = q.shape
    q, k, v = (t.view(b, -1, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class DualBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv_img, self.qkv_txt = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out_img, self.out_txt = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, img, txt, vec):
        scale, shift = self.mod(vec)[:, None].chunk(2, dim=-1)
        qi, ki, vi = self.qkv_img(self.norm(img) * (1 + scale) + shift).chunk(3, dim=-1)
        qt, kt, vt = self.qkv_txt(self.norm(txt)).chunk(3, dim=-1)
        out = attend(torch.cat([qt, qi], 1), torch.cat([kt, ki], 1), torch.cat([vt, vi], 1), self.heads)
        txt = txt + self.out_txt(out[:, : txt.shape[1]])
        img = img + self.out_img(out[:, txt.shape[1]:])
        return img + self.mlp(self.norm(img)), txt


class JoinedBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, vec):
        x = x + self.out(attend(*self.qkv(self.norm(x) + vec[:, None]).chunk(3, dim=-1), self.heads))
        return x + self.mlp(self.norm(x))


class TinyMMNet(nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=4, depth=2, depth_joined=2, vocab=64, tokens=16):
        super().__init__()
        self.img_in, self.words = nn.Linear(in_channels, dim), nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.1)
        self.time_in = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.dual = nn.ModuleList([DualBlock(dim, heads) for _ in range(depth)])
        self.joined = nn.ModuleList([JoinedBlock(dim, heads) for _ in range(depth_joined)])
        self.final = nn.Linear(dim, in_channels)

    def forward(self, img, tokens, t):
        img, txt = self.img_in(img) + self.pos[:, : img.shape[1]], self.words(tokens)
        vec = self.time_in(t[:, None])
        for block in self.dual:
            img, txt = block(img=img, txt=txt, vec=vec)
        x = torch.cat([txt, img], 1)
        for block in self.joined:
            x = block(x, vec=vec)
        return self.final(x[:, txt.shape[1]:])
