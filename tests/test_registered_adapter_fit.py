"""cache-dit's registry matches pipelines by class-name prefix: the Wan2.1 reference code wrapped as
``WanPipeline`` around its own ``WanModel`` (blocks ``forward(x, e, ...)``) got cache-dit's diffusers-Wan
registration, whose factory builds on it (the model has ``blocks``) but whose pattern passes
``hidden_states``: every ``+cache`` parallel plan, and the ``single+cache`` reference with them, failed in
the ranks ("No block forward pattern matched") and the parallel stage failed (issue 39)."""

from types import SimpleNamespace

from cache_dit import ForwardPattern
from torch import nn

from ditbook.adapter.build import declared_patterns_fit


class ReferenceBlock(nn.Module):
    def forward(self, x, e, seq_lens, grid_sizes, freqs, context, context_lens):
        return x


class DiffusersBlock(nn.Module):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        return hidden_states


def _adapter(block, functor=None):
    return SimpleNamespace(blocks=nn.ModuleList([block]), forward_pattern=ForwardPattern.Pattern_2,
                           patch_functor=functor)


def test_a_registration_whose_pattern_the_blocks_cannot_take_does_not_fit():
    assert declared_patterns_fit(_adapter(ReferenceBlock())) is False
    assert declared_patterns_fit(_adapter(DiffusersBlock())) is True
    assert declared_patterns_fit(_adapter(ReferenceBlock(), functor=object())) is True  # a functor may rename
