"""The gap to the limit (issue 25 item 3, ``speedsuite.gap``): FLOPs of one transformer call
counted by ``FlopCounterMode`` (GEMM and attention apart), the computed steps' calls picked from a
row's per-call timing by its schedule mask, and the speed tables' columns beside each row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speedsuite.compose import markdown
from speedsuite.gap import (CallTimer, computed_calls, count_call_flops, gap, gap_cells, gap_notes, measure_peaks,
                            split_flops)


class LinearAttention(torch.nn.Module):
    """One projection and one attention: FLOPs known by hand (2·N·d·d and 4·H·N²·hd)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, n, d = x.shape
        y = self.proj(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        return F.scaled_dot_product_attention(y, y, y)


def test_flops_of_a_projection_and_an_attention_match_the_hand_count():
    d, heads, n = 32, 4, 24
    fl = count_call_flops(LinearAttention(d, heads), (torch.randn(2, n, d),), {})
    assert fl["gemm"] == 2 * 2 * n * d * d
    assert fl["attention"] == 4 * 2 * heads * n * n * (d // heads)  # the CPU's fused SDPA counted too
    assert fl["total"] == fl["gemm"] + fl["attention"] + fl["other"]


def _flux(heads: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)).eval()


def _flux_flops(model, image_tokens: int, text_tokens: int = 4) -> dict:
    kwargs = dict(hidden_states=torch.randn(1, image_tokens, 16), encoder_hidden_states=torch.randn(1, text_tokens, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(image_tokens, 3), txt_ids=torch.zeros(text_tokens, 3), return_dict=False)
    return count_call_flops(model, (), kwargs)


@pytest.fixture(scope="module")
def flux_counts():
    narrow, wide = _flux(2), _flux(4)
    return {"n64": _flux_flops(narrow, 64), "n128": _flux_flops(narrow, 128), "wide64": _flux_flops(wide, 64)}


def test_flux_call_gemm_flops_grow_with_the_tokens_and_attention_with_their_square(flux_counts):
    a, b = flux_counts["n64"], flux_counts["n128"]
    assert a["gemm"] > 0 and a["attention"] > 0
    # per-token linears: (128 + 4) / (64 + 4) = 1.94 (the time/pooled embeddings do not grow)
    assert 1.8 < b["gemm"] / a["gemm"] < 2.0
    assert 3.5 < b["attention"] / a["attention"] < 3.9  # (132 / 68)² = 3.77


def test_flux_call_gemm_flops_grow_with_the_width_squared_and_attention_linearly(flux_counts):
    a, w = flux_counts["n64"], flux_counts["wide64"]
    assert 3.0 < w["gemm"] / a["gemm"] <= 4.0  # width 32 -> 64 (the input and text projections grow once)
    assert a["attention"] > 0 and w["attention"] == 2 * a["attention"]  # twice the heads at the same tokens and head width


def test_split_flops_sorts_operators_by_kind():
    s = split_flops({"aten.mm": 10, "aten.addmm": 5, "aten._scaled_dot_product_flash_attention": 7, "aten.foo": 1})
    assert s == {"total": 23, "gemm": 15, "attention": 7, "other": 1}


def test_call_timer_times_every_call():
    m = torch.nn.Linear(4, 4)
    t = CallTimer(m, cuda=False)
    for _ in range(5):
        m(torch.randn(2, 4))
    t.remove()
    m(torch.randn(2, 4))  # not timed: removed
    secs = t.seconds()
    assert len(secs) == 5 and all(s >= 0 for s in secs)


def test_computed_calls_follow_the_mask_per_pipeline_call_and_per_cfg_call():
    mask = "1101"
    one = [10, 11, 1, 12] * 2  # two pipeline calls, one transformer call per step
    picked, how = computed_calls(one, 2, mask)
    assert picked == [10, 11, 12] * 2 and "3 computed steps of 4" in how
    cfg = [10, 10, 11, 11, 1, 1, 12, 12]  # one pipeline call, two calls per step (true CFG)
    assert computed_calls(cfg, 1, mask)[0] == [10, 10, 11, 11, 12, 12]
    assert computed_calls(one, 2, None)[0] == one  # no schedule: every call computes
    picked, how = computed_calls([1, 2, 3], 1, mask)  # does not map: said so, every call kept
    assert picked == [1, 2, 3] and "do not map" in how


def test_gap_is_flops_at_peak_over_the_computed_step():
    flops = {"total": 3e12, "gemm": 2e12, "attention": 1e12, "other": 0}
    g = gap(flops, {"bf16_tflops": 1000.0, "fp8_tflops": 2000.0}, [0.02, 0.01, 0.03], "x", fp8=True)
    assert g["computed_step_s"] == 0.02 and g["computed_calls"] == 3
    assert g["at_bf16_peak_s"] == pytest.approx(0.003) and g["of_bf16_peak"] == pytest.approx(0.15)
    assert g["at_fp8_peak_s"] == pytest.approx(0.001 + 0.001) and g["of_fp8_peak"] == pytest.approx(0.1)
    bf = gap(flops, {"bf16_tflops": 1000.0, "fp8_tflops": 2000.0}, [0.02], "x", fp8=False)
    assert "at_fp8_peak_s" not in bf  # a bf16 row has no fp8 column
    none = gap(flops, measure_peaks("cpu"), [0.02], "x")
    assert "at_bf16_peak_s" not in none and none["computed_step_s"] == 0.02


def test_no_peak_is_measured_on_a_cpu():
    p = measure_peaks("cpu")
    assert p["bf16_tflops"] is None and "no peak measured" in p["note"]


def _result(peaks: dict) -> dict:
    flops = {"total": 4e12, "gemm": 3e12, "attention": 1e12, "other": 0, "counter": "FlopCounterMode"}
    rows = [{"row": "eager", "status": "measured", "speedup": 1.0, "first_call_s": 9.0, "params": {},
             "timing": {"end_to_end": {"median": 10.0, "min": 9.9, "max": 10.1}},
             "gap": gap(flops, peaks, [0.02], "every call")},
            {"row": "cache+fp8+compile", "status": "measured", "speedup": 2.5, "first_call_s": 90.0,
             "params": {"fp8": {"layers": 10, "quantized": 10}},
             "timing": {"end_to_end": {"median": 4.0, "min": 3.9, "max": 4.1}},
             "gap": gap(flops, peaks, [0.016], "computed", fp8=True)},
            {"row": "cache+compile+graph", "status": "refused", "reason": "GraphUnavailable: no CUDA"}]
    return {"shape": "flux-full", "size": 1024, "steps": 28, "device": "cuda", "dtype": "torch.bfloat16",
            "schedule": {"name": "s", "mask": "11", "computed": 2}, "compile_backend": "inductor", "repeats": 3,
            "env": {}, "rows": rows, "flops": flops, "peaks": peaks}


def test_the_compose_table_carries_the_gap_columns_of_each_row():
    peaks = {"bf16_tflops": 800.0, "fp8_tflops": 1600.0, "gemm": "8192x8192x8192", "method": "m",
             "device_name": "GPU", "fp8": "e4m3"}
    md = markdown(_result(peaks))
    header = next(line for line in md.splitlines() if line.startswith("| configuration"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    for c in ("computed step (s)", "at bf16 peak (s)", "of bf16 peak", "at fp8 peak (s)", "of fp8 peak"):
        assert c in cols
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in md.splitlines() if line.startswith("| eager") or line.startswith("| cache")}
    assert all(len(r) == len(cols) for r in rows.values()), (cols, rows)
    eager = dict(zip(cols, rows["eager"]))
    assert eager["computed step (s)"] == "0.02" and eager["at bf16 peak (s)"] == "0.005"
    assert eager["of bf16 peak"] == "25.0%" and eager["of fp8 peak"] == "–"
    fp8 = dict(zip(cols, rows["cache+fp8+compile"]))
    # 3 TFLOP GEMM at 1600 + 1 TFLOP attention at 800 = 3.125 ms of 16 ms
    assert float(fp8["at fp8 peak (s)"]) == pytest.approx(0.003125, rel=2e-3) and fp8["of fp8 peak"] == "19.5%" and fp8["of bf16 peak"] == "31.2%"
    assert dict(zip(cols, rows["cache+compile+graph"]))["configuration"] == "cache+compile+graph"
    assert "bf16 800.0 TFLOP/s" in md and "attention 1, other 0" in md


def test_the_compose_table_says_when_no_peak_was_measured():
    md = markdown(_result(measure_peaks("cpu")))
    assert "no peak measured" in md
    assert gap_cells(_result(measure_peaks("cpu"))["rows"][0]).split("|")[2].strip() == "–"
    assert gap_notes({"peaks": {}})[0] == "FLOPs not counted."
    no_attn = gap_notes({"flops": {"total": 2, "gemm": 2, "attention": 0, "other": 0}, "peaks": {}})
    assert "No attention operator was counted" in no_attn[1]
    assert not any("No attention" in line for line in gap_notes(_result({})))
