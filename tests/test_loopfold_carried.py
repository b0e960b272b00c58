"""Issue 13: a block loop that carries a second name which is not a tensor but is computed from
the stream (``level = float(x.abs().mean())``, ``k = k + int(x.max() > 1)``, ``means = means +
[x.mean()]``). Folded, cache-dit takes that name for the encoder stream and crashed in its cached
blocks (``'float' object has no attribute 'contiguous'``); the adapter now refuses the list with
the name and the statement. A carried tensor accumulated from the stream is still folded."""

from __future__ import annotations

import math

import pytest
from test_integration_mechanisms import Base, run

from ditbook.adapter.loopfold import FoldError, plan_fold


class LevelFromStream(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        level = 1.0
        for block in self.blocks:
            x = block(x, temb) * level
            level = float(x.abs().mean()) * 0.5 + 0.5
        return (self.proj_out(self.norm_out(x)),)


class CountFromStream(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        big = 0
        for block in self.blocks:
            x = block(x, temb)
            big = big + int(x.abs().max() > 1)
        return (self.proj_out(self.norm_out(x)) * (big + 1),)


class ListFromStream(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        means = []
        for block in self.blocks:
            x = block(x, temb)
            means = means + [x.mean()]
        return (self.proj_out(self.norm_out(x)) + sum(means),)


class LevelThroughMath(Base):
    """The source cannot tell that ``math.exp`` of a 0-d tensor gives a float: folded, and the
    adapter's run-time guard names it."""

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        level = 1.0
        for block in self.blocks:
            x = block(x, temb) * level
            level = math.exp(-x.abs().mean())
        return (self.proj_out(self.norm_out(x)),)


class TensorFromStream(Base):
    """The second carried name is a tensor (a running sum of the block outputs): foldable."""

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        total = x * 0
        for block in self.blocks:
            x = block(x, temb)
            total = total + x * 0.1
        return (self.proj_out(self.norm_out(x + total)),)


@pytest.mark.parametrize("cls,name,kind", [(LevelFromStream, "level", "a float"),
                                           (CountFromStream, "big", "an int"),
                                           (ListFromStream, "means", "a list")])
def test_non_tensor_carried_from_the_stream_is_refused_with_its_name(cls, name, kind):
    # before: plan_fold folded it (carried [x, name], Pattern_0) and cache-dit crashed in the
    # caching-off run: "'float' object has no attribute 'contiguous'" (a crash row)
    with pytest.raises(FoldError, match=f"carries '{name}'.*makes {kind}, not a tensor"):
        plan_fold(cls, "blocks")
    row = run(cls)
    assert row.outcome == "refused" and row.stage == "adapter", (row.outcome, row.reason)
    # the row keeps the first 300 characters: the list's refusal names the fold problem above
    assert "the loop must be folded" in row.reason and "but cannot be" in row.reason


def test_tensor_carried_from_the_stream_is_still_folded():
    fold = plan_fold(TensorFromStream, "blocks")
    assert fold.carried == ["x", "total"] and fold.pattern == "Pattern_0"
    row = run(TensorFromStream)
    assert row.outcome == "correct" and row.folded, (row.outcome, row.reason)
    assert row.off_max_abs <= 1e-5


def test_non_tensor_carried_that_the_source_cannot_show_is_refused_at_run_time():
    # before: folded (the source shows no Python value) and cache-dit crashed in the caching-off
    # run ("'float' object has no attribute 'contiguous'"); now the adapter's guard on the folded
    # blocks raises a FoldError naming the carried name before cache-dit takes the value
    fold = plan_fold(LevelThroughMath, "blocks")
    assert fold.carried == ["x", "level"]
    row = run(LevelThroughMath)
    assert row.outcome == "refused", (row.outcome, row.stage, row.reason)
    assert "carries 'level' besides the stream, and at run time it is a float" in row.reason, row.reason
