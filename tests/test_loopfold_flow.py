"""Issue 23: a block loop with ``continue`` (diffusers' WanAnimate2 skips one block of the
unconditional pass) or ``break``. A cached unit runs every block of its list, so before, the
adapter refused the list ("uses continue: a cached unit cannot stop early"); now the loop is
folded and each block's loop body returns its carried names where the loop would ``continue``
(after a ``break`` every later block returns them unchanged). Caching off must equal the plain
forward exactly, the skipped block must really be skipped, and caching on must skip work."""

from __future__ import annotations

import ast

from test_integration_mechanisms import Base, run

from ditbook.adapter.loopfold import FoldError, loop_body_source, plan_fold
from ditbook.arch.loop_source import list_uses, own_flow_nodes

import pytest


class SkipsOne(Base):
    """Block 1 is skipped on every call (the default), the others run."""

    def forward(self, hidden_states, timestep, skip_index: int = 1, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for i, block in enumerate(self.blocks):
            if i == skip_index:
                continue
            x = block(x, temb) * self.gates[i]
        return (self.proj_out(self.norm_out(x)),)


class SkipsCounted(Base):
    """A counter the blocks read (a control name, computed before the loop) is not advanced on
    the skipped block: the precomputed values must skip it too."""

    def forward(self, hidden_states, timestep, skip_index: int = 0, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        k = 0
        for i, block in enumerate(self.blocks):
            if i == skip_index:
                continue
            x = block(x, temb) * (1 + 0.25 * k)
            k = k + 1
        return (self.proj_out(self.norm_out(x)) * k,)


class Breaks(Base):
    """Work after the block call is skipped on the block that breaks; later blocks never run."""

    def forward(self, hidden_states, timestep, stop_after: int = 1, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for i, block in enumerate(self.blocks):
            x = block(x, temb)
            if i >= stop_after:
                break
            x = x * 1.5
        return (self.proj_out(self.norm_out(x)),)


class NestedContinue(Base):
    """The ``continue`` belongs to a loop nested in the body: not the block loop's own."""

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            x = block(x, temb)
            for j in range(3):
                if j == 1:
                    continue
                x = x * 0.9
        return (self.proj_out(self.norm_out(x)),)


class Returns(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            x = block(x, temb)
            if x.abs().max() > 1e9:
                return (x,)
        return (self.proj_out(self.norm_out(x)),)


def _evals(row) -> tuple[int, int]:
    skipped, total = (int(v) for v in row.skipped.split(" of "))
    return skipped, total


@pytest.mark.parametrize("cls,flow", [(SkipsOne, ["continue"]), (SkipsCounted, ["continue"]), (Breaks, ["break"])])
def test_loop_with_continue_or_break_is_folded_and_exact(cls, flow):
    # before: refused at the adapter ("the loop over self.blocks uses continue: a cached unit
    # cannot stop early") and plan_fold raised "uses break/continue/return/else"
    assert list_uses(cls, ["blocks"])["blocks"].unsafe() == ""
    assert plan_fold(cls, "blocks").flow == flow
    row = run(cls)
    assert row.outcome == "correct" and row.folded, (row.outcome, row.stage, row.reason)
    assert row.off_max_abs <= 1e-5
    skipped, total = _evals(row)
    # 3 blocks x 6 steps, one block never evaluated per step (skipped by the loop itself)
    assert total == 12 and 0 < skipped < total


def test_continue_becomes_a_return_of_the_carried_names():
    src = loop_body_source(plan_fold(SkipsOne, "blocks"))
    fn = ast.parse(src).body[0]
    assert not any(isinstance(n, ast.Continue) for n in ast.walk(fn))
    early = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    assert len(early) == 2 and all(ast.unparse(r.value) == "x" for r in early)


def test_a_nested_loops_continue_is_its_own():
    loop = next(n for n in ast.walk(ast.parse(
        "for b in self.blocks:\n    for j in range(3):\n        if j:\n            continue\n"
        "    else:\n        break\n")) if isinstance(n, ast.For))
    # the inner loop's continue is its own; its else clause's break acts on the block loop
    assert [type(n).__name__ for n in own_flow_nodes(loop.body)] == ["Break"]
    fold = plan_fold(NestedContinue, "blocks")
    assert fold.flow == [] and "continue" in loop_body_source(fold)
    row = run(NestedContinue)
    assert row.outcome == "correct" and row.off_max_abs <= 1e-5, (row.outcome, row.reason)


def test_return_inside_the_loop_is_still_refused():
    assert "uses return" in list_uses(Returns, ["blocks"])["blocks"].unsafe()
    with pytest.raises(FoldError, match="uses return"):
        plan_fold(Returns, "blocks")
    row = run(Returns)
    assert row.outcome == "refused" and "cannot stop early" in row.reason, (row.outcome, row.reason)
