"""Context-parallel plans for two shapes that were refused before (issue 23 item 8): a mask over the
image sequence given to the blocks (kept whole: under Ulysses each rank's attention holds the whole
sequence for a share of the heads), and token counts the degree does not divide (split unevenly,
``torch.tensor_split`` sizes, as cache-dit's ``ulysses_anything`` does). Each tiny model here has
the shape of the problem; the dry run and the simulated ranks judge every plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ditbook.coverage.cp import coverage_cp
from ditbook.parallel.cp_dryrun import PlanCheckError, verify_before_launch
from ditbook.parallel.cp_plan import resolve_cp_plan


class MaskedAttn(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class MaskedBlock(nn.Module):
    """``mode``: "attention" (the mask reaches the attention only), "heads" (the block repeats it
    over the heads first), "tokens" (a [B, S] mask also multiplies the tokens outside attention)."""

    def __init__(self, dim, mode):
        super().__init__()
        self.mode = mode
        self.norm = nn.LayerNorm(dim)
        self.attn = MaskedAttn(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask):
        if self.mode == "tokens":
            hidden_states = hidden_states * attention_mask[..., None]
            attention_mask = attention_mask[:, None, None, :].bool()
        elif self.mode == "heads":
            attention_mask = attention_mask.expand(-1, self.attn.heads, -1, -1)
        h = hidden_states + self.attn(self.norm(hidden_states), attention_mask)
        return h + self.mlp(h)


class MaskedDiT(nn.Module):
    def __init__(self, dim=16, mode="attention"):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([MaskedBlock(dim, mode) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states, attention_mask):
        x = self.embed(hidden_states)
        for blk in self.blocks:
            x = blk(hidden_states=x, attention_mask=attention_mask)
        return (self.proj_out(self.norm_out(x)),)


def _masked(mode="attention", tokens=16):
    torch.manual_seed(0)
    m = MaskedDiT(mode=mode).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, 4, generator=g)
    if mode == "tokens":
        mask = (torch.arange(tokens) < tokens - 3).float()[None]
    else:
        # every query row its own band of keys: a rank that got the wrong rows computes other values
        i = torch.arange(tokens)
        mask = ((i[:, None] - i[None, :]).abs() <= 4)[None, None]
    return m, {"hidden_states": x, "attention_mask": mask}


def _resolve(m, kw, degree=2):
    return resolve_cp_plan(m, capture=lambda: ((), kw), degree=degree, check=verify_before_launch)


def test_a_mask_over_the_image_only_the_attention_reads_is_kept_whole_and_runs():
    """Old code: PlanDerivationError "mask ... covers the image sequence". The plan keeps the
    [1, 1, S, S] mask whole; the simulated ranks cut its rows to each rank's queries as Ulysses does
    (parity below the tolerance, so the rows are right), and two gloo ranks agree with one process."""
    m, kw = _masked()
    cp = _resolve(m, kw)
    assert cp.facts["whole_masks"] == ["blocks:attention_mask"]
    assert not any("attention_mask" in str(v) for v in cp.plan.values() if isinstance(v, dict))
    assert "simulated ranks match" in cp.facts["prelaunch"]["simulated_parity"]
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r


@pytest.mark.parametrize("mode, why", [("heads", "with 2 heads reaches context-parallel attention"),
                                       ("tokens", "one-process dry run of the plan fails")])
def test_a_whole_mask_that_does_not_fit_ulysses_attention_is_refused_with_its_reason(mode, why):
    """A mask repeated over the heads (each rank's attention holds half of them), or one that also
    multiplies the split tokens outside the attention: refused before launch, named."""
    m, kw = _masked(mode)
    with pytest.raises(PlanCheckError, match=why):
        _resolve(m, kw)
