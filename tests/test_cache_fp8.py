"""The cache stage's fp8 search (card ``cache.fp8``, ``ditbook.cache.fp8_tune``) and the verdict's
choice between it and the plain configuration.

On the CPU fp8 cannot run (it is refused with the reason); the search itself is checked with a
stand-in quantizer that adds a known error at the layers it is given (forward hooks, removed by
its undo): one layer much worse than the rest, so the search must find it by measurement, fail
with every layer quantized and pass once the most sensitive share is kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_cache import prepared_run, session_for, tiny_card  # noqa: E402

BAD = "blocks.2.ff.2"  # the one layer the stand-in quantizer damages badly


def noisy_quantizer(bad: str = BAD, small: float = 1e-4, large: float = 5.0):
    """(transformer, layer names) -> undo: each named linear's output gets a deterministic error,
    ``large`` (relative) at ``bad``, ``small`` elsewhere; the undo removes the hooks."""
    calls = []

    def quantize(transformer, layers):
        calls.append(list(layers))
        modules = dict(transformer.named_modules())
        handles = []
        for name in layers:
            eps = large if name == bad else small

            def hook(module, args, out, eps=eps):
                return out + eps * out.abs().mean() * torch.sin(out * 37.0)
            handles.append(modules[name].register_forward_hook(hook))

        def undo():
            for h in handles:
                h.remove()
        return undo

    quantize.calls = calls
    return quantize


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8tune")
    card = tiny_card(tmp, fp8=True, fp8_keep=[0.0, 0.25], strategies=["dbcache"], max_configs=4)
    run, pipe, report = prepared_run(card, tmp / "outputs")
    s = session_for(card, run, pipe, report)
    s.noise_floor()
    s.adapter_checks()
    s.tune()
    assert s.choose() is not None
    return card, run, pipe, report, s


def test_on_the_cpu_the_fp8_search_is_refused_with_the_reason_and_changes_nothing(fp8_run):
    card, run, pipe, report, s = fp8_run
    n = len(s.results)
    rec = s.fp8_tune()
    assert rec.ran is False and "CUDA" in rec.refused and rec.reason.startswith("fp8 refused")
    assert len(s.results) == n
    assert s.write_results().fp8 == rec


def test_off_by_default(tmp_path):
    from ditbook.card import load_card

    card = load_card(str(tiny_card(tmp_path)), {})
    assert card.cache.fp8 is False and card.cache.fp8_keep == [0.0, 0.25, 0.5]


def test_the_search_keeps_the_most_sensitive_layers_until_the_held_out_seeds_pass(fp8_run):
    card, run, pipe, report, s = fp8_run
    ref = pipe.transformer
    probe = {k: v.clone() if torch.is_tensor(v) else v for k, v in _one_call(s).items()}
    with torch.no_grad():
        before = ref(**probe)[0].clone()
    q = noisy_quantizer()
    rec = s.fp8_tune(quantize=q)
    assert rec.ran is True and rec.candidates == 42 and rec.strategy == s.chosen.name
    assert rec.shipped_quantizer is False  # a stand-in: the fresh-process rerun is not asked to apply it
    # measured, not named: the damaged layer ranks first
    assert rec.sensitivity[0]["layer"] == BAD
    assert rec.sensitivity[0]["rel_error"] > 10 * rec.sensitivity[1]["rel_error"]
    # every layer in fp8 fails on held-out seeds (or already on calibration); the most
    # sensitive quarter kept passes
    t0, t1 = rec.tries
    assert (t0["kept"], t0["quantized"], t0["passed"]) == (0, 42, False)
    assert (t1["kept"], t1["quantized"], t1["passed"]) == (10, 32, True)
    chosen = rec.chosen
    assert BAD in chosen.kept and BAD not in chosen.layers and len(chosen.layers) == 32
    assert chosen.holdout_quality.psnr_min > s.gates.psnr
    # the rows of the search carry their split and fp8 record; the plain choice is untouched
    rows = [r for r in s.results if r.split.startswith("fp8-")]
    assert {r.split for r in rows} == {"fp8-calibration", "fp8-holdout", "fp8-chosen"}
    assert all(r.fp8 and r.fp8["quantized"] in (42, 32) for r in rows)
    assert s.choose().name == rec.strategy
    # the calibration images of the composition are saved for the fresh-process rerun
    saved = sorted(p.stem for p in (s.ctx.dir / chosen.images).glob("*.npy"))
    assert saved == sorted(s.baseline)
    # every quantization was undone: the transformer computes what it did before
    with torch.no_grad():
        after = ref(**probe)[0]
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not any(m._forward_hooks for m in ref.modules())
    # the benchmark gets the composition as its own row, its layers applied by the row
    res = s.write_results()
    assert res.fp8.chosen.layers == chosen.layers
    json.dumps(res.to_dict())
    from types import SimpleNamespace

    from ditbook.benchmark.inputs import cache_configs

    cfgs = cache_configs(SimpleNamespace(run=run, card=s.card), run.read_results("cache"))
    f8 = [c for c in cfgs if "fp8" in c.params]
    assert len(f8) == 1 and f8[0].params["fp8"]["layers"] == len(chosen.layers) and f8[0].name.endswith("+fp8[32/42]")


def _one_call(session) -> dict:
    from ditbook.accel.fp8 import capture_calls
    from ditbook.cache.verify import render_set

    gen = session.card.generation
    calls = capture_calls(session.pipe.transformer,
                          lambda: render_set(session.pipe, session.card, gen.prompts[:1], gen.seeds[:1]), every=100)
    return calls[0]


def test_with_every_layer_passing_at_the_first_share_no_sensitivity_is_measured(fp8_run):
    card, run, pipe, report, s = fp8_run
    gentle = noisy_quantizer(large=1e-4)  # no layer stands out: every layer in fp8 passes
    rec = s.fp8_tune(quantize=gentle)
    assert rec.chosen is not None and rec.chosen.kept == [] and len(rec.chosen.layers) == 42
    assert rec.sensitivity == [] and "not measured" in rec.sensitivity_note
    assert all(len(c) == 42 for c in gentle.calls)  # the search and the saved render: no one-layer ranking


def test_a_quantizer_too_harsh_for_every_share_leaves_no_composition(fp8_run):
    card, run, pipe, report, s = fp8_run
    harsh = noisy_quantizer(small=5.0)  # every layer damaged: no share of kept layers is enough
    rec = s.fp8_tune(quantize=harsh)
    assert rec.ran is True and rec.chosen is None
    assert [t["passed"] for t in rec.tries] == [False, False]
    assert "no schedule" in rec.reason


# -- the verdict -------------------------------------------------------------------------
PLAIN, F8 = "dbcache[threshold=0.2]", "dbcache[threshold=0.1]+fp8[32/42]"


def _cache(fp8_repro_ok=True, fp8_psnr=33.0):
    from records_fixtures import cache_record, holdout_row, quality

    from ditbook.records import Fp8Choice, Fp8Search, Reproduction

    plain = holdout_row("dbcache", {"threshold": 0.2}, 34.0, 0.98, 0.5)
    f8 = Fp8Choice("dbcache", "cache", {"threshold": 0.1}, [f"l{i}" for i in range(32)], 42,
                   kept=[f"k{i}" for i in range(10)], skipped_fraction=0.4, holdout_quality=quality(fp8_psnr, 0.97))
    return cache_record([plain], chosen=plain, fp8=Fp8Search(ran=True, chosen=f8),
                        reproduction=Reproduction(ran=True, ok=True, max_abs=0.0,
                                                  fp8={"max_abs": 0.0 if fp8_repro_ok else 0.2, "ok": fp8_repro_ok}))


def _bench(plain=1.5, fp8=1.8, fp8_passed=True):
    from records_fixtures import bench_record, config_row

    return bench_record([config_row(PLAIN, plain), config_row(F8, fp8, passed=fp8_passed)])


def test_the_verdict_ships_the_fp8_composition_only_when_faster_correct_and_reproduced():
    from ditbook.benchmark.verdict import headline, verdict

    v = verdict(_bench(), _cache())
    assert v.ship and v.name == F8 and v.speedup == 1.8 and v.form == "fp8"
    assert v.holdout.psnr_min == 33.0 and v.fp8 == {"layers": 32, "candidates": 42, "kept": 10}
    assert f"Ship {F8}" in headline(v)
    assert [r["name"] for r in v.runner_ups] == [PLAIN] and v.runner_ups[0]["why_not"].startswith("slower")

    for bench, cache, why in ((_bench(fp8=1.2), _cache(), None),
                              (_bench(), _cache(fp8_repro_ok=False), "fresh process differs"),
                              (_bench(fp8_passed=False), _cache(), "do not pass the gates"),
                              (_bench(), _cache(fp8_psnr=29.0), "does not pass the gates")):
        v = verdict(bench, cache)
        assert v.name == PLAIN and v.speedup == 1.5 and v.ship, why
        if why:
            assert why in next(r["why_not"] for r in v.refused if r["name"] == F8), v.refused
        else:  # slower: a runner-up
            assert v.runner_ups[0]["name"] == F8 and v.runner_ups[0]["why_not"].startswith("slower")


def test_the_fp8_composition_and_its_compiled_twin_are_verdict_rows_timed_warm():
    from types import SimpleNamespace

    from ditbook.benchmark.stage import verdict_rows
    from ditbook.records import Fp8Search

    def ctx_for(cache):
        return SimpleNamespace(run=SimpleNamespace(results_or_none=lambda stage: cache if stage == "cache" else None))

    plain = {PLAIN, PLAIN + "+compile"}
    assert verdict_rows(ctx_for(_cache())) == plain | {F8, F8 + "+compile"}
    no_fp8 = _cache()
    no_fp8.fp8 = Fp8Search(reason="cache.fp8 is off")
    assert verdict_rows(ctx_for(no_fp8)) == plain


def test_the_verdict_line_on_fp8_says_what_became_of_it():
    from ditbook.benchmark.verdict import fp8_text, verdict
    from ditbook.records import Fp8Search

    shipped = fp8_text(verdict(_bench(), _cache()), _cache())
    assert shipped == "fp8: shipped with 32 of 42 block linears in fp8 (10 kept in the model's dtype), the schedule tuned with them."
    slower = fp8_text(verdict(_bench(fp8=1.2), _cache()), _cache())
    assert slower.startswith(f"fp8: the composition {F8} was not shipped: slower (1.20× against 1.50×")
    for rec, want in ((Fp8Search(refused="fp8 needs a CUDA GPU", reason="fp8 refused: fp8 needs a CUDA GPU"),
                       "fp8: refused: fp8 needs a CUDA GPU."),
                      (Fp8Search(ran=True, reason="no schedule of dbcache passed on held-out seeds"),
                       "fp8: no composition: no schedule of dbcache passed on held-out seeds."),
                      (Fp8Search(reason="cache.fp8 is off"), "")):
        cache = _cache()
        cache.fp8 = rec
        assert fp8_text(verdict(_bench(), cache), cache) == want


def test_result_md_and_the_report_carry_the_fp8_line(tmp_path):
    from ditbook.benchmark.report import build_report, result_markdown
    from synthetic_run import make_synthetic_run

    from ditbook.records import Fp8Search
    from ditbook.runs import RunFolder

    run_dir = make_synthetic_run(tmp_path / "a")
    run = RunFolder(run_dir)
    cache = run.read_results("cache")
    assert "fp8:" not in result_markdown(run_dir)  # the card did not ask for fp8: no line
    cache.fp8 = Fp8Search(refused="fp8 needs a CUDA GPU of compute capability >= 8.9", reason="fp8 refused")
    run.write_results("cache", cache)
    line = "fp8: refused: fp8 needs a CUDA GPU of compute capability >= 8.9."
    md = result_markdown(run_dir)
    assert line in md and md.index(line) < md.index("| check |")
    html = build_report(run_dir).read_text()
    assert f'<div id="fp8">{line.replace(">", "&gt;")}</div>' in html


def test_an_empty_configuration_has_one_row_name_everywhere():
    from ditbook.benchmark.shown import chosen_row_name, fp8_row_name, holdout_records
    from ditbook.configuration import fp8_suffix, row_name

    assert row_name("scm", {}) == "scm" and row_name("scm", {"mask": [1, 0]}) == "scm"
    assert row_name("dbcache", {"threshold": 0.1, "mask": [1]}) == "dbcache[threshold=0.1]"
    from records_fixtures import cache_record, holdout_row

    scm = holdout_row("scm", {}, 34.0, 0.98, 0.5)
    cache = cache_record([scm], chosen=scm, fp8=_cache().fp8)
    cache.fp8.chosen.name, cache.fp8.chosen.config = "scm", {"mask": [1, 0, 1]}
    assert chosen_row_name(cache.chosen) == "scm"
    assert fp8_row_name(cache) == "scm" + fp8_suffix({"layers": cache.fp8.chosen.layers, "candidates": 42}) == "scm+fp8[32/42]"
    assert set(holdout_records(cache)) == {"scm", "scm+fp8[32/42]"}
