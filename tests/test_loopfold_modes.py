"""Issue 23: one block list looped in several mode methods (diffusers' AnyFlowFAR: ``forward``
returns ``self._forward_cache(...)``, ``self._forward_inference(...)`` or ``self._forward_train(...)``,
chosen by early returns, not by one ``if``/``else``), and block calls that hand each block its own
argument (``kv_cache[index_block]``).

Before: the three loops counted as three loops over the list (only different branches of one
``if`` counted as exclusive), so the adapter refused; and a per-block argument to blocks whose
streams are named as cache-dit's did not force a fold, so the cached unit got the first block's
argument for every block (caching off differed from the plain forward). Now the methods are
exclusive by their returns (``Flow.never_both``), every mode's loop is folded with its own loop
body (``LoopFold.modes``, ``_loop_mode``), and per-block arguments force the fold."""

from __future__ import annotations

import ast

import pytest
import torch
from test_integration_mechanisms import Base, Block, run
from torch import nn

from cache_harness import cache_check
from ditbook.adapter.loopfold import plan_fold
from ditbook.arch.loop_source import Flow, list_uses


class HBlock(Block):
    """Streams named as cache-dit passes them: no renaming fold is needed."""

    def forward(self, hidden_states, temb):
        return super().forward(hidden_states, temb)


class HBase(Base):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks = nn.ModuleList([HBlock(self.config.dim) for _ in range(self.config.num_layers)])


class PerBlockArgument(HBase):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        tembs = [temb * (i + 1) for i in range(len(self.blocks))]
        for i, block in enumerate(self.blocks):
            x = block(x, tembs[i])
        return (self.proj_out(self.norm_out(x)),)


class ModeMethods(HBase):
    """Three modes, dispatched by early returns; two pass per-block arguments."""

    def _forward_train(self, x, temb):
        for block in self.blocks:
            x = block(x, temb)
        return x

    def _forward_scaled(self, x, temb, scales):
        for index_block, block in enumerate(self.blocks):
            x = block(x, temb * scales[index_block])
        return x

    def _forward_gated(self, x, temb):
        for index_block, block in enumerate(self.blocks):
            x = block(x, temb + self.gates[index_block])
        return x

    def forward(self, hidden_states, timestep, scales=None, gated: bool = False, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        if scales is not None:
            if gated:
                return (self.proj_out(self._forward_gated(x, temb)),)
            return (self.proj_out(self._forward_scaled(x, temb, scales)),)
        return (self.proj_out(self._forward_train(x, temb)),)


def _inputs(**extra):
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(1, 8, 8, generator=g), "timestep": torch.tensor([500.0]), **extra}


def test_per_block_argument_forces_the_fold():
    # before: not folded (no extra statement, streams named hidden_states), caching off max abs 0.45
    assert plan_fold(PerBlockArgument, "blocks").per_block_args == ["tembs[i]"]
    row = run(PerBlockArgument)
    assert row.outcome == "correct" and row.folded and row.off_max_abs <= 1e-5, (row.outcome, row.reason)


def test_mode_methods_dispatched_by_returns_are_exclusive():
    u = list_uses(ModeMethods, ["blocks"])["blocks"]
    assert len(u.loops) == 3 and u.exclusive and u.unsafe() == "", (u.loops, u.unsafe())
    fold = plan_fold(ModeMethods, "blocks")
    assert sorted(v.method for v in fold.variants) == ["_forward_gated", "_forward_scaled", "_forward_train"]


@pytest.mark.parametrize("extra", [{}, {"scales": torch.tensor([0.5, 1.0, 2.0])},
                                   {"scales": torch.tensor([1.0, 1.0, 1.0]), "gated": True}])
def test_every_mode_is_folded_and_exact(extra):
    # before: refused ("the code loops over self.blocks 3 times")
    row = cache_check(ModeMethods, _inputs(**extra))
    assert row.outcome == "correct" and row.folded, (row.outcome, row.stage, row.reason)
    assert row.off_max_abs <= 1e-5
    skipped, total = (int(v) for v in row.skipped.split(" of "))
    assert 0 < skipped < total


def _calls(src: str):
    fn = ast.parse(src).body[0]
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return Flow(fn), sorted(calls, key=lambda c: c.func.attr)


@pytest.mark.parametrize("src,exclusive", [
    ("def f(self, c):\n    if c:\n        return self._a()\n    return self._b()\n", True),
    ("def f(self, c):\n    if c:\n        if c > 1:\n            return self._a()\n        return self._b()\n", True),
    ("def f(self, c):\n    if c:\n        self._a()\n    return self._b()\n", False),
    ("def f(self):\n    return self._a() + self._b()\n", False),
    ("def f(self, c):\n    if self._a():\n        return 1\n    return self._b()\n", False),
    ("def f(self, xs):\n    for x in xs:\n        if x:\n            return self._a()\n        self._b()\n", False),
    ("def f(self, c):\n    try:\n        return self._a()\n    finally:\n        self._b()\n", False),
])
def test_flow_never_both(src, exclusive):
    flow, (a, b) = _calls(src)
    assert flow.never_both(a, b) is exclusive


class ModesInOneMethod(HBase):
    """Two exclusive loops of one method (an early return) with different bodies."""

    def forward(self, hidden_states, timestep, scales=None, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        if scales is not None:
            for i, block in enumerate(self.blocks):
                x = block(x, temb * scales[i])
            return (self.proj_out(x),)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(x),)


def test_different_exclusive_loops_of_one_method_are_refused_not_folded_as_one():
    # exclusive by the return, but one fold would give both loops the first loop's body
    assert list_uses(ModesInOneMethod, ["blocks"])["blocks"].exclusive
    with pytest.raises(Exception, match="different loop bodies"):
        plan_fold(ModesInOneMethod, "blocks")
    row = cache_check(ModesInOneMethod, _inputs(scales=torch.tensor([0.5, 1.0, 2.0])))
    assert row.outcome == "refused", (row.outcome, row.reason)
