"""``benchmarks/video_gpu.py`` (issue 16, item 5): the Wan-shaped speed benchmark, at a tiny shape on
the CPU. The record says what ran (the last block's calls), so a cache that skips nothing shows."""

from __future__ import annotations

import json

import pytest

from speedsuite.video import WAN_1_3B, main, tokens


def test_wan_shape_tokens_match_the_published_count():
    # 480x832, 81 frames: 21 latent frames of 60x104, patches of 1x2x2 -> 32,760 tokens (issue 16)
    assert tokens(WAN_1_3B, 480, 832, 81) == 32760


def test_tiny_cpu_run_records_what_ran(tmp_path):
    assert main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--steps", "6", "--computed", "4",
                 "--repeats", "1", "--rows", "eager,cache"]) == 0
    res = json.loads((tmp_path / "video_tiny.json").read_text())
    by = {r["row"]: r for r in res["rows"]}
    assert by["eager"]["last_block_calls"] == 12  # true CFG: two transformer calls per step, all computed
    assert by["cache"]["last_block_calls"] == 8  # 4 computed steps x 2 calls: the rest really skipped
    assert res["schedule"]["computed"] == 4 and by["cache"]["speedup"] > 0
    md = (tmp_path / "video_tiny.md").read_text()
    assert "| cache |" in md and "computed step (s)" in md and "no peak measured" in md
    # the gap columns: two calls per step, only the computed steps' calls of the cache row
    assert by["eager"]["gap"]["computed_calls"] == 12 and by["cache"]["gap"]["computed_calls"] == 8
    assert res["flops"]["gemm"] > 0 and res["flops"]["attention"] > 0


def test_a_schedule_file_that_chose_none_refuses_the_cache_rows_and_runs_the_rest(tmp_path):
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"card": "models/video_reference.yaml", "steps": 6, "gates": {"psnr": 30.0, "ssim": 0.9},
                                "chosen": None, "schedules": [
                                    {"name": "ditbook-w3c5", "computed": 5, "calibration": {"psnr_min": 28.9}},
                                    {"name": "ditbook-w2c4", "computed": 4, "calibration": {"psnr_min": 21.0}}]}))
    out = tmp_path / "a"
    assert main(["--out", str(out), "--tiny", "--device", "cpu", "--steps", "6", "--repeats", "1",
                 "--rows", "eager,cache", "--schedule-file", str(none)]) == 0
    res = json.loads((out / "video_tiny.json").read_text())
    by = {r["row"]: r for r in res["rows"]}
    assert by["eager"]["status"] == "measured" and by["eager"]["speedup"] == 1.0
    assert by["cache"]["status"] == "refused" and "chose no schedule" in by["cache"]["reason"]
    assert "ditbook-w3c5 (5/6 computed), gave 28.90 dB" in by["cache"]["reason"] and res["schedule"] is None
    assert "| cache | refused: " in (out / "video_tiny.md").read_text()
    # a file that chose one: the cache row runs exactly that mask
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"steps": 6, "chosen": {"name": "picked", "mask": "110101", "taylorseer_order": 0}}))
    out = tmp_path / "b"
    assert main(["--out", str(out), "--tiny", "--device", "cpu", "--steps", "6", "--repeats", "1",
                 "--rows", "eager,cache", "--schedule-file", str(one)]) == 0
    res = json.loads((out / "video_tiny.json").read_text())
    by = {r["row"]: r for r in res["rows"]}
    assert res["schedule"]["name"] == "picked" and by["cache"]["last_block_calls"] == 8  # 4 computed x 2 calls
    with pytest.raises(SystemExit, match="has 6 steps, this run 8"):
        main(["--out", str(tmp_path / "c"), "--tiny", "--device", "cpu", "--steps", "8", "--repeats", "1",
              "--rows", "eager,cache", "--schedule-file", str(one)])
