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
from ditbook.cp.dryrun import PlanCheckError, verify_before_launch
from ditbook.cp.plan import resolve_cp_plan


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


@pytest.mark.parametrize("mode", ["heads", "tokens"])
def test_a_mask_repeated_over_the_heads_or_applied_to_the_tokens_now_runs(mode):
    """Old code refused both before launch ("with 2 heads reaches context-parallel attention"; "the
    dry run fails"). A mask over all the heads is cut to each rank's heads at the Ulysses attention
    (``cp_mask``); a [B, S] mask that also multiplies the tokens is split with them at every block
    and its keys gathered back at the attention. Two gloo ranks agree with one process."""
    m, kw = _masked(mode)
    cp = _resolve(m, kw)
    assert "simulated ranks match" in cp.facts["prelaunch"]["simulated_parity"]
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r


class PlainBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = MaskedAttn(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, hidden_states):
        h = hidden_states + self.attn(self.norm(hidden_states))
        return h + self.mlp(h)


class OddDiT(nn.Module):
    """Self attention over 17 tokens (16 patches and one extra token, dropped at the end)."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.extra = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList([PlainBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states):
        x = torch.cat([self.extra.expand(hidden_states.shape[0], -1, -1), self.embed(hidden_states)], dim=1)
        for blk in self.blocks:
            x = blk(hidden_states=x)
        return (self.proj_out(self.norm_out(x))[:, 1:],)


def _odd():
    torch.manual_seed(0)
    return OddDiT().eval(), {"hidden_states": torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(0))}


def test_a_token_count_the_degree_does_not_divide_is_split_unevenly_where_the_launch_allows_it():
    """Old code: "17 image tokens do not divide into 2 equal shards" (and no ``uneven``). With
    ``uneven`` the plan splits 17 into [9, 8], the simulated ranks (each its tensor_split share, the
    alone dry run gathering back to 17) match one process, and the plan says the launch needs
    ``ulysses_anything``; without it (a ring plan) the count is still refused."""
    from ditbook.cp.plan import PlanDerivationError, needs_ulysses_anything

    m, kw = _odd()
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch, uneven=True)
    assert needs_ulysses_anything(cp)
    assert any("[9, 8]" in u for u in cp.facts["prelaunch"]["uneven_splits"])
    assert "simulated ranks match" in cp.facts["prelaunch"]["simulated_parity"]
    with pytest.raises(PlanDerivationError, match="17 image tokens do not divide"):
        _resolve(m, kw)
    with pytest.raises(PlanDerivationError, match="do not divide"):  # 17 tokens cannot give 32 ranks one each
        resolve_cp_plan(m, capture=lambda: ((), kw), degree=32, check=verify_before_launch, uneven=True)


def _uneven_rank(rank, init_file, m, kw, plan, queue):
    import torch.distributed as dist
    from cache_dit.distributed.core import _ContextParallelConfig, _enable_context_parallelism
    from torch.distributed.device_mesh import init_device_mesh

    from ditbook.cp.attention import route_attention
    from ditbook.cp.uneven import gather_unevenly
    from ditbook.cp.sharding import BlockInputRecorder

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        route_attention(m)
        rec = BlockInputRecorder(m)
        cpc = _ContextParallelConfig(ulysses_degree=2, ring_degree=1, ulysses_anything=True)
        cpc.setup(rank, 2, torch.device("cpu"), mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("ring", "ulysses")))
        _enable_context_parallelism(m, config=cpc, cp_plan=plan)
        changed = gather_unevenly(m)
        with torch.no_grad():
            out = m(**kw)[0]
        queue.put((rank, changed, rec.to_dict()["blocks"]["seq_lens"], out.numpy().copy()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, None, repr(exc), None))


def test_uneven_shares_run_on_two_gloo_ranks_with_cache_dits_ulysses_anything(tmp_path):
    """cache-dit's ulysses_anything splits 17 tokens [9, 8] and runs the all-to-all; its gather (one
    all_gather of unequal tensors) is refused by gloo, so ``gather_unevenly`` pads inside the
    collective: each rank's blocks get their share and the output equals one process's."""
    import multiprocessing as mp

    m, kw = _odd()
    cp = resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch, uneven=True)
    with torch.no_grad():
        ref = m(**kw)[0]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_uneven_rank, args=(r, str(tmp_path / "rdv"), m, kw, cp.plan, queue), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (c, s, o)) for r, c, s, o in (queue.get(timeout=90) for _ in range(2)))
    for p in procs:
        p.join(timeout=10)
    assert all(got[r][0] for r in range(2)), got  # the gather changed on both ranks (no error)
    assert [got[r][1]["hidden_states"] for r in range(2)] == [[9], [8]]
    assert torch.allclose(torch.from_numpy(got[0][2]), ref, atol=1e-5)


def test_cp_takes_the_transformer_level_entry_where_the_pipelines_name_prefix_registration_does_not_build():
    """cache-dit's pipeline-level entry finds a pipeline's registration by class-name prefix; a
    third-party ``Flux...`` pipeline whose transformer has other block lists made ``ulysses2`` fail
    there (fluxref, issue 23 item 10). Such a pipeline now takes the transformer-level entry."""
    from ditbook.parallel.worker import _pipeline_entry_fits

    class FluxReferencePipeline:  # named like cache-dit's FLUX registration, blocks named otherwise
        def __init__(self):
            self.transformer = OddDiT()

    class TinyOwnPipeline(FluxReferencePipeline):
        pass

    assert not _pipeline_entry_fits(FluxReferencePipeline())
    assert _pipeline_entry_fits(TinyOwnPipeline())
