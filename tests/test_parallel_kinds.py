"""Tensor, VAE and text-encoder parallel and ditbook's Ring attention: they run, they match one process,
and each rank's record shows what was split — a plan that splits nothing fails with a named error.

Two 2-process gloo launches on the shipped reference model (a trained FLUX): one where every
kind is applied (parity and sharding pass), one where the worker is told to skip the split
(``DITBOOK_PARALLEL_NOOP``: every rank runs the whole part) — parity still passes there, since
every rank computes the whole thing, and the per-rank record is what fails it.
"""

from __future__ import annotations

from pathlib import Path

import math
import pytest
import torch

from ditbook.parallel import run_plans
from ditbook.parallel.plans import PlanNameError, parse_plan, refusal

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "models" / "reference.yaml"
OV = {"generation.steps": 2, "generation.prompts": ["a red circle on the left"], "generation.seeds": [0],
      "runtime.device": "cpu"}
KINDS = ["tp2", "vae2", "te2", "ring2"]
needs_reference = pytest.mark.skipif(not (REPO / "models" / "reference" / "pipeline").is_dir(),
                                     reason="the reference model is not built")


def test_plan_names_of_the_new_kinds():
    assert parse_plan("vae2").world_size == 2 and parse_plan("te2").te == 2
    assert parse_plan("ulysses2_vae2_te2").world_size == 2
    with pytest.raises(PlanNameError, match="vae4 runs on the plan's 2 ranks, so it is vae2"):
        parse_plan("ulysses2_vae4")
    with pytest.raises(PlanNameError, match="expected one of .*vae<N>, te<N>"):
        parse_plan("encoder2")
    assert "not wired" in refusal(parse_plan("cfg2_tp2")) and "not wired" in refusal(parse_plan("tp2+compile"))
    assert refusal(parse_plan("tp2")) is None and refusal(parse_plan("tp2_vae2_te2")) is None


def test_rings_that_are_cache_dits_are_refused_off_cuda():
    from ditbook.parallel.plans import refusal

    assert refusal(parse_plan("ring2"), "cpu") is None  # ditbook's own ring
    for name in ("ring2+cache", "cfg2_ring2", "usp2x2"):
        assert "CUDA only" in refusal(parse_plan(name), "cpu")
        assert refusal(parse_plan(name), "cuda:0") is None


@needs_reference
def test_tp_vae_te_match_one_process_and_record_the_split(tmp_path):
    results, _ = run_plans(REFERENCE, KINDS, 2, tmp_path, overrides=OV, timeout=90, warmup=0)
    by = {r.name: r for r in results}
    for name in KINDS:
        r = by[name]
        assert r.passed and r.error is None, (name, r.quality.reasons)
        assert r.quality.psnr_min > 35 and r.quality.ssim_min > 0.9
    tp = by["tp2"].details["sharding"].kinds["tp"].check
    assert tp["source"] == "diffusers _tp_plan" and tp["sharded_weights"] > 0
    assert tp["local_weight_elements"] == [tp["global_weight_elements"] // 2] * 2
    rank1 = by["tp2"].details["sharding"].ranks[1].kinds["tp"]
    q = next(s for s in rank1["sharded"] if s["name"] == "transformer_blocks.0.attn.to_q.weight")
    assert q["local"][0] * 2 == q["global"][0] and q["placement"] == "S(0)"
    assert rank1["activations"]["transformer_blocks.0.attn.to_q"]["local"] * 2 == \
        rank1["activations"]["transformer_blocks.0.attn.to_q"]["global"]
    vae = by["vae2"].details["sharding"].kinds["vae"].check
    assert vae["bands"] == [[0, vae["latent_height"] // 2], [vae["latent_height"] // 2, vae["latent_height"]]]
    assert min(vae["halo_exchanges"]) > 0 and min(vae["norms_all_reduced"]) > 0 and min(vae["attention_gathers"]) > 0
    te = by["te2"].details["sharding"].kinds["te"].check
    assert set(te["ran_by_rank"]["0"]) == {"text_encoder"} and set(te["ran_by_rank"]["1"]) == {"text_encoder_2"}
    ring = by["ring2"].details["sharding"]
    assert ring.kinds["ring"].check["exchanges"][0] > 0 and not ring.error and ring.check
    lengths = ring.kinds["ring"].check["local_lengths"][1]["transformer_blocks.0.attn"]
    assert lengths == [[40, 40]]  # (16 text + 64 image tokens) / 2 on each rank


@needs_reference
def test_a_plan_that_splits_nothing_fails_with_a_named_error(tmp_path):
    """Every rank runs the whole model: parity is perfect, and the run must still fail."""
    results, _ = run_plans(REFERENCE, KINDS, 2, tmp_path, overrides=OV, timeout=90, warmup=0,
                           env={"DITBOOK_PARALLEL_NOOP": "tp,vae,te,ring"})
    by = {r.name: r for r in results}
    named = {"tp2": "TensorShardingError", "vae2": "VaeShardingError", "te2": "TextEncoderShardingError",
             "ring2": "RingShardingError"}
    for name, error in named.items():
        r = by[name]
        assert r.quality.psnr_min > 35  # parity alone cannot see it
        assert not r.passed and r.error.startswith(error + ":"), (name, r.error)
    assert "planned weights are whole" in by["tp2"].error
    assert "expected 1/2 of it" in by["vae2"].error
    assert "every rank ran the encoder" in by["te2"].error
    assert "no attention call went round the ring" in by["ring2"].error
    assert by["ring2"].details["sharding"].error.startswith("ShardingError")  # the block inputs were whole too


def test_derived_tensor_plan_and_gqa_refusal(tmp_path):
    """No _tp_plan on the third-party GQA model: the plan comes from the traced linear layers;
    KV heads that do not divide by the degree are refused with the reason."""
    from ditbook import zoo
    from ditbook.card import load_card
    from ditbook.loading import load_pipeline, choose_placement
    from ditbook.cp.plan import capture_transformer_call
    from ditbook.accel.tp import TensorParallelRefused, resolve_tensor_plan

    card = load_card(zoo.build("thirdparty", tmp_path), {"runtime.device": "cpu", "generation.steps": 2})
    pipe = load_pipeline(card, choose_placement(card))
    tr = pipe.transformer
    call = capture_transformer_call(pipe, card)
    heads, kv = tr.blocks[0].attn.num_heads, tr.blocks[0].attn.num_kv_heads
    plan = resolve_tensor_plan(tr, 2, heads, kv, call)
    assert plan.source.startswith("derived")
    assert plan.styles["blocks.0.attn.to_q"] == "colwise" and plan.styles["blocks.0.attn.to_v"] == "colwise"
    assert plan.styles["blocks.0.attn.to_out"] == "rowwise"
    assert plan.styles["blocks.0.mlp.0"] == "colwise" and plan.styles["blocks.0.mlp.2"] == "rowwise"
    assert "blocks.0.modulation" not in plan.styles and "blocks.0.attn" in plan.attention
    with pytest.raises(TensorParallelRefused, match=f"GQA: {kv} KV heads are not divisible by tp 4"):
        resolve_tensor_plan(tr, 4, heads, kv, call)


def test_sharding_checks_fail_on_wrong_records():
    from ditbook.accel.tp import TensorShardingError, check_tensor_sharding
    from ditbook.accel.te import TextEncoderShardingError, check_text_encoder_sharding
    from ditbook.accel.vae import VaeShardingError, check_vae_sharding

    plan = {"source": "x"}
    half = {"plan": plan, "sharded": [{"name": "a.weight", "local": [2, 4], "global": [4, 4]}],
            "activations": {"a": {"local": 2, "global": 4}}}
    assert check_tensor_sharding([half, half], 2)["local_weight_elements"] == [8, 8]
    third = {**half, "sharded": [{"name": "a.weight", "local": [1, 4], "global": [4, 4]}]}
    with pytest.raises(TensorShardingError, match="not 1/2"):
        check_tensor_sharding([half, third], 2)
    wide = {**half, "activations": {"a": {"local": 4, "global": 4}}}
    with pytest.raises(TensorShardingError, match="4 wide"):
        check_tensor_sharding([half, wide], 2)
    ok = [{"latent_height": [8], "decoded_rows": [4], "bands": [[0, 4]], "halo_exchanges": 1,
           "norms_all_reduced": 1, "attention_gathers": 0},
          {"latent_height": [8], "decoded_rows": [4], "bands": [[4, 8]], "halo_exchanges": 1,
           "norms_all_reduced": 1, "attention_gathers": 0}]
    assert check_vae_sharding(ok, 2)["bands"] == [[0, 4], [4, 8]]
    same_band = [ok[0], {**ok[1], "bands": [[0, 4]]}]  # both ranks decoded the top half
    with pytest.raises(VaeShardingError, match="do not tile"):
        check_vae_sharding(same_band, 2)
    calls = lambda ran: {"calls": [{"call": i, "component": "text_encoder", "ran": r} for i, r in enumerate(ran)]}
    assert check_text_encoder_sharding([calls([True, False]), calls([False, True])], 2)["calls"] == 2
    with pytest.raises(TextEncoderShardingError, match="only rank"):
        check_text_encoder_sharding([calls([True, True]), calls([False, False])], 2)
    with pytest.raises(TextEncoderShardingError, match="ran on no rank"):
        check_text_encoder_sharding([calls([True, False]), calls([False, False])], 2)


def _blockwise(q, k, v, blocks: int, merge):
    """The ring's maths in one process: each query block's attention over every key block, merged."""
    from ditbook.accel.ring import partial_attention

    scale = q.shape[-1] ** -0.5
    outs = []
    for qb in q.chunk(blocks, dim=-2):
        out = lse = None
        for kb, vb in zip(k.chunk(blocks, dim=-2), v.chunk(blocks, dim=-2)):
            o, l = partial_attention(qb, kb, vb, scale)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        outs.append(out)
    return torch.cat(outs, dim=-2)


def test_ring_merge_is_exact_and_a_wrong_merge_is_caught():
    from ditbook.accel.ring import merge_partials

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, 8, generator=g) * 3 for _ in range(3))  # * 3: peaked softmax rows
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for blocks in (2, 3, 4):
        assert torch.allclose(_blockwise(q, k, v, blocks, merge_partials), ref, atol=1e-5)

    def averaged(out_a, lse_a, out_b, lse_b):  # forgets the log-sum-exp weights
        return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)

    def unrescaled(out_a, lse_a, out_b, lse_b):  # adds the partials without rescaling them
        return out_a + out_b, torch.logaddexp(lse_a, lse_b)

    for wrong in (averaged, unrescaled):
        err = (_blockwise(q, k, v, 2, wrong) - ref).abs().max()
        assert err > 0.1, (wrong.__name__, float(err))


def test_a_vae_the_patch_decode_cannot_split_is_refused_before_launch(tmp_path, capsys):
    """A video VAE (causal 3-D convolutions) is named in the refusal; nothing is launched."""
    from ditbook import zoo
    from ditbook.cli import main

    card = zoo.build("wan", tmp_path)
    rc = main(["parallel", str(card), "--plan", "vae2", "--nproc", "2", "--out", str(tmp_path / "out"),
               "-p", "runtime.device=cpu"])
    err = capsys.readouterr().err
    assert rc == 3 and "vae2: not feasible — decoder.conv_in: WanCausalConv3d" in err, err
    assert not (tmp_path / "out").exists()


def test_ring_merge_with_a_key_mask_matches_sdpa():
    """A key-padding mask split with its keys (one block wholly masked for some rows) merges exactly."""
    from ditbook.accel.ring import merge_partials, partial_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., :3, 4:] = False  # rows 0-2 see nothing of the second key block
    mask[..., 5, :4] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scale = 4 ** -0.5
    o1, l1 = partial_attention(q, k[..., :4, :], v[..., :4, :], scale, mask[..., :4])
    o2, l2 = partial_attention(q, k[..., 4:, :], v[..., 4:, :], scale, mask[..., 4:])
    out, _ = merge_partials(o1, l1, o2, l2)
    assert torch.allclose(out, ref, atol=1e-5)


def test_a_fused_ring_kernel_is_used_only_where_it_agrees_with_the_float32_path():
    """Issue 24 item 5: on CUDA each block's (out, lse) comes from a fused kernel, checked first
    against the float32 path; a kernel whose log-sum-exp is in another base, or that raises, is not
    used. On the CPU the float32 path runs."""
    from ditbook.accel import ring

    def good(q, k, v, scale):
        return ring.reference_partial(q, k, v, scale)

    def log2_lse(q, k, v, scale):  # FlashAttention's internal base-2 lse, returned as if natural
        out, lse = ring.reference_partial(q, k, v, scale)
        return out, lse / math.log(2)

    def raises(q, k, v, scale):
        raise RuntimeError("no kernel for these inputs")

    assert ring._kernel_agrees(good, torch.device("cpu"), torch.float32, 16)
    assert not ring._kernel_agrees(log2_lse, torch.device("cpu"), torch.float32, 16)
    assert not ring._kernel_agrees(raises, torch.device("cpu"), torch.float32, 16)
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert ring.fused_partial(q, q, q, 0.25) is None  # CPU: no fused kernel
    o, l = ring.partial_attention(q, q, q, 0.25)
    ro, rl = ring.reference_partial(q, q, q, 0.25)
    assert torch.equal(o, ro) and torch.equal(l, rl)
