"""Context-parallel plans checked before launch (issue 13 item 4): every block input with a full
token axis is split with the tokens, blocks that reshape tokens into the grid are refused, the
lists that never see the image stay whole (their attention too), and a failing rank is named
with its own error. Each test builds a tiny model here that has the shape of the problem."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

from ditbook.cp.attention import route_attention, sdpa_callers
from ditbook.coverage.cp import coverage_cp
from ditbook.cp.dryrun import (DryRunError, GridReshapeError, PlanCheckError, TokenAxisError, check_grid_reshape, dry_run, verify_before_launch)
from ditbook.cp.plan import (PlanDerivationError, check_plan_sites, derive_cp_plan, find_streams, resolve_cp_plan, trace_forward)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attn(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, rotary=None, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = _rope(q, *rotary), _rope(k, *rotary)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class DoubleBlock(nn.Module):
    """Joint attention over [text, image]; RoPE for the whole joint sequence."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attn(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary):
        n = encoder_hidden_states.shape[1]
        j = torch.cat([encoder_hidden_states, hidden_states + temb[:, None]], dim=1)
        j = j + self.attn(self.norm(j), rotary)
        j = j + self.mlp(j)
        return j[:, n:], j[:, :n]


class SingleBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attn(dim)

    def forward(self, hidden_states, rotary):
        return hidden_states + self.attn(self.norm(hidden_states), rotary)


class RefinerBlock(nn.Module):
    """Self-attention over the text alone, with a padding mask [B, 1, S_txt, S_txt]."""

    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)

    def forward(self, hidden_states, attention_mask):
        return hidden_states + self.attn(hidden_states, mask=attention_mask)


class GuidanceLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Positions(nn.Module):
    """A RoPE table from position ids [S, 2], one row per token."""

    def __init__(self, head_dim):
        super().__init__()
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, head_dim // 2).repeat(2, 1) * torch.tensor([[1.0], [0.5]]))

    def forward(self, ids):
        ang = ids.float() @ self.freqs
        return ang.cos(), ang.sin()


class JointDiT(nn.Module):
    """Flux-2-like: double blocks on (image, text), single blocks on [text, image] concatenated,
    RoPE built from ``cat(txt_ids, img_ids)`` (covers text and image in one axis), a guidance
    MLP stack over a 32-row table (longer than the 16 image tokens) that never sees the image.
    ``slice_by_input``: after the single blocks the text is cut off by the length of the
    *input* text (as Flux 2 does), else by the length of the text the blocks carried.
    ``refiner``: a masked text token refiner runs before the blocks (as in HunyuanVideo)."""

    def __init__(self, dim=16, slice_by_input=True, refiner=False):
        super().__init__()
        self.slice_by_input = slice_by_input
        self.x_embedder = nn.Linear(4, dim)
        self.context_embedder = nn.Linear(6, dim)
        self.refiner = nn.ModuleList([RefinerBlock(dim) for _ in range(2)]) if refiner else None
        self.guidance_table = nn.Parameter(torch.randn(1, 32, dim) * 0.1)
        self.guidance = nn.ModuleList([GuidanceLayer(dim) for _ in range(2)])
        self.pos = Positions(dim // 2)
        self.joint_blocks = nn.ModuleList([DoubleBlock(dim) for _ in range(2)])
        self.single_blocks = nn.ModuleList([SingleBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, text_mask=None):
        g = self.guidance_table * timestep[:, None, None]
        for layer in self.guidance:
            g = layer(x=g)
        temb = g.mean(1)
        x = self.x_embedder(hidden_states)
        c = self.context_embedder(encoder_hidden_states)
        if self.refiner is not None:
            mask = text_mask[:, None, None, :].expand(-1, 1, c.shape[1], -1)
            for blk in self.refiner:
                c = blk(hidden_states=c, attention_mask=mask)
        rotary = self.pos(torch.cat([txt_ids, img_ids], dim=0))
        for blk in self.joint_blocks:
            x, c = blk(hidden_states=x, encoder_hidden_states=c, temb=temb, rotary=rotary)
        j = torch.cat([c, x], dim=1)
        for blk in self.single_blocks:
            j = blk(hidden_states=j, rotary=rotary)
        n = encoder_hidden_states.shape[1] if self.slice_by_input else c.shape[1]
        return (self.proj_out(self.norm_out(j[:, n:])),)


def _joint(**kw):
    torch.manual_seed(0)
    m = JointDiT(**kw).eval()
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 6, generator=g),
                  timestep=torch.tensor([0.5]), img_ids=torch.stack([yy.flatten(), xx.flatten()], 1),
                  txt_ids=torch.zeros(8, 2, dtype=torch.long),
                  text_mask=torch.tensor([[True] * 6 + [False] * 2]))
    return m, inputs


def test_split_lists_are_the_lists_that_see_the_image():
    """The guidance stack runs on 32 rows, more than the 16 image tokens: the old rule (the list
    with the longest token input) made it the list to split, and checked the wrong blocks."""
    m, kw = _joint()
    tr = trace_forward(m, (), kw)
    assert tr.lists["guidance"].sees_image is False and tr.lists["joint_blocks"].sees_image
    st = find_streams(tr)
    assert st.lists == ["joint_blocks", "single_blocks"] and st.s_img == 16 and st.joint
    assert "guidance" in st.left_whole
    for lt in tr.lists.values():  # without the perturbation probe: the old rule
        lt.sees_image = None
    assert find_streams(tr).lists == ["guidance"]


def test_full_length_positional_table_is_refused_before_launch():
    """A plan that splits the token streams but not the position ids: the RoPE table keeps its
    24 rows (text + image) while the blocks get 12 tokens. The old checks passed it (its sites
    are fine) and the ranks crashed; the dry run names the table, the axis and the split."""
    m, kw = _joint()
    tr = trace_forward(m, (), kw)
    st = find_streams(tr)
    plan = {"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                 "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                 # written for 3-D ids: never applies to these 2-D ones
                 "img_ids": ContextParallelInput(split_dim=1, expected_dims=3)},
            "norm_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    check_plan_sites(plan, tr, st)  # the old gate: no objection
    with pytest.raises(TokenAxisError) as err:
        verify_before_launch(m, (), kw, plan, tr, st, 2)
    msg = str(err.value)
    assert "positional table 'rotary'" in msg and "full token axis 24 (dim 0)" in msg, msg
    assert "'img_ids' at '<transformer>': expects 3 dims" in msg  # the split that never applied
    with pytest.raises(DryRunError, match="size of tensor"):  # what the ranks would have hit
        dry_run(m, (), kw, plan, 2, st.lists)


def test_joint_table_is_split_through_the_position_inputs_and_runs():
    """The derivation used to refuse a RoPE table covering text and image ("register a plan");
    now it splits the transformer's separate text and image position inputs, and (the model
    cuts the text off by the input text's length) splits the streams at the transformer's
    inputs after the plan splitting them where they are made fails the output-shape check.
    Executed on 2 gloo ranks: verified split, same output."""
    m, kw = _joint()
    tr = trace_forward(m, (), kw)
    st = find_streams(tr)
    made = derive_cp_plan(m, (), kw, degree=2, trace=tr)
    assert made.plan[""]["img_ids"].split_dim == 0 and made.plan[""]["txt_ids"].split_dim == 0
    with pytest.raises(PlanCheckError, match=r"returns \[1, 8, 4\], one process returns \[1, 16, 4\]"):
        verify_before_launch(m, (), kw, made.plan, tr, st, 2)
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    assert set(cp.plan[""]) == {"hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"}
    assert cp.facts["prelaunch"]["block_inputs"]["single_blocks"]["hidden_states"] == [[1, 12, 16]]
    assert cp.facts["sharding_expected"]["single_blocks"] == {"argument": "hidden_states", "full": 24}
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r
    assert r["seq_lens"]["joint_blocks"] == [{"hidden_states": [8], "encoder_hidden_states": [4]}] * 2
    assert r["seq_lens"]["single_blocks"] == [{"hidden_states": [12]}] * 2


def test_text_refiner_attention_stays_local(monkeypatch):
    """A masked text refiner runs whole on every rank. cache-dit gives every attention the CP
    config and ditbook routed every SDPA call: the refiner then did a Ulysses all-to-all over
    unsplit text and crashed against its mask. ``limit_cp_to`` keeps it local."""
    m, kw = _joint(slice_by_input=False, refiner=True)
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r
    assert r["source"] == "derived" and "refiner" not in r["seq_lens"]
    import ditbook.cp.scope as scope

    import ditbook.cp.mask as cp_mask

    monkeypatch.setattr(scope, "limit_cp_to", lambda *a, **k: [])  # the old behaviour (forked ranks see it)
    # (and no mask fitting: since ``cp_mask`` gathers the mask's rows and keys, a Ulysses attention
    # over the whole text on every rank is the same attention over repeated keys, and runs)
    monkeypatch.setattr(cp_mask, "install_mask_fit", lambda *a, **k: None)
    old = coverage_cp(m, (), kw, timeout=60)
    assert old["outcome"] == "crash" and "size of tensor" in old["reason"], old


def test_a_failing_rank_is_named_with_its_own_error():
    """A given plan that the ranks cannot run: the result names each rank's own error and where
    it was raised, never only a peer's lost connection."""
    m, kw = _joint()
    bad = {"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
           "norm_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    r = coverage_cp(m, (), kw, plan=bad, timeout=60)
    assert r["outcome"] == "crash", r
    first = r["reason"].split("; ")[0]
    assert first.startswith("rank ") and "size of tensor" in first and ".py:" in first, r  # with where
    assert "Connection reset" not in first


class GridBlock(nn.Module):
    """Attention, then a convolution over the token grid (the token axis reshaped to (h, w))."""

    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, hidden_states, height, width):
        x = hidden_states + self.attn(hidden_states)
        y = x.unflatten(1, (height, width)).permute(0, 3, 1, 2)
        return x + self.conv(y).flatten(2).transpose(1, 2)


class SizeBlock(nn.Module):
    """Takes the same grid arguments, never reshapes the tokens with them."""

    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)

    def forward(self, hidden_states, height, width):
        return (hidden_states + self.attn(hidden_states)) * (height / width)


class GridDiT(nn.Module):
    def __init__(self, dim=16, reshape=True):
        super().__init__()
        self.x_embedder = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([(GridBlock if reshape else SizeBlock)(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states):
        b, c, h, w = hidden_states.shape
        x = self.x_embedder(hidden_states.flatten(2).transpose(1, 2))
        for blk in self.blocks:
            x = blk(hidden_states=x, height=h, width=w)
        return (self.proj_out(self.norm_out(x)).transpose(1, 2).reshape(b, c, h, w),)


def test_blocks_that_reshape_tokens_into_the_grid_are_refused():
    """Sana-like: the block unflattens the token axis to (height, width). The old derivation gave
    a plan whose sites are fine and the ranks crashed in ``unflatten``; now the plan is refused
    before launch naming the grid arguments. A block that takes the same arguments without
    reshaping with them is not refused."""
    torch.manual_seed(0)
    m = GridDiT().eval()
    kw = dict(hidden_states=torch.randn(1, 4, 4, 4))
    with pytest.raises(GridReshapeError, match=r"'blocks' take the token grid \(height=4, width=4: 4 x 4 = 16"):
        resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    tr = trace_forward(m, (), kw)
    st = find_streams(tr)
    old = derive_cp_plan(m, (), kw, degree=2, trace=tr)  # what the old code launched
    check_plan_sites(old.plan, tr, st)
    with pytest.raises(DryRunError, match="unflatten"):
        dry_run(m, (), kw, old.plan, 2, st.lists)
    plain = GridDiT(reshape=False).eval()
    tr2 = trace_forward(plain, (), kw)
    check_grid_reshape(plain, tr2, find_streams(tr2))  # the same arguments, no reshape: fine
    assert resolve_cp_plan(plain, capture=lambda: ((), kw), degree=2, check=verify_before_launch).facts["prelaunch"]["checked"]


def test_processor_that_calls_sdpa_itself_is_routed_unless_patched_to_dispatch():
    """Mochi-like: an attention module whose processor carries diffusers' ``_attention_backend``
    but calls SDPA itself was never routed, so under CP each rank attended to its own shard
    only. It is routed now; when a planner replaces the processor's ``__call__`` (with
    functools.wraps) by one that dispatches itself, the route steps aside per call."""

    class Processor:
        _attention_backend = None

        def __call__(self, attn, x):
            q = x.view(1, -1, 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape)

    class WithProcessor(nn.Module):
        def __init__(self):
            super().__init__()
            self.processor = Processor()

        def forward(self, x):
            return self.processor(self, x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = WithProcessor()

        def forward(self, x):
            return self.attn(x)

    m = Model()
    assert [n for n, _ in sdpa_callers(m)] == ["attn"]
    route = route_attention(m)
    m(torch.randn(1, 4, 8))
    assert route.calls == 1

    def dispatch_attention_fn(x):  # stands for a planner's own dispatch
        return x

    @functools.wraps(Processor.__call__)
    def patched(self, attn, x):
        return dispatch_attention_fn(x)
    Processor.__call__ = patched
    m(torch.randn(1, 4, 8))
    assert route.calls == 1  # not routed a second time
    route.remove()


def test_derivation_refuses_a_joint_table_without_position_inputs():
    """The table covers text and image and the transformer takes no separate position inputs
    (it builds the ids itself): still refused with the named reason."""

    class NoIds(JointDiT):
        def forward(self, hidden_states, encoder_hidden_states, timestep):
            ids = torch.cat([torch.zeros(8, 2), torch.arange(32.0).view(16, 2)], 0)
            return super().forward(hidden_states, encoder_hidden_states, timestep, ids[8:], ids[:8])

    torch.manual_seed(0)
    m = NoIds().eval()
    _, kw = _joint()
    kw = {k: kw[k] for k in ("hidden_states", "encoder_hidden_states", "timestep")}
    with pytest.raises(PlanDerivationError, match="positional table 'rotary'.*no separate text and image position"):
        derive_cp_plan(m, (), kw, degree=2)


class TupleGridBlock(nn.Module):
    """The grid comes as one tuple argument ``hw``."""

    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, hidden_states, hw):
        x = hidden_states + self.attn(hidden_states)
        y = x.view(x.shape[0], *hw, -1).permute(0, 3, 1, 2)
        return x + self.conv(y).flatten(2).transpose(1, 2)


def test_grid_given_as_a_tuple_is_found_too():
    class TupleGridDiT(GridDiT):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([TupleGridBlock(16) for _ in range(2)])

        def forward(self, hidden_states):
            b, c, h, w = hidden_states.shape
            x = self.x_embedder(hidden_states.flatten(2).transpose(1, 2))
            for blk in self.blocks:
                x = blk(hidden_states=x, hw=(h, w))
            return (self.proj_out(self.norm_out(x)).transpose(1, 2).reshape(b, c, h, w),)

    torch.manual_seed(0)
    m = TupleGridDiT().eval()
    kw = dict(hidden_states=torch.randn(1, 4, 4, 4))
    tr = trace_forward(m, (), kw)
    assert tr.lists["blocks"].scalars == {"hw[0]": 4, "hw[1]": 4}
    with pytest.raises(GridReshapeError, match=r"hw\[0\]=4, hw\[1\]=4"):
        check_grid_reshape(m, tr, find_streams(tr))


class ManualAttnBlock(nn.Module):
    """Attention written by hand (no SDPA call: nothing routes it to the CP attention, so each
    rank attends to its own shard only), behind an adaLN-zero style gate initialised to zero."""

    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.gate = nn.Parameter(torch.zeros(dim))

    def forward(self, hidden_states):
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return hidden_states + self.gate * (att @ v)


class GatedDiT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.x_embedder = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([ManualAttnBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states):
        x = self.x_embedder(hidden_states)
        for blk in self.blocks:
            x = blk(hidden_states=x)
        return (self.proj_out(self.norm_out(x)),)


def test_zero_initialised_gates_do_not_make_parity_vacuous(monkeypatch):
    """With its gates at zero the blocks add nothing to the output, and a plan under which each
    rank attends to its own shard only passed parity exactly. The CP probe fills all-zero
    parameters first; the same plan is then found wrong (since the simulated ranks compare with
    one process before launch: refused there, test_cp_simulated_parity)."""
    torch.manual_seed(0)
    m = GatedDiT().eval()
    kw = dict(hidden_states=torch.randn(1, 16, 4))
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "refused" and "ParityError" in r["reason"] and "no SDPA call inside 'blocks.0'" in \
        r["reason"], r
    assert r["filled_zero_parameters"] >= 2  # the gates (and the zero LayerNorm bias)
    import ditbook.coverage.cp as cov

    monkeypatch.setattr(cov, "fill_zero_parameters", lambda t, scale=0.1: [])  # the old probe
    old = coverage_cp(m, (), kw, timeout=60)
    assert old["outcome"] == "correct", old  # a green check on attention that never crossed ranks


class ConvOutDiT(nn.Module):
    """The forward turns the tokens back into the grid right after the blocks and ends with a
    convolution: no module after the blocks takes tokens."""

    def __init__(self, dim=16):
        super().__init__()
        self.x_embedder = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([SingleBlock(dim) for _ in range(2)])
        self.proj_out = nn.Conv2d(dim, 4, 1)

    def forward(self, hidden_states):
        b, c, h, w = hidden_states.shape
        x = self.x_embedder(hidden_states.flatten(2).transpose(1, 2))
        for blk in self.blocks:
            x = blk(hidden_states=x, rotary=None)
        return (self.proj_out(x.transpose(1, 2).reshape(b, -1, h, w)),)


def test_gather_at_the_last_block_when_no_module_takes_the_tokens_after_it():
    """The old derivation refused ("nowhere to gather them"); the plan now gathers at the last
    block's output, passes the dry run (the output comes back whole), and a +cache run is
    refused by name (a cached step skips that block and its gather)."""
    from ditbook.cp.cache_sync import CacheSplitError, split_at_cached_units

    torch.manual_seed(0)
    m = ConvOutDiT().eval()
    kw = dict(hidden_states=torch.randn(1, 4, 4, 4))
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    assert "blocks.1" in cp.plan and cp.plan["blocks.1"].gather_dim == 1
    assert cp.facts["prelaunch"]["block_inputs"]["blocks"]["hidden_states"] == [[1, 8, 16]]
    with pytest.raises(CacheSplitError, match="gathers the tokens at the output of block 'blocks.1'"):
        split_at_cached_units(m, cp.plan, cp.facts)


def test_registered_plan_failing_the_check_is_noted_and_a_derived_one_used():
    """A class plan written for 3-D position ids (as diffusers' Flux 2 plan is) meets 2-D ids:
    its id splits never apply. It used to be launched and crash in the ranks; now it is set
    aside with the reason in the notes, and the derived plan (which passes) is the plan."""

    class Registered(JointDiT):
        _cp_plan = {"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                         "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                         "img_ids": ContextParallelInput(split_dim=1, expected_dims=3),
                         "txt_ids": ContextParallelInput(split_dim=1, expected_dims=3)},
                    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}

    torch.manual_seed(0)
    m = Registered().eval()
    _, kw = _joint()
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    assert cp.source == "derived"
    assert "registered plan (diffusers:Registered._cp_plan) not used: TokenAxisError" in cp.notes[0]
    assert "'img_ids' at '<transformer>': expects 3 dims" in cp.notes[0]
    assert resolve_cp_plan(m, capture=lambda: ((), kw), degree=2).source.startswith("diffusers:")  # unchecked


class CausalAttn(Attn):
    def forward(self, x, rotary=None, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class CausalBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = CausalAttn(dim)

    def forward(self, hidden_states):
        return hidden_states + self.attn(hidden_states)


class CausalDiT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.x_embedder = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([CausalBlock(dim) for _ in range(2)])
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states):
        b, c, h, w = hidden_states.shape
        x = self.x_embedder(hidden_states.flatten(2).transpose(1, 2))
        for blk in self.blocks:
            x = blk(hidden_states=x)
        return (self.proj_out(x).transpose(1, 2).reshape(b, c, h, w),)


def test_causal_attention_inside_a_split_block_is_refused_before_launch():
    """A decoder-style block (``is_causal=True``): cache-dit's context-parallel attention raises in
    the ranks ("Causal attention is not yet supported"), a crash; the dry run now refuses the plan
    before launch and names the causal attention. The same model with plain attention passes."""
    torch.manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 4, 4, 4))
    with pytest.raises(DryRunError, match="causal attention"):
        resolve_cp_plan(CausalDiT().eval(), capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    plain = CausalDiT().eval()
    for blk in plain.blocks:
        blk.attn = Attn(16)
    assert resolve_cp_plan(plain, capture=lambda: ((), kw), degree=2, check=verify_before_launch).facts["prelaunch"]["checked"]


class PairOutBlock(nn.Module):
    """Returns (tokens, None): the second stream (an optional modality) is absent."""

    def __init__(self, dim):
        super().__init__()
        self.inner = SingleBlock(dim)

    def forward(self, hidden_states, audio=None):
        return self.inner(hidden_states=hidden_states, rotary=None), audio


class PairOutDiT(ConvOutDiT):
    def __init__(self, dim=16):
        super().__init__(dim)
        self.blocks = nn.ModuleList([PairOutBlock(dim) for _ in range(2)])

    def forward(self, hidden_states):
        b, c, h, w = hidden_states.shape
        x = self.x_embedder(hidden_states.flatten(2).transpose(1, 2))
        audio = None
        for blk in self.blocks:
            x, audio = blk(x, audio)
        return (self.proj_out(x.transpose(1, 2).reshape(b, -1, h, w)),)


def test_a_gather_at_a_module_returning_none_beside_the_tokens_is_refused_before_launch():
    """cache-dit's gather hook raises in every rank on a (tensor, None) output (a crash in the
    coverage table); the dry run re-enacts that check and refuses the plan by name."""
    torch.manual_seed(0)
    m = PairOutDiT().eval()
    kw = dict(hidden_states=torch.randn(1, 4, 4, 4))
    plan = {"blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "blocks.1": [ContextParallelOutput(gather_dim=1, expected_dims=3), None]}
    with pytest.raises(DryRunError, match=r"returns \(Tensor, NoneType\)"):
        dry_run(m, (), kw, plan, 2, ["blocks"])



def test_a_table_axis_as_long_as_the_text_is_not_a_token_axis():
    """The FLUX reference code at a tiny size: ``pe`` [1, 1, 24, 8, 2, 2] (text + image on dim 2,
    head_dim / 2 = 8 on dim 3) with 8 text tokens. Split on dim 2 by the plan, its dim 3 was taken
    for a token axis left whole and every Ulysses plan was refused (TokenAxisError). A tensor split
    along a token axis has no other: it passes; the table left whole is still refused."""
    from ditbook.cp.dryrun import _unsplit_axis

    counts = {16, 8, 24}  # image, text, text + image
    table = [[1, 1, 24, 8, 2, 2]]
    assert _unsplit_axis(table, [[1, 1, 12, 8, 2, 2]], counts, 2) is None
    assert _unsplit_axis(table, [[1, 1, 24, 8, 2, 2]], counts, 2)[2] == 2   # whole: refused on its token axis
    assert _unsplit_axis([[1, 24, 8, 32]], [[1, 12, 4, 32]], counts, 2) is None  # both axes split: fine too


def test_a_dual_stream_list_is_not_left_whole_as_a_refiner():
    """The plan that splits the last main list alone (text joined to the image after refiner
    lists) was also offered where the earlier list is a dual-stream main list taking image and
    text (FLUX's double blocks): ``ulysses2`` then ran the double blocks whole on every rank and
    was reported verified, its sharding check covering the single-stream list only."""
    from ditbook.cp.plan import _last_list_streams

    m, kw = _joint()
    tr = trace_forward(m, (), kw)
    st = find_streams(tr)
    assert st.lists == ["joint_blocks", "single_blocks"]
    assert _last_list_streams(tr, st) is None


def test_streams_passed_into_star_args_are_told_apart_and_the_refusal_names_why():
    """SD3.5's joint blocks take ``forward(self, *args, **kwargs)`` and are called ``block(context, x,
    c=c)``: the binding named the text ``args`` and the image ``kwargs``, the image stream was taken to
    be the text (the first unnamed one) and the gather was planned on the slot the last block returns
    as None. Now the positional elements are ``args[0]``, ``args[1]``, the image is the one the module
    after the list takes, and the plan that would split ``args[1]`` is refused saying cache-dit's split
    hooks cannot name an element of ``*args`` (novel ``textfirst``)."""
    from pathlib import Path

    from ditbook.card import import_class
    from ditbook.cp.sharding import bind_inputs

    class Star(nn.Module):
        def forward(self, *args, **kwargs):
            return args

    assert list(bind_inputs(Star(), (torch.zeros(1), torch.zeros(2)), {"c": 1})) == ["args[0]", "args[1]", "c"]
    net_cls = import_class(str(Path(__file__).parent / "novel" / "textfirst" / "transformer.py"), "TextFirstNet")
    torch.manual_seed(0)
    net = net_cls().eval()
    kw = dict(x=torch.randn(2, 16, 4), t=torch.tensor([0.5, 0.5]), context=torch.randn(2, 6, 16))
    tr = trace_forward(net, (), kw)
    st = find_streams(tr)
    assert (st.image, st.text, st.s_img) == ("args[1]", "args[0]", 16)
    with pytest.raises(PlanCheckError, match=r"an element of \*args, which cache-dit's split hooks cannot name"):
        resolve_cp_plan(net, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
