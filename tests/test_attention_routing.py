"""Attention routing per module: a ``TorchFunctionMode`` entered inside each routed attention
module's forward (wrapped through ``ditbook.hooks``) sends that module's SDPA calls to the redirect;
``torch.nn.functional.scaled_dot_product_attention`` itself is never rebound, and SDPA calls
elsewhere — an unrelated module in the same forward, another thread at the same time — are not
redirected. The context-parallel path (Ulysses, 2 gloo processes) is covered by
tests/test_parallel.py::test_thirdparty_derived_cp_plan."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from ditbook.hooks import WrapError, wrap_method, wrap_names
from ditbook.cp.attention import ROUTE_WRAP, route_attention

REAL_SDPA = F.scaled_dot_product_attention


class GQAAttention(torch.nn.Module):
    """Calls SDPA itself, with GQA (2 KV heads for 4 query heads)."""

    def __init__(self, dim=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.seen_sdpa: list[bool] = []  # was F.scaled_dot_product_attention the real one, at call time
        self.side = None  # something to run while this forward is in progress

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        self.seen_sdpa.append(torch.nn.functional.scaled_dot_product_attention is REAL_SDPA)
        if self.side is not None:
            self.side()
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, -1)


class PlainAttention(torch.nn.Module):
    """Unrelated: calls SDPA too, but is not part of the routed transformer."""

    def forward(self, x):
        q = x.unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q).squeeze(1)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = GQAAttention()
        self.mlp = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.mlp(self.attn(x))


class Transformer(torch.nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(depth)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _x():
    return torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(2))


def test_routed_modules_only_and_nothing_rebound():
    t = Transformer()
    other = PlainAttention()
    x = _x()
    ref, other_ref = t(x), other(x)
    route = route_attention(t)
    assert route.modules == ["blocks.0.attn", "blocks.1.attn"]
    out = t(x)
    assert route.calls == 2 and route.gqa_calls == 2 and route.cp_calls == 0
    torch.testing.assert_close(out, ref)
    assert all(b.attn.seen_sdpa == [True, True] for b in t.blocks)  # the real one, during the routed forward
    assert F.scaled_dot_product_attention is REAL_SDPA
    # an unrelated module called in the same program, before and after: not redirected
    torch.testing.assert_close(other(x), other_ref)
    assert route.calls == 2


def test_an_unrelated_module_in_another_thread_during_a_routed_forward_is_not_redirected():
    """A process-wide rebinding would send the other thread's SDPA call through the redirect."""
    t = Transformer(depth=1)
    other = PlainAttention()
    x = _x()
    results = []
    t.blocks[0].attn.side = lambda: (lambda th: (th.start(), th.join()))(
        threading.Thread(target=lambda: results.append(other(x))))
    route = route_attention(t)
    t(x)
    assert len(results) == 1 and route.calls == 1  # only the routed module's own call


def test_repeat_interleave_path_gives_the_same_result():
    t = Transformer()
    x = _x()
    ref = t(x)
    route = route_attention(t, gqa_path="repeat_interleave")
    torch.testing.assert_close(t(x), ref, rtol=1e-5, atol=1e-6)
    assert route.gqa_calls == 2


def test_remove_restores_every_module_exactly():
    t = Transformer()
    x = _x()
    ref = t(x)
    route = route_attention(t)
    assert all(wrap_names(b.attn) == [ROUTE_WRAP] for b in t.blocks)
    route.remove()
    for b in t.blocks:
        assert "forward" not in b.attn.__dict__ and b.attn.forward.__func__ is GQAAttention.forward
    assert torch.equal(t(x), ref) and route.calls == 0


def test_failing_half_way_leaves_the_transformer_as_it_was():
    t = Transformer(depth=3)
    wrap_method(t.blocks[2].attn, ROUTE_WRAP, lambda original, *a, **k: original(*a, **k))
    with pytest.raises(WrapError, match="already wrapped"):
        route_attention(t)
    assert "forward" not in t.blocks[0].attn.__dict__ and "forward" not in t.blocks[1].attn.__dict__
    assert wrap_names(t.blocks[2].attn) == [ROUTE_WRAP]


def test_a_caller_inside_a_routed_caller_is_routed_once():
    class Outer(torch.nn.Module):
        """Calls SDPA itself and holds another caller."""

        def __init__(self):
            super().__init__()
            self.inner = GQAAttention()

        def forward(self, x):
            q = x.unsqueeze(1)
            return self.inner(x) + F.scaled_dot_product_attention(q, q, q).squeeze(1)

    m = Outer()
    x = _x()
    ref = m(x)
    route = route_attention(m)
    assert route.modules == [""]  # the outer extent covers the inner call
    torch.testing.assert_close(m(x), ref)
    assert route.calls == 2  # each SDPA call redirected once, not twice


def test_routing_under_torch_compile():
    """Regional compile (as ``+compile`` does) of blocks whose attention is routed."""
    torch._dynamo.reset()
    t = Transformer(depth=1)
    x = _x()
    ref = t(x)
    route = route_attention(t)
    t.blocks[0].compile()
    torch.testing.assert_close(t(x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t(x), ref, rtol=1e-5, atol=1e-5)
    assert route.calls == 2 and route.gqa_calls == 2  # traced through, counted once per call
    assert F.scaled_dot_product_attention is REAL_SDPA
