"""``benchmarks/fp8_profile.py``: the kernel kinds of a profiled call (real kernel names from the
H200 profile of 2026-12-03), re-reading a saved profile, and the CPU path of ``--graph``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fp8_profile  # noqa: E402

SAVED = REPO / "docs" / "benchmarks" / "fp8-graph-h200-2026-12-03" / "fp8_profile.json"


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT", "fp8 gemm"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "bf16 gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0", "attention"),
    # inductor kernels whose names carry the ops they fused: the quantization ones, not a GEMM or attention
    ("triton_poi_fused__scaled_mm__to_copy_cat_clamp_div_gelu_permute_t_unsqueeze_view_5", "quantize"),
    ("triton_red_fused_abs_amax_cat_gelu_permute_view_3", "quantize"),
    ("triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention__to_copy_add_mul_neg_permute", "fused (inductor)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_kernel_kinds(name, kind):
    assert fp8_profile.kernel_kind(name) == kind


def test_a_saved_profile_is_re_read_by_kind_and_adds_up(tmp_path):
    saved = json.loads(SAVED.read_text())
    bf16, fp8 = saved["rows"]
    for r in (bf16, fp8):
        by = fp8_profile.kinds_from_table(r["profile"]["table"], r["profile"]["gpu_ms"])
        assert sum(by.values()) == pytest.approx(r["profile"]["gpu_ms"], abs=0.01)
        assert by["other"] < 2.0  # the 40-row table reaches nearly all of the call's GPU time
    by = fp8_profile.kinds_from_table(fp8["profile"]["table"], fp8["profile"]["gpu_ms"])
    assert by["bf16 gemm"] == 0 and 40 < by["fp8 gemm"] < 43  # aten::_scaled_mm's own total is 42.9 ms
    assert fp8_profile.kinds_from_table(bf16["profile"]["table"], bf16["profile"]["gpu_ms"])["fp8 gemm"] == 0
    assert fp8_profile.main(["--out", str(tmp_path), "--reread", str(SAVED)]) == 0
    md = (tmp_path / "fp8_profile.md").read_text()
    assert "| fp8-row | 251.43 | 0.1144 | 1.15× | 0.0984 | 1.32× | 42.68 |" in md, md


def test_graph_is_refused_with_its_reason_off_cuda():
    import torch

    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        fp8_profile.graph_call(lambda: None, torch.device("cpu"))
