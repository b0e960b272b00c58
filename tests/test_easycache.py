"""EasyCache (``ditbook.accel.easycache``), the technique added in one file: on the tiny GQA model
it skips transformer calls with the quality the gates ask, keeps nothing between generations,
reproduces the baseline exactly with its skipping off, says so when it skipped nothing, and is
undone exactly. The cache stage finds it through the registry (no stage names it)."""

from __future__ import annotations

import numpy as np
import pytest

from ditbook import accel
from ditbook.accel.technique import NothingDone


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_cache import prepared_run, session_for, tiny_card

    tmp = tmp_path_factory.mktemp("easycache")
    card = tiny_card(tmp, steps=12, seeds=(0,))
    run, pipe, report = prepared_run(card, tmp / "outputs")
    return session_for(card, run, pipe, report, only=["easycache"])


def _render(s):
    from ditbook.cache.verify import render_set

    gen = s.card.generation
    return render_set(s.pipe, s.card, gen.prompts, gen.seeds)


def _run(s, settings):
    tech = accel.get("easycache")
    h = tech.apply(s.pipe, settings, adapter=s.adapter, steps=s.card.generation.steps)
    try:
        return _render(s), h.record()
    finally:
        h.undo()


def test_registered_as_a_cache_technique_the_stage_finds():
    assert "easycache" in accel.names("cache")


def test_skips_calls_within_the_gates_and_off_reproduces_the_baseline(tiny):
    from ditbook.quality import compare_sets

    tech = accel.get("easycache")
    base = _render(tiny)
    _, plain = _run(tiny, tech.disabled(tiny.adapter, 12))
    off, rec_off = _run(tiny, tech.disabled(tiny.adapter, 12))
    assert all(np.array_equal(off[k], base[k]) for k in base)
    with pytest.raises(NothingDone, match="skipped no block evaluation"):
        tech.check(rec_off.against(plain.to_dict()))
    got, rec = _run(tiny, tech.Settings(threshold=0.1, warmup_steps=2))
    rec = rec.against(plain.to_dict())
    tech.check(rec)
    assert 0.2 < rec.skipped_fraction < 1.0 and rec.transformer_calls == plain.transformer_calls
    q = compare_sets(got, base, tiny.card.cache.gates)
    assert q.passed, q.reasons
    # a larger threshold skips more
    _, more = _run(tiny, tech.Settings(threshold=0.35, warmup_steps=2))
    assert more.block_evals < rec.block_evals


def test_each_generation_starts_clean_and_undo_is_exact(tiny):
    tech = accel.get("easycache")
    forward = type(tiny.pipe.transformer).forward
    h = tech.apply(tiny.pipe, tech.Settings(threshold=0.2), adapter=tiny.adapter, steps=12)
    try:
        first, again = _render(tiny), _render(tiny)
    finally:
        h.undo()
    assert all(np.array_equal(first[k], again[k]) for k in first)  # no state carried over
    assert "forward" not in tiny.pipe.transformer.__dict__ and type(tiny.pipe.transformer).forward is forward


def test_a_call_whose_output_shape_differs_is_always_computed():
    """A transformer whose output is not its input's shape gives the cache no transformation
    vector: every call runs, and the record shows nothing skipped."""
    import torch

    from ditbook.accel.easycache import EasyCacheSettings, RuntimeCache

    calls = []

    def original(hidden_states, timestep):
        calls.append(1)
        return hidden_states[..., :2] * 0.5

    cache = RuntimeCache(EasyCacheSettings(threshold=10.0, warmup_steps=1), branches=1)
    x = torch.ones(1, 4, 3)
    for t in (900, 800, 700, 600):
        cache(original, hidden_states=x * t / 1000, timestep=torch.tensor([t]))
    assert len(calls) == 4 and cache.skipped == 0
