"""Pipeline-level inspection of the zoo models (CFG style, calls per step, call conventions)."""

from __future__ import annotations

import pytest

# name -> (CFG style, transformer calls per step)
CFG = {
    "flux": ("distilled", 1.0),
    "sd3": ("batched", 1.0),
    "pixart": ("batched", 1.0),
    "hunyuandit": ("batched", 1.0),
    "qwenimage": ("separate", 2.0),
    "wan": ("separate", 2.0),
}


def _build(name, tmp_path):
    from ditbook import zoo
    from ditbook.card import load_card
    from ditbook.loading import load_pipeline

    card = load_card(zoo.build(name, tmp_path / name))
    return load_pipeline(card), card


@pytest.mark.parametrize("name", sorted(CFG))
def test_zoo_pipeline_cfg_and_calls(name, tmp_path):
    from ditbook.inspect.stage import run_inspection, save_inspection

    pipe, card = _build(name, tmp_path)
    result = run_inspection(pipe, card)
    report = result.report
    style, per_step = CFG[name]
    assert (report.cfg.style, report.cfg.calls_per_step) == (style, per_step)
    assert report.traced and all(b.call and b.call.calls_per_forward == b.length for b in report.block_lists)
    # the separate-CFG flag a cache adapter would get matches what the run did
    assert result.plan["cache_adapter"]["has_separate_cfg"] is (style == "separate")
    assert not any(r["id"] == "separate_cfg_flag" and r["severity"] == "high" for r in result.plan["risks"])
    results = save_inspection(tmp_path / "inspect", result)
    assert results.plan_hash == result.plan["hash"] and (tmp_path / "inspect" / "plan.md").is_file()


def test_zoo_thirdparty_gqa(tmp_path):
    from ditbook.inspect.stage import run_inspection

    pipe, card = _build("thirdparty", tmp_path)
    report = run_inspection(pipe, card).report
    assert report.attention.kv_heads < report.attention.heads
    assert report.loop_extra_work
    assert any(b.call.keywords for b in report.block_lists)
