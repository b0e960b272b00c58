"""Architecture inspection on tiny random models built here (no weights, no network)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ditbook.inspect.code_surface import code_surface
from ditbook.approval import check_approval, plan_hash
from ditbook.inspect.plan import build_plan, write_plan
from ditbook.arch.static import inspect_transformer
from ditbook.arch.trace import trace_calls, trace_pipeline


def tiny(name):
    import diffusers as d

    if name == "flux":
        return d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                        guidance_embeds=True, axes_dims_rope=(4, 6, 6)), "FluxPipeline"
    if name == "hunyuandit":
        return d.HunyuanDiT2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, hidden_size=16,
                                   num_layers=4, sample_size=8, cross_attention_dim=16, cross_attention_dim_t5=16,
                                   pooled_projection_dim=8, text_len=4, text_len_t5=4,
                                   use_style_cond_and_image_meta_size=False), "HunyuanDiTPipeline"
    if name == "wan":
        return d.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                       out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                       rope_max_seq_len=32), "WanPipeline"
    if name == "pixart":
        return d.PixArtTransformer2DModel(sample_size=8, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                          in_channels=4, out_channels=8, cross_attention_dim=16,
                                          caption_channels=16), "PixArtAlphaPipeline"
    if name == "sd3":
        return d.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                       num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                       pooled_projection_dim=16, out_channels=4), "StableDiffusion3Pipeline"
    if name == "qwenimage":
        return d.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                             num_attention_heads=2, joint_attention_dim=16,
                                             axes_dims_rope=(4, 6, 6)), "QwenImagePipeline"
    raise KeyError(name)


# expected: block list -> (length, forward pattern); modulation; static loop-work flag
EXPECTED = {
    "flux": ({"transformer_blocks": (1, "Pattern_1"), "single_transformer_blocks": (2, "Pattern_1")}, "per_block", False),
    "hunyuandit": ({"blocks": (4, "Pattern_3")}, "none", True),
    "wan": ({"blocks": (2, "Pattern_2")}, "shared", False),
    "pixart": ({"transformer_blocks": (2, "Pattern_3")}, "shared", False),
    "sd3": ({"transformer_blocks": (2, "Pattern_1")}, "per_block", False),
    "qwenimage": ({"transformer_blocks": (2, "Pattern_1")}, "per_block", False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_static_inspection_and_cache_dit_agreement(name):
    model, pipe_cls = tiny(name)
    report = inspect_transformer(model, pipe_cls)
    lists, modulation, loop_work = EXPECTED[name]
    assert {b.path: (b.length, b.forward_pattern) for b in report.block_lists} == lists
    assert report.modulation == modulation
    assert report.loop_extra_work is loop_work
    assert report.attention.heads == 2 and report.attention.kv_heads == 2 and report.attention.gqa_ratio == 1.0
    assert 0 < sum(b.param_share for b in report.block_lists) < 1
    # other module lists (attention's to_out, feed-forward nets) are not taken for blocks
    assert all(".to_out" not in b.path and ".net" not in b.path for b in report.block_lists)
    # cache-dit's own registration for this class: same lists, a pattern that runs the blocks
    sup = report.support
    assert sup.cache_dit_adapter is not None
    assert sorted(p for t in sup.cache_dit_blocks for p in t.split("+")) == sorted(lists)
    for b in report.block_lists:
        assert b.cache_dit_pattern in b.compatible_patterns, (b.path, b.cache_dit_pattern, b.compatible_patterns)
        assert b.cache_dit_pattern == b.forward_pattern
    assert not any("DISAGREE" in a for a in sup.agreement)


def test_meta_device_inspection():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=128,
                                       num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                                       guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    report = inspect_transformer(model, "FluxPipeline")
    assert [(b.path, b.length) for b in report.block_lists] == [("transformer_blocks", 2), ("single_transformer_blocks", 3)]
    assert (report.attention.heads, report.attention.head_dim, report.attention.kind) == (24, 128, "joint")
    assert report.support.diffusers_cp_plan and report.support.diffusers_hook_blocks["FluxTransformerBlock"]


def test_hunyuandit_trace_finds_skip_connections():
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    model, _ = tiny("hunyuandit")
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4))

    def run():
        model(torch.randn(2, 4, 8, 8), torch.tensor([1.0, 1.0]), encoder_hidden_states=torch.randn(2, 4, 16),
              text_embedding_mask=torch.ones(2, 4), encoder_hidden_states_t5=torch.randn(2, 4, 16),
              text_embedding_mask_t5=torch.ones(2, 4), image_rotary_emb=rope)

    report = trace_calls(model, run, inspect_transformer(model, "HunyuanDiTPipeline"))
    b = report.block_list("blocks")
    assert report.traced and report.loop_extra_work
    assert any("skip connection" in r for r in report.loop_extra_work_reasons)
    assert b.call.positional == ["hidden_states"] and "encoder_hidden_states" in b.call.keywords
    assert b.call.varying_arguments == ["skip"] and b.call.outputs == 1 and b.forward_pattern == "Pattern_3"
    assert report.attention.kind == "cross" and report.attention.cross_attention_len == 8
    assert report.attention.image_seq_len == 16


# --- a third-party model: GQA attention, blocks called by keyword with their own names, loop work
class GQAAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(b, n, self.n_kv_heads, -1).transpose(1, 2)
        v = self.wv(x).view(b, n, self.n_kv_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = GQAAttention(dim, 4, 2)
        self.ada_mod = nn.Linear(dim, 2 * dim)

    def forward(self, x, cond):
        shift, scale = self.ada_mod(cond)[:, None].chunk(2, dim=-1)
        return x + self.attn(x * (1 + scale) + shift)


class ThirdParty(nn.Module):
    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.layers = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.level_emb = nn.Parameter(torch.randn(depth, dim))
        self.head = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x, cond):
        for i, layer in enumerate(self.layers):
            x = layer(x=x, cond=cond)
            x = x + self.level_emb[i]
        return self.head[0](x)


def test_third_party_gqa_keyword_calls_and_loop_work():
    model = ThirdParty()
    report = inspect_transformer(model)
    assert [b.path for b in report.block_lists] == ["layers"]  # not "head"
    assert (report.attention.heads, report.attention.kv_heads, report.attention.gqa_ratio) == (4, 2, 2.0)
    assert report.loop_extra_work  # from the source: x = x + self.level_emb[i]
    report = trace_calls(model, lambda: model(torch.randn(1, 8, 32), torch.randn(1, 32)), report)
    b = report.block_list("layers")
    assert b.call.positional == [] and b.call.keywords == ["x", "cond"]
    # the pattern from the traced roles, run through a fold that renames x -> hidden_states
    assert b.forward_pattern == "Pattern_3" and "traced streams ['x']" in b.pattern_reason
    assert any("changed between block 0 and 1" in r for r in report.loop_extra_work_reasons)
    assert report.attention.native_gqa and report.modulation == "per_block"
    plan = build_plan(report, None, None)
    ids = {r["id"] for r in plan["risks"]}
    assert {"gqa_path", "dropped_loop_work", "keyword_called_blocks", "renamed_streams"} <= ids
    assert [p["degrees"] for p in plan["parallel_candidates"] if p["kind"] == "ulysses"] == [[2]]


def test_code_surface_classifies_flux_source():
    import inspect

    import diffusers.models.transformers.transformer_flux as mod

    model, _ = tiny("flux")
    report = inspect_transformer(model, "FluxPipeline")
    surface = code_surface([inspect.getsourcefile(mod)], report)
    c = surface.counts
    assert surface.total == sum(c.values()) > 300
    assert c["adapter"] > 20 and c["attention_parallel"] > 50 and c["library"] > c["adapter"]
    assert surface.port_estimate_lines == 0  # registered adapter, no active loop work, _cp_plan


@pytest.fixture(scope="module")
def flux_pipe():
    from ditbook.zoo.flux import build_pipeline

    pipe = build_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _card(tmp_path, extra=""):
    from ditbook.card import load_card
    from ditbook.zoo.flux import GENERATION
    import yaml

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "path": str(tmp_path), "generation": GENERATION,
                                    "pipeline": {"class": "FluxPipeline", "source": "diffusers"},
                                    "transformer": {"class": "FluxTransformer2DModel", "source": "diffusers"}}) + extra)
    return load_card(path)


def test_flux_pipeline_trace(flux_pipe, tmp_path):
    card = _card(tmp_path)
    report = trace_pipeline(flux_pipe, card, steps=2)
    assert report.cfg.style == "distilled" and report.cfg.calls_per_step == 1.0 and report.cfg.steps_traced == 2
    assert report.cfg.cache_dit_separate_cfg is False
    assert not report.loop_extra_work and report.loop_work_conditional  # controlnet residuals: off
    for b in report.block_lists:
        assert b.call.keywords[:2] == ["hidden_states", "encoder_hidden_states"] and b.call.positional == []
        assert b.call.output_roles == ["encoder_hidden_states", "hidden_states"] and b.forward_pattern == "Pattern_1"
    assert report.attention.kind == "joint" and report.attention.text_seq_len == 16


def test_plan_hash_stable_and_approval_invalidated_by_model_change(flux_pipe, tmp_path):
    from ditbook.approval import approve
    from ditbook.card import load_card
    from ditbook.runs import RunFolder
    from ditbook.context import ApprovalError

    card = _card(tmp_path)
    outputs = tmp_path / "outputs"

    from ditbook.records import InspectResults

    def inspected_run(model, run_id):
        report = inspect_transformer(model, "FluxPipeline")
        run = RunFolder.create(card, outputs, run_id=run_id)
        plan = build_plan(report, None, card)
        write_plan(run.stage_dir("inspect"), plan)
        run.write_results("inspect", InspectResults(plan_hash=plan["hash"], transformer_class="T"))
        return run, plan

    run1, plan1 = inspected_run(tiny("flux")[0], "r1")
    run2, plan2 = inspected_run(tiny("flux")[0], "r2")
    assert plan1["hash"] == plan2["hash"] == plan_hash(plan1)  # same model + card: same hash
    with pytest.raises(ApprovalError, match="ditbook approve") as refused:
        check_approval(card, run2)
    # the command names the plan's run, so it works whatever outputs root the run used
    assert f"--run {run2.path}" in str(refused.value)
    approve(card, run2.stage_dir("inspect") / "plan.json")
    card = load_card(card.card_path)
    assert card.approved_plan == plan2["hash"] and check_approval(card, run2)["hash"] == plan2["hash"]
    later = RunFolder.create(card, outputs, run_id="r2b")  # a run without inspect results uses the latest plan
    assert check_approval(card, later)["hash"] == plan2["hash"]

    from diffusers import FluxTransformer2DModel

    changed = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                     num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                     guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    run3, plan3 = inspected_run(changed, "r3")
    assert plan3["hash"] != plan2["hash"]
    with pytest.raises(ApprovalError, match=f"ditbook approve {card.card_path}"):
        check_approval(card, run3)


def test_approve_cli_without_runs(tmp_path, capsys):
    from ditbook.cli import main

    card = _card(tmp_path)
    assert main(["approve", str(card.card_path), "--outputs", str(tmp_path / "none"), "--yes"]) == 2
    assert "ditbook inspect" in capsys.readouterr().err


def test_a_gated_mlp_three_times_as_wide_is_no_fused_qkv():
    """minRF's FeedForward at dim 64: w1 and w3 write 192 = 3 x 64 (LLaMA's SwiGLU width rounded to
    a multiple of 32), w2 maps it back. Taken for an attention with a fused qkv, it made the model's
    ``fused_qkv`` true and the TP judge refuse on it; a real fused qkv sits beside a square output
    projection."""
    from torch import nn

    from ditbook.arch.static import shaped_projections

    class FeedForward(nn.Module):
        def __init__(self, dim=64, hidden=192):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Linear(dim, hidden)

    class FusedAttention(nn.Module):
        def __init__(self, dim=64):
            super().__init__()
            self.packed, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    assert shaped_projections(FeedForward()) == {}
    assert set(shaped_projections(FusedAttention())) == {"qkv"}
