"""Issue 13: a CP plan whose split is right (every block gets S / degree tokens) but whose output
is wrong used to pass every check before launch and be caught only by the parity of the
2-process run (``wrong`` in the coverage table: PRXTransformer2DModel, WanVACETransformer3DModel).
The dry run now also simulates every rank in one process (``cp_dryrun.simulate_ranks``: one
thread per rank, each with its own splits, CP attention over every rank's keys, gathers that
concatenate, attention that its processor runs locally kept local) and compares the output with
the plain forward: a plan that differs is refused before launch with where it parts and why.
Each model here is small and has the shape of one mechanism."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import nn

import ditbook.cp.dryrun as cp_dryrun
from ditbook.coverage.cp import coverage_cp
from ditbook.cp.dryrun import ParityError, check_parity, dry_run, verify_before_launch
from ditbook.cp.plan import derive_cp_plan, find_streams, resolve_cp_plan, trace_forward


# --- 1. keys of a whole sequence concatenated with split keys inside a CP attention (PRX) -------

class ConcatKeysAttention(nn.Module):
    """Image queries against [text keys, image keys], concatenated inside the attention."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.txt_kv, self.o = (nn.Linear(dim, dim), nn.Linear(dim, 2 * dim),
                                                nn.Linear(dim, 2 * dim), nn.Linear(dim, dim))

    def forward(self, x, ctx):
        b, s, d = x.shape

        def heads(t):
            return t.view(b, t.shape[1], self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).chunk(2, dim=-1)
        tk, tv = self.txt_kv(ctx).chunk(2, dim=-1)
        k, v = torch.cat([heads(tk), heads(k)], dim=2), torch.cat([heads(tv), heads(v)], dim=2)
        out = F.scaled_dot_product_attention(heads(self.q(x)), k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class ConcatKeysBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attention = ConcatKeysAttention(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        x = hidden_states + self.attention(self.norm(hidden_states) + temb[:, None], encoder_hidden_states)
        return x + self.mlp(x)


class ConcatKeysDiT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.img_in = nn.Linear(4, dim)
        self.txt_in = nn.Linear(6, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([ConcatKeysBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        x, c, temb = self.img_in(hidden_states), self.txt_in(encoder_hidden_states), self.time(timestep[:, None])
        for blk in self.blocks:
            x = blk(x, c, temb)
        return (self.proj_out(self.norm_out(x)),)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 6, generator=g),
                timestep=torch.tensor([0.5]))


def test_whole_keys_joined_to_split_keys_are_refused_and_the_text_split_instead(monkeypatch):
    # the derived plan keeps the text whole (cross attention); the attention joins the text's keys
    # to the image's inside a CP attention, so gathered from the ranks the text counts twice
    torch.manual_seed(0)
    m, kw = ConcatKeysDiT().eval(), _inputs()
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    assert cp.notes[0].startswith("derived plan splitting where the streams are made not used: ParityError"), cp.notes
    assert ("attention 'blocks.0.attention': it runs as CP attention, and 8 of the 16 keys each rank gives it hold "
            "the same values on every rank") in cp.notes[0] and "count 2 times" in cp.notes[0], cp.notes[0]
    # the plan that splits the text with the image passes: each rank holds a slice of the text
    assert any(n.startswith("split text tokens (cross attention whose keys join") for n in cp.notes), cp.notes
    assert cp.plan["txt_in"][0].split_dim == 1 and cp.plan["txt_in"][0].split_output
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct" and r["source"] == "derived", r
    # before: the text-whole plan passed the checks before launch and the 2-process run differed
    monkeypatch.setattr(cp_dryrun, "check_parity", lambda *a, **k: None)
    old = coverage_cp(m, (), kw, timeout=60)
    assert old["outcome"] == "wrong" and "output differs from one process" in old["reason"], old


def test_whole_keys_that_cannot_be_split_are_refused_before_launch():
    # 7 text tokens do not divide into 2: the text-split plans cannot be made, and the text-whole
    # plan is refused with the simulation's reason (before: launched, `wrong`)
    torch.manual_seed(0)
    m, kw = ConcatKeysDiT().eval(), _inputs()
    kw["encoder_hidden_states"] = kw["encoder_hidden_states"][:, :7]
    with pytest.raises(ParityError, match=r"count 2 times.*the plan splitting the text with the image: "
                                          r"PlanDerivationError: 7 text tokens do not divide"):
        resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)


# --- 2. a split input that an attention its processor runs locally takes as keys (WanVACE) ------

class LocalCrossProcessor:
    """As diffusers' Wan processor: CP attention for self-attention only; cross attention runs
    locally on each rank (``parallel_config`` None)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None):
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        k = attn.to_k(ctx).unflatten(2, (attn.heads, -1))
        v = attn.to_v(ctx).unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(q, k, v, backend=self._attention_backend,
                                    parallel_config=self._parallel_config if encoder_hidden_states is None else None)
        return attn.to_out(out.flatten(2))


class ProcessorAttention(nn.Module, AttentionModuleMixin):
    _default_processor_cls = LocalCrossProcessor
    _available_processors = [LocalCrossProcessor]

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.set_processor(LocalCrossProcessor())

    def forward(self, hidden_states, encoder_hidden_states=None):
        return self.processor(self, hidden_states, encoder_hidden_states)


class CrossBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1, self.attn2 = ProcessorAttention(dim), ProcessorAttention(dim)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        x = hidden_states + self.attn1(self.norm1(hidden_states) + temb[:, None])
        return x + self.attn2(self.norm2(x), encoder_hidden_states)


class CrossDiT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.img_in = nn.Linear(4, dim)
        self.txt_in = nn.Linear(6, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([CrossBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        x, c, temb = self.img_in(hidden_states), self.txt_in(encoder_hidden_states), self.time(timestep[:, None])
        for blk in self.blocks:
            x = blk(x, c, temb)
        return (self.proj_out(self.norm_out(x)),)


class TextSplitPlanDiT(CrossDiT):
    """A registered plan that splits the text at every block (as cache-dit's WanVACE planner
    does), while the processor runs cross attention locally: each rank's queries see half the text."""

    _cp_plan = {"blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
                "blocks.*": {"encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
                "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


def test_split_keys_of_a_local_attention_are_refused_and_the_derived_plan_used(monkeypatch):
    torch.manual_seed(0)
    m, kw = TextSplitPlanDiT().eval(), _inputs()
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    assert cp.source == "derived", cp.source
    note = cp.notes[0]
    assert "registered plan (diffusers:TextSplitPlanDiT._cp_plan) not used: ParityError" in note, note
    assert "attention 'blocks.0.attn2': it runs as local attention on each rank" in note, note
    assert "over the 4 keys the rank holds" in note, note
    # the derived plan keeps the text whole: the probe found attn2 local and attn1 CP
    assert cp.facts["prelaunch"]["local_attention"] == ["blocks.0.attn2", "blocks.1.attn2"]
    assert cp.facts["prelaunch"]["simulated_parity"].startswith("simulated ranks match one process")
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct" and r["source"] == "derived", r
    # before: the registered plan passed the checks and the 2-process run differed
    monkeypatch.setattr(cp_dryrun, "check_parity", lambda *a, **k: None)
    old = coverage_cp(m, (), kw, timeout=60)
    assert old["outcome"] == "wrong" and old["source"].startswith("diffusers:"), old


def test_the_simulation_matches_one_process_on_a_right_plan_and_fails_a_wrong_gather():
    """The simulation itself can fail: the right derived plan matches one process (and the probe
    finds the self-attention CP, the cross attention local); with the tokens put in the wrong
    order at the gather site (same shapes: every earlier check passes) it does not."""
    torch.manual_seed(0)
    m, kw = CrossDiT().eval(), _inputs()
    tr = trace_forward(m, (), kw)
    st = find_streams(tr)
    plan = derive_cp_plan(m, (), kw, trace=tr).plan
    run = dry_run(m, (), kw, plan, 2, st.lists)
    assert run.cp_calls == {("blocks.0.attn1", 0): 0, ("blocks.0.attn2", 0): None,
                            ("blocks.1.attn1", 0): 0, ("blocks.1.attn2", 0): None}
    assert check_parity(m, (), kw, plan, 2, st.lists, run) < 1e-5
    # the tokens reordered where they are gathered: same shapes, every check before passes
    site = next(k for k, v in plan.items() if not isinstance(v, dict))

    def reversed_gather(mod, a, out):
        return torch.cat(out.chunk(2, dim=1)[::-1], dim=1)
    h = m.get_submodule(site).register_forward_hook(reversed_gather)
    try:
        with pytest.raises(ParityError, match="max rel. error"):
            check_parity(m, (), kw, plan, 2, st.lists, run)
    finally:
        h.remove()


# --- 3. a second list that takes the image tokens unchanged at every block (VACE hints) ---------

class HintBlock(nn.Module):
    """Takes the image tokens (the same tensor at every block), carries a control stream, returns
    (hint, control); the main blocks add the hints by index."""

    def __init__(self, dim, first):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim) if first else None
        self.inner = CrossBlock(dim)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, control_hidden_states, temb):
        c = control_hidden_states
        if self.proj_in is not None:
            c = self.proj_in(c) + hidden_states
        c = self.inner(c, encoder_hidden_states, temb)
        return self.proj_out(c), c


class HintDiT(CrossDiT):
    def __init__(self, dim=16):
        super().__init__(dim)
        self.patch = nn.Conv2d(4, dim, 1)  # tokens made by flatten/transpose: no module returns them
        self.control_patch = nn.Conv2d(4, dim, 1)
        self.hint_blocks = nn.ModuleList([HintBlock(dim, i == 0) for i in range(2)])

    def forward(self, hidden_states, control_hidden_states, encoder_hidden_states, timestep):
        x = self.patch(hidden_states).flatten(2).transpose(1, 2)
        c = self.control_patch(control_hidden_states).flatten(2).transpose(1, 2)
        ctx, temb = self.txt_in(encoder_hidden_states), self.time(timestep[:, None])
        hints = []
        for blk in self.hint_blocks:
            hint, c = blk(x, ctx, c, temb)
            hints.append(hint)
        for i, blk in enumerate(self.blocks):
            x = blk(x, ctx, temb) + hints[i]
        return (self.proj_out(self.norm_out(x)),)


def test_a_tensor_every_block_takes_unchanged_is_split_at_every_block_and_where_it_enters_later_lists():
    # before: the image tokens were split only where they enter hint_blocks.0 (the next hint block
    # got them whole), the carried control stream at every hint block (split twice), and the main
    # blocks got them whole: the dry run failed ("size of tensor a (8) must match ... (16)"),
    # refused. Now: split at every hint block, the control stream once, again at blocks.0
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = HintDiT().eval()
    kw = dict(hidden_states=torch.randn(1, 4, 4, 4, generator=g), control_hidden_states=torch.randn(1, 4, 4, 4, generator=g),
              encoder_hidden_states=torch.randn(1, 8, 6, generator=g), timestep=torch.tensor([0.5]))
    tr = trace_forward(m, (), kw)
    assert tr.lists["hint_blocks"].unchanged == {"hidden_states", "encoder_hidden_states", "temb"}
    plan = derive_cp_plan(m, (), kw, degree=2, trace=tr).plan
    assert set(plan["hint_blocks.*"]) == {"hidden_states"} and set(plan["hint_blocks.0"]) == {"control_hidden_states"}
    assert set(plan["blocks.0"]) == {"hidden_states"}
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct" and r["source"] == "derived", r
    for lname in ("hint_blocks", "blocks"):  # 16 image tokens, 8 on each rank, in every block list
        assert [rank["hidden_states"] for rank in r["seq_lens"][lname]] == [[8], [8]], r["seq_lens"]


# --- 4. an output that is a list of per-sample tensors; a final layer chosen from a ModuleDict --

class ListOutDiT(ConcatKeysDiT):
    """Returns ``([sample],)`` as a per-sample list (no tensor at the top level), its final layer
    picked from a ModuleDict by a key (as a model with one final layer per patch size)."""

    def __init__(self, dim=16):
        super().__init__(dim)
        self.final = nn.ModuleDict({k: nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4)) for k in ("2-1", "1-1")})

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        x, c, temb = self.img_in(hidden_states), self.txt_in(encoder_hidden_states), self.time(timestep[:, None])
        for blk in self.blocks:
            x = blk(x, c, temb)
        return (list(self.final["2-1"](x).unbind(0)),)


def test_a_list_output_is_compared_not_passed_and_a_module_dict_entry_is_planned_reachably():
    torch.manual_seed(0)
    m, kw = ListOutDiT().eval(), _inputs()
    kw["encoder_hidden_states"] = kw["encoder_hidden_states"][:, :7]  # the text cannot be split (see test 1)
    # before: the output held no top-level tensor, so the simulated parity returned None (a pass)
    # and the text-whole plan went on to the launch and came out `wrong`
    with pytest.raises(ParityError, match="count 2 times"):
        resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)
    # a plan whose gather sits on a ModuleDict entry names the dict (cache-dit's lookup hooks every
    # entry and cannot name 'final.2-1'); the dry run hooks the entries the same way
    kw = _inputs()
    cp = derive_cp_plan(m, (), kw, degree=2, split_text=True)
    assert "final" in cp.plan and not any(k.startswith("final.") for k in cp.plan), list(cp.plan)
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r


def test_nothing_to_compare_is_not_a_pass():
    class NoTensorOut(ConcatKeysDiT):
        def forward(self, *a, **k):
            return {"not": "a tensor"}

    m, kw = NoTensorOut().eval(), _inputs()
    with pytest.raises(ParityError, match="holds no tensor"):
        check_parity(m, (), kw, {}, 2, ["blocks"], dry_run_stub())


def dry_run_stub():
    return type("Run", (), {"cp_calls": set()})()


class MeshReadingDiT(ConcatKeysDiT):
    """A forward that reads the device mesh from the parallel config itself (as a registered
    planner's patched forward does)."""

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        cfg = getattr(self, "_cp_config", None)
        if cfg is not None:
            cfg._flattened_mesh.size()
        return super().forward(hidden_states, encoder_hidden_states, timestep)


def test_a_forward_that_reads_the_mesh_is_refused_with_that_reason():
    torch.manual_seed(0)
    r = coverage_cp(MeshReadingDiT().eval(), (), _inputs(), timeout=60)
    assert r["outcome"] == "refused", r
    assert "'_flattened_mesh' of the parallel config is read by the forward" in r["reason"], r["reason"]
