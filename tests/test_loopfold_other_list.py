"""A loop body that reads ANOTHER folded block list (diffusers' Chroma: the double-stream loop
computes its slice of a precomputed modulation table from ``len(self.single_transformer_blocks)``).

Both lists are folded and cached: while cached, ``self.<other list>`` is cache-dit's one-unit
stand-in, so the folded loop body must read the other list's original blocks, as the rewritten
method does (before: ``len`` read 1, the body took the wrong table slice, caching off differed
from the plain forward).
"""

from __future__ import annotations

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from cache_harness import cache_check
from torch import nn

from test_integration_mechanisms import Block


class TwoListsSharedTable(ModelMixin, ConfigMixin):
    """Two block lists; one table of per-block modulations, the second list's rows first."""

    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 2, num_single_layers: int = 3):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.table = nn.Linear(1, dim * (num_layers + num_single_layers))
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.single_blocks = nn.ModuleList([Block(dim) for _ in range(num_single_layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x = self.proj_in(hidden_states)
        table = self.table(timestep[:, None] / 1000.0).unflatten(1, (-1, x.shape[-1]))
        for index_block, block in enumerate(self.blocks):
            offset = len(self.single_blocks)  # this list's rows come after the other list's
            x = block(x, table[:, offset + index_block])
        for index_block, block in enumerate(self.single_blocks):
            x = block(x, table[:, index_block])
        return (self.proj_out(self.norm_out(x)),)


class ReadsOtherListsBlock(TwoListsSharedTable):
    """The first loop's body reads an attribute of the other list's block ``i``."""

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x = self.proj_in(hidden_states)
        table = self.table(timestep[:, None] / 1000.0).unflatten(1, (-1, x.shape[-1]))
        for index_block, block in enumerate(self.blocks):
            x = block(x, table[:, index_block]) * self.single_blocks[index_block + 1].norm1.weight
        for index_block, block in enumerate(self.single_blocks):
            x = block(x, table[:, index_block])
        return (self.proj_out(self.norm_out(x)),)


def test_loop_body_reading_the_length_of_another_folded_list():
    row = cache_check(TwoListsSharedTable)
    assert row.block_lists == ["blocks x2", "single_blocks x3"], row.block_lists
    assert row.outcome == "correct" and row.folded, (row.outcome, row.stage, row.reason)
    assert row.off_max_abs <= 1e-5, row.off_max_abs


def test_loop_body_reading_a_block_of_another_folded_list():
    row = cache_check(ReadsOtherListsBlock)
    assert row.outcome == "correct" and row.folded, (row.outcome, row.stage, row.reason)
