"""MeanCache, Cubic and BlockDance on the tiny third-party model: each skips block evaluations
(counted, not inferred) at cache quality on the calibration and on held-out seeds, its disabled
config reproduces the baseline exactly,
its undo leaves the transformer and its blocks with their own forward; and the quality check
sees a forecast that is wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_cache import prepared_run, session_for, tiny_card  # noqa: E402

NAMES = ["meancache", "cubic", "blockdance"]
# one grid point each that skips on this model (the grid is walked by the stage, not here)
SKIPPING = {"meancache": dict(threshold=3.0, max_consecutive=2), "cubic": dict(threshold=2.0, max_consecutive=2),
            "blockdance": dict(threshold=2.0, interval=2)}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guides_strategies")
    card = tiny_card(tmp, seeds=(0,), prompts=("a red square",))
    run, pipe, report = prepared_run(card, tmp / "outputs")
    s = session_for(card, run, pipe, report)
    s.noise_floor(other_backend=False)
    return s


def _eval(s, name, cfg, holdout: bool = False):
    from ditbook.cache.stage import holdout_cases
    from ditbook.cache.verify import evaluate

    gen = s.card.generation
    if holdout:  # the held-out references the noise floor rendered
        prompts, seeds = holdout_cases(s.card)
        return evaluate(s.pipe, s.card, s.adapter, name, cfg, s.holdout_refs, s.holdout_counts, s.gates, prompts, seeds)
    return evaluate(s.pipe, s.card, s.adapter, name, cfg, s.baseline, s.baseline_counts, s.gates, gen.prompts,
                    gen.seeds)


def _untouched(s):
    t = s.pipe.transformer
    assert "forward" not in t.__dict__ and "_ditbook_wraps" not in t.__dict__
    for _, blocks, _ in s.adapter.block_lists():
        for b in blocks:
            assert "forward" not in b.__dict__ and "_ditbook_wraps" not in b.__dict__
    assert type(t.blocks[0]).__name__ == "TinyGQABlock"  # the patch functor is undone too


@pytest.mark.parametrize("name", NAMES)
def test_strategy_skips_blocks_and_disabled_reproduces(session, name):
    from ditbook import accel

    s = session
    strat = accel.get(name)
    assert strat.applicable(s.adapter) is None
    off = _eval(s, name, strat.disabled(s.adapter, s.card.generation.steps))
    assert off.error is None and off.skipped_fraction == 0.0 and off.quality.max_abs == 0.0, off
    _untouched(s)
    assert strat.Settings(**SKIPPING[name]) in strat.grid(s.adapter, s.card.generation.steps)
    best = _eval(s, name, strat.Settings(**SKIPPING[name]))
    assert best.error is None and best.skipped_fraction > 0.2, best
    assert best.passed and best.quality.psnr_min > 30, best
    _untouched(s)
    # the quality claim on seeds the setting was not picked on: PSNR and SSIM against the gates
    held = _eval(s, name, strat.Settings(**SKIPPING[name]), holdout=True)
    assert held.error is None and held.skipped_fraction > 0.2, held
    assert held.passed and held.quality.psnr_min > s.gates.psnr and held.quality.ssim_min > s.gates.ssim, held
    _untouched(s)


def test_quality_check_sees_a_wrong_forecast(session, monkeypatch):
    """A forecast that drops the last computed output's sign (a broken predictor) must fail the
    gates: the counted skips alone would look like a success."""
    from ditbook import accel
    from ditbook.accel import meancache

    s = session
    cfg = accel.get("meancache").Settings(threshold=3.0, max_consecutive=2)
    good = _eval(s, "meancache", cfg)
    right = meancache.mean_velocity
    monkeypatch.setattr(meancache, "mean_velocity",
                        lambda slot, t, p: (lambda g: g and (-g[0], g[1]))(right(slot, t, p)))
    bad = _eval(s, "meancache", cfg)
    assert good.passed and good.skipped_fraction > 0
    assert bad.skipped_fraction > 0 and not bad.passed and bad.quality.psnr_min < good.quality.psnr_min - 10
    _untouched(s)


def test_blockdance_depth_follows_measured_change(session):
    """The reused depth is measured, not configured: a threshold below every measured change
    reuses nothing; a large one reuses up to the last block, never the last block itself."""
    from ditbook import accel
    from ditbook.render import render_all

    s = session
    bd = accel.get("blockdance")
    depths = {}
    for thr in (1e-6, 100.0):
        undo = bd.enable(s.pipe, s.adapter, bd.Settings(threshold=thr))
        try:
            render_all(s.pipe, s.card, prompts=s.card.generation.prompts, seeds=s.card.generation.seeds)
        finally:
            undo()
        depths[thr] = undo.reuser.depths
    n = s.adapter.info.block_lists[0].length
    assert set(depths[1e-6]) == {0}
    assert max(depths[100.0]) == n - 1
    _untouched(s)


def test_pab_runs_on_third_party_attention(session):
    """PAB hooks the attention modules the inspection finds (TinyGQAAttention is no diffusers
    class): it skips attention evaluations, its disabled config reproduces, undo leaves no hook;
    a model whose blocks have no attention is refused with the reason."""
    from ditbook import accel
    from ditbook.accel.diffusers_pab import attention_targets

    s = session
    pab = accel.get("diffusers_pab")
    assert pab.applicable(s.adapter) is None
    targets = attention_targets(s.adapter.original_blocks())
    assert [type(m).__name__ for m in targets] == ["TinyGQAAttention"] * s.adapter.info.block_lists[0].length
    off = _eval(s, "diffusers_pab", pab.disabled(s.adapter, s.card.generation.steps))
    assert off.error is None and off.quality.max_abs == 0.0 and off.attention_skipped_fraction == 0.0, off
    on = _eval(s, "diffusers_pab", pab.Settings(skip_range=2, window_low=50, window_high=950))
    assert on.error is None and on.attention_skipped_fraction > 0.2, on
    for m in s.pipe.transformer.modules():
        assert not hasattr(m, "_diffusers_hook") or not m._diffusers_hook.hooks
    _untouched(s)

    class NoAttention:
        def original_blocks(self):
            import torch

            return [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())]

    assert "no self-attention module" in pab.applicable(NoAttention())


@pytest.mark.parametrize("name", ["meancache", "cubic"])
def test_forecaster_that_fails_to_install_leaves_the_model_as_it_was(session, name, monkeypatch):
    from ditbook import accel
    from ditbook.accel import _forecast

    def broken(*a, **k):
        raise RuntimeError("install failed half-way")

    monkeypatch.setattr(_forecast, "CallForecaster", broken)
    strat = accel.get(name)
    with pytest.raises(RuntimeError, match="half-way"):
        strat.apply(session.pipe, strat.grid(session.adapter, 8)[0], adapter=session.adapter)
    _untouched(session)
