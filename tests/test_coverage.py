"""The coverage check (issue 13): a fast subset of diffusers' transformer classes through the
stages' checks (``make test``); the full table is ``python benchmarks/coverage.py``."""

from __future__ import annotations

import diffusers
from ditbook import coverage

# one cross-attention image model, one joint two-stream model, one video model
FAST = ("PixArtTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel")


def test_fast_subset_has_no_crash_and_no_wrong():
    rows = coverage.run_coverage([getattr(diffusers, n) for n in FAST], cp=False)
    t = coverage.totals(rows)
    assert t["crash"] == 0 and t["wrong"] == 0, [r.to_dict() for r in rows if r.outcome in ("crash", "wrong")]
    for r in rows:
        assert r.outcome == "correct", r
        assert r.off_max_abs <= coverage.TOLERANCE
        skipped, total = (int(v) for v in r.skipped.split(" of "))
        assert 0 < skipped < total  # caching on really skipped block evaluations
    md = coverage.markdown(rows, 1.0)
    assert "| PixArtTransformer2DModel | correct |" in md and "diffusers " + diffusers.__version__ in md
    assert "not run" in md  # the cp column says so when it was not run (cp=False)


def test_shrink_rules_are_generic():
    class Fake:
        def __init__(self, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                     joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), patch_size=2, eps=1e-6, odd=33):
            pass

    kw = coverage.shrink_config(Fake, 4, heads=2)
    assert kw == {"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
                  "joint_attention_dim": 1024, "axes_dims_rope": (4, 14, 14)}


def test_a_wrong_pattern_is_never_reported_correct(monkeypatch):
    # a deliberately wrong adapter (the image stream declared second): here cache-dit cannot even
    # call the blocks (crash); the check must never pass it
    from ditbook.adapter import build as adapter_mod

    original = adapter_mod.build_cache_adapter

    def wrong(pipe, report, model=None, **kw):
        return original(pipe, report, model, pattern_overrides={b.path: "Pattern_1" for b in report.block_lists})

    monkeypatch.setattr(adapter_mod, "build_cache_adapter", wrong)
    row = coverage.check_class(diffusers.PixArtTransformer2DModel, cp=False)
    assert row.outcome in ("wrong", "crash"), row


def test_cp_column_is_the_probes_own_cp_check(monkeypatch):
    # the CP column comes from ditbook.coverage.cp, not from the parallel stage's public API
    from ditbook import parallel
    from ditbook.coverage import cp

    assert not hasattr(parallel, "coverage_cp")
    monkeypatch.setattr(cp, "coverage_cp", lambda t, a, k: {"outcome": "correct", "reason": "split 2 ways"})
    assert coverage.run_cp(None, {}) == ("correct", "split 2 ways")
    monkeypatch.setattr(cp, "coverage_cp", lambda t, a, k: 1 / 0)
    assert coverage.run_cp(None, {})[0] == "crash"


def test_a_dropped_loop_step_is_reported_wrong(monkeypatch):
    # a folded adapter whose loop body uses block 0's gate for every block: it runs, and
    # silently changes the output; the caching-off comparison must call it wrong
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_integration_mechanisms import LoopWorkInHelper

    from ditbook.adapter import build as adapter_mod

    original = adapter_mod.build_cache_adapter

    def dropped(pipe, report, model=None, **kw):
        good = original(pipe, report, model)
        assert "owner.gates[i]" in good.source
        source = good.source.replace("owner.gates[i]", "owner.gates[0]")
        module = adapter_mod.import_adapter_module(source, None, "dropped_step")
        return adapter_mod.CacheAdapter(pipe, report, good.info, module, source)

    monkeypatch.setattr(adapter_mod, "build_cache_adapter", dropped)
    row = coverage.check_class(LoopWorkInHelper, cp=False)
    assert row.outcome == "wrong" and "caching off differs" in row.reason, row
