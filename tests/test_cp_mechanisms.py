"""Context-parallel mechanisms of issue 23's CP column, one tiny hand-written model each (the shape of
the problem, no model class): masks fitted to the Ulysses attention (``cp_mask``), a list of rotary
tables with one table over the image, rotary tables made from the token count before the blocks
(split at the first block, gathered at the last), a block returning ``(tensor, None)`` as the gather
site, and a last block list over text and image joined after refiner lists. Each test failed on the
code before these mechanisms (refused before launch); the ones that run go through two gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditbook.coverage.cp import coverage_cp
from ditbook.cp.dryrun import verify_before_launch
from ditbook.cp.mask import fit_mask
from ditbook.cp.plan import resolve_cp_plan
from test_cp_prelaunch import Attn, PairOutDiT, _rope  # the pre-launch tests' tiny attention and (tensor, None) model


def _resolve(m, kw):
    return resolve_cp_plan(m, capture=lambda: ((), kw), degree=2, check=verify_before_launch)


# ---------------------------------------------------------------------------------------------
# masks fitted to the Ulysses attention


def test_fit_mask_cuts_heads_and_gathers_the_ranks_own_rows_and_keys():
    """After the all-to-all a rank holds every rank's queries and keys for its share of the heads:
    a mask of all the heads is cut to the rank's, rows and keys of its own tokens are gathered
    (``gather`` here stands in for the ranks: rank 1's part is rank 0's + 100)."""
    q = torch.zeros(1, 3, 4, 8)  # [B, S_local, H, D]
    k = torch.zeros(1, 3, 4, 8)
    mask = torch.arange(4 * 3 * 3, dtype=torch.float).view(1, 4, 3, 3)

    def gather(x, dim):
        return torch.cat([x, x + 100], dim=dim)

    out = fit_mask(mask, q, k, rank=1, degree=2, gather=gather)
    assert list(out.shape) == [1, 2, 6, 6]
    assert torch.equal(out[:, :, :3, :3], mask[:, 2:])  # rank 1: heads 2 and 3
    assert torch.equal(out[:, :, 3:, 3:], mask[:, 2:] + 200)
    # broadcast axes (1) and axes already of every rank's tokens stay as they are
    key_mask = torch.ones(1, 1, 1, 6)
    assert fit_mask(key_mask, q, k, 0, 2, gather) is key_mask


class RowMaskBlock(nn.Module):
    """Builds its attention mask from its own tokens (a key-padding mask expanded over the query
    rows: [B, 1, S, S], as a rank's local sequence gives it)."""

    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)

    def forward(self, hidden_states, keep):
        s = hidden_states.shape[1]
        mask = keep[:, None, None, :].expand(-1, 1, s, -1)
        return hidden_states + self.attn(hidden_states, mask=mask)


class RowMaskDiT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([RowMaskBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states, keep):
        x = self.embed(hidden_states)
        for blk in self.blocks:
            x = blk(x, keep)
        return (self.proj_out(self.norm_out(x)),)


def test_a_mask_built_from_a_ranks_own_tokens_is_gathered_and_runs():
    """Old code: DryRunError "a mask [1, 1, 8, 8] reaches context-parallel attention with 8 query
    rows". Split with the tokens, the block builds [1, 1, 8, 8] from its 8 tokens; the launch
    gathers its rows and keys from every rank: two gloo ranks agree with one process."""
    torch.manual_seed(0)
    m = RowMaskDiT().eval()
    keep = torch.ones(1, 16, dtype=torch.bool)
    keep[:, 5] = keep[:, 12] = False
    kw = {"hidden_states": torch.randn(1, 16, 4), "keep": keep}
    cp = _resolve(m, kw)
    assert "simulated ranks match" in cp.facts["prelaunch"]["simulated_parity"]
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r


def test_the_probe_spawns_where_cuda_is_present(monkeypatch):
    """On a CUDA host the probe's processes come from a clean fork server, never forked from the
    caller (a fork after CUDA was initialised crashed 11 plans there): the model, its inputs and the
    plan travel pickled, and the spawned ranks reach the same verdict."""
    from ditbook.coverage import cp as probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DITBOOK_START_METHOD", raising=False)
    monkeypatch.setattr(probe.mp, "set_forkserver_preload", lambda names: None)  # no server in this process
    assert probe.start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.start_method() == "fork"
    monkeypatch.setenv("DITBOOK_START_METHOD", "spawn")
    torch.manual_seed(0)
    m = RowMaskDiT().eval()
    keep = torch.ones(1, 16, dtype=torch.bool)
    keep[:, 5] = False
    r = coverage_cp(m, (), {"hidden_states": torch.randn(1, 16, 4), "keep": keep}, timeout=90)
    assert r["outcome"] == "correct", r


# ---------------------------------------------------------------------------------------------
# rotary tables


class PairRopeBlock(nn.Module):
    """Self-attention over the image with the image table; the text table (another length) is
    used for a cross attention over the whole text."""

    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)
        self.cross = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, rotary):
        (img_cos, img_sin), (txt_cos, txt_sin) = rotary[:2], rotary[2:]
        h = hidden_states + self.attn(hidden_states, (img_cos, img_sin))
        txt = _rope(encoder_hidden_states, txt_cos, txt_sin).mean(1, keepdim=True)
        return h + self.cross(txt)


class PairRopeDiT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.txt = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([PairRopeBlock(dim) for _ in range(2)])
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states, encoder_hidden_states):
        x, t = self.embed(hidden_states), self.txt(encoder_hidden_states)
        f_img = torch.arange(x.shape[1])[:, None] * torch.linspace(0.1, 1, 4)[None]
        f_txt = torch.arange(t.shape[1])[:, None] * torch.linspace(0.2, 2, 8)[None]
        rotary = (f_img.cos(), f_img.sin(), f_txt.cos(), f_txt.sin())
        for blk in self.blocks:
            x = blk(x, t, rotary)
        return (self.proj_out(x),)


def test_a_list_of_tables_splits_the_image_table_and_keeps_the_text_one():
    """Old code split no table of the list (one has no image axis): TokenAxisError. Now the image
    tables are split on their image axis, the text tables (kept whole text) stay whole."""
    torch.manual_seed(0)
    m = PairRopeDiT().eval()
    kw = {"hidden_states": torch.randn(1, 16, 4), "encoder_hidden_states": torch.randn(1, 6, 4)}
    cp = _resolve(m, kw)
    assert cp.facts["prelaunch"]["block_inputs"]["blocks"]["rotary"] == [[8, 4], [8, 4], [6, 8], [6, 8]]
    assert coverage_cp(m, (), kw, timeout=60)["outcome"] == "correct"


class CountRopeBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = Attn(dim)

    def forward(self, hidden_states, rope):
        return hidden_states + self.attn(hidden_states, rope)


class CountRopeDiT(nn.Module):
    """Makes its rotary table from the embedded stream's token count (positions 0..S-1), adds a long
    skip after the blocks (before any module that takes the tokens)."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([CountRopeBlock(dim) for _ in range(2)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4)

    def forward(self, hidden_states):
        x = self.embed(hidden_states)
        f = torch.arange(x.shape[1])[:, None] * torch.linspace(0.1, 1, 4)[None]
        rope = (f.cos(), f.sin())
        skip = x
        for blk in self.blocks:
            x = blk(x, rope)
        return (self.proj_out(self.norm_out(x + skip)),)


def test_tables_made_from_the_token_count_are_split_once_at_the_first_block():
    """Old code split the stream at the embedding (the forward then made a table of the shard's
    length) and the table again: TokenAxisError. The plan splitting where the first block takes
    the stream and gathering where the last returns it passes, and runs on two gloo ranks."""
    torch.manual_seed(0)
    m = CountRopeDiT().eval()
    kw = {"hidden_states": torch.randn(1, 16, 4)}
    cp = _resolve(m, kw)
    assert "blocks.0" in cp.plan and "blocks.1" in cp.plan and "embed" not in cp.plan
    assert any("every split where a block takes it" in n for n in cp.notes)
    assert coverage_cp(m, (), kw, timeout=60)["outcome"] == "correct"


# ---------------------------------------------------------------------------------------------
# gather sites


def test_a_gather_at_a_block_returning_none_beside_the_tokens_runs():
    """Old code: DryRunError "returns (Tensor, NoneType)" (cache-dit's hooks take tensors only). The
    launch's hooks now gather the tensors of such an output and pass its None: two gloo ranks agree."""
    torch.manual_seed(0)
    m = PairOutDiT().eval()
    kw = {"hidden_states": torch.randn(1, 4, 4, 4)}
    cp = _resolve(m, kw)
    assert cp.plan["blocks.1"].gather_dim == 1
    assert coverage_cp(m, (), kw, timeout=60)["outcome"] == "correct"


class JoinedDiT(nn.Module):
    """Image and text refiner lists, then one list over [text, image] joined; after the blocks the
    forward slices the image back out and reshapes it (no module takes the joined tokens)."""

    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.txt = nn.Linear(4, dim)
        self.noise_refiner = nn.ModuleList([CountRopeBlock(dim) for _ in range(2)])
        self.context_refiner = nn.ModuleList([CountRopeBlock(dim) for _ in range(2)])
        self.layers = nn.ModuleList([CountRopeBlock(dim) for _ in range(2)])
        self.proj_out = nn.Conv2d(dim, 4, 1)

    def forward(self, hidden_states, encoder_hidden_states):
        b, c, h, w = hidden_states.shape
        x = self.embed(hidden_states.flatten(2).transpose(1, 2))
        t = self.txt(encoder_hidden_states)
        for blk in self.noise_refiner:
            x = blk(x, None)
        for blk in self.context_refiner:
            t = blk(t, None)
        j = torch.cat([t, x], dim=1)
        f = torch.arange(j.shape[1])[:, None] * torch.linspace(0.1, 1, 4)[None]
        rope = (f.cos(), f.sin())
        for blk in self.layers:
            j = blk(j, rope)
        x = j[:, t.shape[1]:]
        return (self.proj_out(x.transpose(1, 2).reshape(b, -1, h, w)),)


def test_the_last_list_over_joined_tokens_is_split_alone():
    """Old code: "no module after the blocks takes and returns the image tokens ... nowhere to
    gather them". The plan splitting the joined list alone (the refiners run whole on every rank)
    passes, the sharding check holds that list to half its tokens, and two gloo ranks agree."""
    torch.manual_seed(0)
    m = JoinedDiT().eval()
    kw = {"hidden_states": torch.randn(1, 4, 4, 4), "encoder_hidden_states": torch.randn(1, 8, 4)}
    cp = _resolve(m, kw)
    assert cp.facts["block_lists"] == ["layers"] and cp.facts["sharding_expected"]["layers"]["full"] == 24
    r = coverage_cp(m, (), kw, timeout=60)
    assert r["outcome"] == "correct", r
    assert r["seq_lens"]["layers"] == [{"hidden_states": [12]}] * 2


def test_gqa_through_diffusers_dispatch_is_refused_before_launch_with_the_reason():
    # ACE-Step's processor asks dispatch_attention_fn for enable_gqa when its kv heads are fewer than its
    # query heads; diffusers' templated CP attention raises on that in every rank: refuse, name why
    from diffusers import AceStepTransformer1DModel

    from ditbook.coverage.inputs import _first_running
    from ditbook.cp.attention import templated_attention_refusal

    def tiny(kv):
        m, _, kw = _first_running(AceStepTransformer1DModel, [(32, None), (16, None)],
                                  {"num_attention_heads": 4, "num_key_value_heads": kv}, [])
        return m, kw

    m, kw = tiny(2)
    row = coverage_cp(m, (), kw)
    assert row["outcome"] == "refused", row
    assert "GQA (in 'layers.0.self_attn')" in row["reason"] and "templated" in row["reason"]
    m, kw = tiny(4)  # same class, one kv head per query head: nothing to refuse
    assert templated_attention_refusal(m, (), kw) is None


PATCHED_PLANNER_RUN = """
from diffusers import AnyFlowTransformer3DModel
from ditbook.coverage.cp import coverage_cp
from ditbook.coverage.inputs import tiny_with_inputs
if __name__ == "__main__":
    m, _f, kw = tiny_with_inputs(AnyFlowTransformer3DModel)
    row = coverage_cp(m, (), kw, timeout=90)
    print(row["outcome"], row["source"], row["reason"])
"""


def _run_probe_script(tmp_path, text: str, method: str, timeout: float = 400, **env):
    """``text`` run as a script in a process of its own (a fork server must not outlive the test's
    temporary folder), the probe's start method ``method``, lib/ and tests/ on the path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "probe_script.py"
    script.write_text(text)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DITBOOK_START_METHOD": method, "OMP_NUM_THREADS": "1", **env,
           "PYTHONPATH": os.pathsep.join([str(root / "lib"), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)


FORK_SERVER_ENV = """
import os


def report(queue):
    import torch
    queue.put((os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()))


if __name__ == "__main__":
    from ditbook.coverage import cp as probe

    ctx = probe._context()
    queue = ctx.Queue()
    p = ctx.Process(target=report, args=(queue,))
    p.start()
    print(probe.start_method(), queue.get(timeout=120), os.environ.get("CUDA_VISIBLE_DEVICES"))
    p.join()
"""


def test_the_probes_fork_server_starts_with_no_gpu_visible(tmp_path):
    # the probe runs on the CPU; a process forked from a server whose imports initialised CUDA cannot
    # use CUDA, and a forward that asks (torch.compile inside AnyFlowFARTransformer3DModel's) crashed
    # with "Cannot re-initialize CUDA in forked subprocess" on an H100 host: the server starts with
    # CUDA_VISIBLE_DEVICES empty, and the caller's own setting is left as it was
    done = _run_probe_script(tmp_path, FORK_SERVER_ENV, "forkserver", timeout=300, CUDA_VISIBLE_DEVICES="0")
    assert done.stdout.strip().splitlines()[-1:] == ["forkserver ('', False) 0"], done.stdout[-800:] + done.stderr[-1500:]


MANY_TENSORS_RUN = """
import torch
from torch import nn

from ditbook.coverage.cp import coverage_cp
from test_cp_mechanisms import RowMaskDiT


class ManyTensors(RowMaskDiT):
    def __init__(self):
        super().__init__()
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(2)) for _ in range(300)])


if __name__ == "__main__":
    torch.manual_seed(0)
    m = ManyTensors().eval()
    keep = torch.ones(1, 16, dtype=torch.bool)
    keep[:, 5] = False
    for _ in range(2):  # the second model meets the same fork server
        print(coverage_cp(m, (), {"hidden_states": torch.randn(1, 16, 4), "keep": keep}, timeout=90)["outcome"])
"""


def test_a_model_of_many_tensors_reaches_the_fork_servers_processes(tmp_path):
    # multiprocessing's pickler sends each tensor's storage as a file descriptor of its own: a model of
    # more than ~250 tensors overflowed one message to the fork server ("too many fds"; on the H100 host
    # Kandinsky6Transformer3DModel: OSError Invalid argument, and the next two classes of its shard met
    # a dead server, ConnectionRefusedError). The instance travels as plain pickle bytes.
    done = _run_probe_script(tmp_path, MANY_TENSORS_RUN, "forkserver")
    assert done.stdout.split() == ["correct", "correct"], done.stdout[-800:] + done.stderr[-1500:]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_ranks_get_the_instance_from_before_a_registered_planner_patched_it(tmp_path, method):
    # on a CUDA host the probe spawns its processes (a fork after CUDA is initialised cannot use it):
    # the ranks then receive the transformer pickled; cache-dit's AnyFlow planner patches the instance
    # with a local function, which does not pickle ("Can't pickle local object
    # '_patch_anyflow_unpack_for_cp.<locals>.patched_unpack'"): the ranks get the instance from before
    # the planner and run the planner on their copy
    done = _run_probe_script(tmp_path, PATCHED_PLANNER_RUN, method)
    outcome, source, *_ = (done.stdout.strip().splitlines() or ["? ?"])[-1].split(" ", 2) + [""]
    assert outcome == "correct", done.stdout[-1500:] + done.stderr[-1500:]
    assert source.startswith("cache-dit:"), done.stdout  # the registered planner's plan, patches and all
