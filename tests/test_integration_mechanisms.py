"""Issue 13: the classes of integration failure, each on a small third-party-shaped transformer
written here (not in diffusers), run through the cache stage's checks (``cache_harness``:
traced inspection, the automatic cache adapter with caching off against the plain forward and
with caching on). Every model must come out ``correct`` or ``refused`` with a named reason —
never ``crash`` or ``wrong``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from cache_harness import cache_check
from torch import nn

# --- building blocks (projection names nobody lists: attention recognised by shape) ------------

class OddAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.to_query = nn.Linear(dim, dim)
        self.to_key = nn.Linear(dim, dim)
        self.to_value = nn.Linear(dim, dim)
        self.to_output = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape

        def split(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.to_query(x)), split(self.to_key(x)), split(self.to_value(x)))
        return self.to_output(out.transpose(1, 2).reshape(b, n, d))


class FusedAttention(nn.Module):
    """One fused projection named ``img_qkv_proj`` (missed by name rules)."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.img_qkv_proj = nn.Linear(dim, 3 * dim)
        self.img_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.img_qkv_proj(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.img_out(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, fused: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = FusedAttention(dim) if fused else OddAttention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mod = nn.Linear(dim, 2 * dim)

    def forward(self, x, temb):
        scale, shift = self.mod(temb)[:, None].chunk(2, dim=-1)
        x = x + self.attn(self.norm1(x) * (1 + scale) + shift)
        return x + self.ff(self.norm2(x))


class TupleBlock(Block):
    def forward(self, x, temb):
        return (super().forward(x, temb),)


class Base(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3, fused: bool = False):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim, fused) for _ in range(num_layers)])
        self.gates = nn.Parameter(torch.linspace(0.5, 1.5, num_layers))
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)

    def embed(self, hidden_states, timestep):
        return self.proj_in(hidden_states), self.time(timestep[:, None] / 1000.0)

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


def run(cls):
    row = cache_check(cls)
    assert row.outcome in ("correct", "refused"), (row.outcome, row.stage, row.reason)
    return row


# --- the mechanisms ----------------------------------------------------------------------------

class ShapeNamedAttention(Base):
    pass


class FusedShapeAttention(Base):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3, fused: bool = True):
        super().__init__(in_channels, dim, num_layers, fused)


def test_attention_recognised_by_shape_not_by_names():
    # to_query/to_key/to_value and a fused img_qkv_proj: no name rule knows them; before, the
    # model got no block list and the cache stage crashed
    for cls in (ShapeNamedAttention, FusedShapeAttention):
        row = run(cls)
        assert row.outcome == "correct", row
        assert row.block_lists == ["blocks x3"] and row.off_max_abs <= 1e-5
        skipped, total = (int(v) for v in row.skipped.split(" of "))
        assert 0 < skipped < total  # block evaluations really skipped


class Stage(nn.Module):  # never called: only holds a block list
    def __init__(self, dim, n):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(n)])


class ContainerStages(Base):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 2, fused: bool = False):
        super().__init__(in_channels, dim, num_layers, fused)
        del self.blocks
        self.stages = nn.ModuleList([Stage(dim, num_layers), Stage(dim, num_layers)])

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for stage in self.stages:
            for block in stage.blocks:
                x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


def test_list_of_containers_is_not_a_block_list():
    from ditbook.arch.static import find_block_lists

    lists, others = find_block_lists(ContainerStages())
    assert [p for p, _ in lists] == ["stages.0.blocks", "stages.1.blocks"]
    assert any("containers" in o for o in others)
    row = run(ContainerStages)
    # the transformer's own forward runs the inner lists in order: cached through one stand-in owner
    # per container (``adapter.build`` container owners), and correct against the uncached run
    assert row.outcome == "correct", (row.outcome, row.reason)


class BlockAttributeOutsideLoop(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        x = self.blocks[0].norm1(x)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


class BlockCalledOutsideLoop(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        x = self.blocks[0](x, temb)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


class TwoLoops(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            x = block(x, temb)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


class Comprehension(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        outs = [block(x, temb) for block in self.blocks]
        return (self.proj_out(self.norm_out(sum(outs))),)


class ZipTwoLists(Base):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3, fused: bool = False):
        super().__init__(in_channels, dim, num_layers, fused)
        self.post = nn.ModuleList([nn.LayerNorm(dim) for _ in range(num_layers)])

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block, norm in zip(self.blocks, self.post):
            x = norm(block(x, temb))
        return (self.proj_out(self.norm_out(x)),)


class BreakEarly(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for i, block in enumerate(self.blocks):
            if i == 99:
                break
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


def test_list_touched_outside_its_loop_is_refused_with_a_reason():
    # before: cache-dit's one-unit stand-in replaced the list, so `self.blocks[0].norm1` raised,
    # the second loop / comprehension / zip saw one unit instead of the blocks
    for cls, words in ((BlockCalledOutsideLoop, "outside its loop"), (TwoLoops, "2 times"),
                       (Comprehension, "outside its loop")):
        row = run(cls)
        assert row.outcome == "refused" and words in row.reason, (cls.__name__, row.reason)


def test_loop_with_break_is_folded():
    # before (issue 23): refused ("uses break: a cached unit cannot stop early"); folded, the block
    # that breaks sets a flag and every later block returns at once (tests/test_loopfold_flow.py)
    row = run(BreakEarly)
    assert row.outcome == "correct" and row.folded and row.off_max_abs <= 1e-5, (row.outcome, row.reason)


class BlockAttributeInHelper(Base):
    def finish(self, x):
        return self.proj_out(self.norm_out(x) + self.blocks[0].norm2(x))

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            x = block(x, temb)
        return (self.finish(x),)


def test_block_attribute_read_outside_the_loop_reaches_the_original_block():
    # `self.blocks[0].norm1(x)` outside the loop (DiT's `transformer_blocks[0].norm1.emb(...)`):
    # before, refused; now the fold points that read at the original block, and caching skips
    # (Transformer2DModel reads it in a helper method the forward calls: rewritten too)
    for cls in (BlockAttributeOutsideLoop, BlockAttributeInHelper):
        row = run(cls)
        assert row.outcome == "correct" and row.folded, (cls.__name__, row.reason)
        assert row.off_max_abs <= 1e-5
        skipped, total = (int(v) for v in row.skipped.split(" of "))
        assert 0 < skipped < total


class LoopInHelper(Base):
    def run_blocks(self, x, temb):
        for block in self.blocks:
            x = block(x, temb)
        return x

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        x = self.run_blocks(x, temb)
        return (self.proj_out(self.norm_out(x)),)


class LoopWorkInHelper(Base):
    def run_blocks(self, x, temb):
        for i, block in enumerate(self.blocks):
            x = block(x, temb) * self.gates[i]
        return x

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        x = self.run_blocks(x, temb)
        return (self.proj_out(self.norm_out(x)),)


def test_loop_in_a_helper_method():
    # the loop (and its per-block gate) lives in run_blocks: found there and folded there
    for cls in (LoopInHelper, LoopWorkInHelper):
        row = run(cls)
        assert row.outcome == "correct" and row.folded, (cls.__name__, row.reason)


class TupleReturnIndexed(Base):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3, fused: bool = False):
        super().__init__(in_channels, dim, num_layers, fused)
        self.blocks = nn.ModuleList([TupleBlock(dim) for _ in range(num_layers)])

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            x = block(x, temb)[0]
        return (self.proj_out(self.norm_out(x)),)


class OtherStreamNames(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        img, temb = self.embed(hidden_states, timestep)
        for blk in self.blocks:
            img = blk(x=img, temb=temb)
        return (self.proj_out(self.norm_out(img)),)


def test_tuple_return_and_other_stream_names_are_folded():
    for cls in (TupleReturnIndexed, OtherStreamNames):
        row = run(cls)
        assert row.outcome == "correct" and row.folded, (cls.__name__, row.reason)


class LenInLoopBody(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for i, block in enumerate(self.blocks):
            x = block(x, temb) * (1.0 + (i + 1) / len(self.blocks))
        return (self.proj_out(self.norm_out(x)),)


def test_folded_body_sees_the_original_list():
    # len(self.blocks) in the body: with cache-dit's one-unit stand-in it read 1, not 2
    row = run(LenInLoopBody)
    assert row.outcome == "correct" and row.folded, row.reason


class NoBlocks(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_channels, dim), nn.GELU(), nn.Linear(dim, in_channels))

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        return (self.net(hidden_states),)


def test_no_block_list_is_a_named_refusal_and_the_first_plan_risk():
    # before: "min() arg is an empty sequence" inside the cache stage
    row = run(NoBlocks)
    assert row.outcome == "refused" and "no block list" in row.reason
    from ditbook.inspect.plan import structural_risks
    from ditbook.arch.static import inspect_transformer

    first = structural_risks(inspect_transformer(NoBlocks(), None, support=False))[0]
    assert first["id"] == "no_block_list" and "no block list" in first["text"]


def test_attention_traced_without_rebinding_sdpa():
    from ditbook.arch.trace import Tracer

    model = ShapeNamedAttention()
    original = F.scaled_dot_product_attention
    with Tracer(model, ["blocks"]) as tracer, torch.no_grad():
        assert torch.nn.functional.scaled_dot_product_attention is original  # nothing rebound
        model(torch.randn(1, 5, 8), torch.full((1,), 10.0))
    assert len(tracer.sdpa) == 3 and tracer.sdpa[0]["q"] == [1, 2, 5, 8]
    assert tracer.sdpa[0]["block"] == ("blocks", 0)


class OutputTakenAsIs(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            out = block(x, temb)
            x = out
        return (self.proj_out(self.norm_out(x)),)


def test_taking_the_block_output_is_not_loop_work():
    from ditbook.arch.loop_source import read_loops

    loops = read_loops(OutputTakenAsIs(), ["blocks"])
    assert "blocks" in loops.loops and loops.work == []  # before: `x = out` was reported as loop work
    # a real step in the loop still is
    assert [w.code for w in read_loops(OutputScaled(), ["blocks"]).work] == ["x = out * 0.5"]


class OutputScaled(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for block in self.blocks:
            out = block(x, temb)
            x = out * 0.5
        return (self.proj_out(self.norm_out(x)),)


class CarriesCounters(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        k, scale = 0, 1.0
        for block in self.blocks:
            x = block(x, temb) * self.gates[k] * scale
            if k % 2 == 0:
                scale = scale * 0.9
            k += 1
        return (self.proj_out(self.norm_out(x)) * (scale + k),)


class CounterFromStream(Base):
    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        k, j, scale = 0, 0, 1.0
        for block in self.blocks:
            x = block(x, temb) * scale
            scale = scale * 0.9
            k = k + int(x.mean() > 0)
            j = j + int(x.mean() < 0)
        return (self.proj_out(self.norm_out(x)) * (k + j + 1),)


class ZipTwoBlockLists(Base):
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3, fused: bool = False):
        super().__init__(in_channels, dim, num_layers, fused)
        self.temporal = nn.ModuleList([Block(dim, fused) for _ in range(num_layers)])

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x, temb = self.embed(hidden_states, timestep)
        for i, (block, temporal) in enumerate(zip(self.blocks, self.temporal)):
            x = block(x, temb)
            x = temporal(x.flip(1), temb).flip(1) * self.gates[i]
        return (self.proj_out(self.norm_out(x)),)


def test_zip_of_lists_is_folded_as_one_unit():
    # `for block, norm in zip(self.blocks, self.post)` and two block lists interleaved (Latte's
    # spatial/temporal pairs): before, refused ("outside its loop"). Now the first list is
    # folded and each folded block runs its partners; the partner list is never cached alone
    for cls in (ZipTwoLists, ZipTwoBlockLists):
        row = run(cls)
        assert row.outcome == "correct" and row.folded, (cls.__name__, row.reason)
        assert row.off_max_abs <= 1e-5
        skipped, total = (int(v) for v in row.skipped.split(" of "))
        assert 0 < skipped < total


def test_loop_carrying_more_names_than_streams_is_folded():
    # three carried names (the stream, a counter indexing a parameter, a factor changed under an
    # `if`): before, "carries 3 names" and refused. Now the names whose updates never read a
    # block's output are computed per block before the loop and handed to each folded block
    row = run(CarriesCounters)
    assert row.outcome == "correct" and row.folded, row.reason
    assert row.off_max_abs <= 1e-5
    skipped, total = (int(v) for v in row.skipped.split(" of "))
    assert 0 < skipped < total
    # counters that read the stream would stall while blocks are skipped: refused, named
    row = run(CounterFromStream)
    assert row.outcome == "refused" and "cannot be" in row.reason, row.reason
    import pytest
    from ditbook.adapter.loopfold import FoldError, plan_fold

    with pytest.raises(FoldError, match="depend on the blocks' outputs"):
        plan_fold(CounterFromStream, "blocks")
    assert sorted(plan_fold(CarriesCounters, "blocks").control) == ["k", "scale"]
