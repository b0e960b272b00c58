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
    assert rec["ran"] is False and "CUDA" in rec["refused"] and rec["reason"].startswith("fp8 refused")
    assert len(s.results) == n
    assert s.write_results()["fp8"] == rec


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
    assert rec["ran"] is True and rec["candidates"] == 42 and rec["strategy"] == s.chosen["name"]
    assert rec["shipped_quantizer"] is False  # a stand-in: the fresh-process rerun is not asked to apply it
    # measured, not named: the damaged layer ranks first
    assert rec["sensitivity"][0]["layer"] == BAD
    assert rec["sensitivity"][0]["rel_error"] > 10 * rec["sensitivity"][1]["rel_error"]
    # every layer in fp8 fails on held-out seeds (or already on calibration); the most
    # sensitive quarter kept passes
    t0, t1 = rec["tries"]
    assert (t0["kept"], t0["quantized"], t0["passed"]) == (0, 42, False)
    assert (t1["kept"], t1["quantized"], t1["passed"]) == (10, 32, True)
    chosen = rec["chosen"]
    assert BAD in chosen["kept"] and BAD not in chosen["layers"] and len(chosen["layers"]) == 32
    assert chosen["holdout_quality"]["psnr_min"] > s.gates.psnr
    # the rows of the search carry their split and fp8 record; the plain choice is untouched
    rows = [r for r in s.results if r.split.startswith("fp8-")]
    assert {r.split for r in rows} == {"fp8-calibration", "fp8-holdout", "fp8-chosen"}
    assert all(r.fp8 and r.fp8["quantized"] in (42, 32) for r in rows)
    assert s.choose()["name"] == rec["strategy"]
    # the calibration images of the composition are saved for the fresh-process rerun
    saved = sorted(p.stem for p in (s.ctx.dir / chosen["images"]).glob("*.npy"))
    assert saved == sorted(s.baseline)
    # every quantization was undone: the transformer computes what it did before
    with torch.no_grad():
        after = ref(**probe)[0]
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not any(m._forward_hooks for m in ref.modules())
    # the benchmark gets the composition as its own row, its layers applied by the row
    res = s.write_results()
    assert res["fp8"]["chosen"]["layers"] == chosen["layers"]
    json.dumps(res)
    from ditbook.cache import configs_from_results

    cfgs = configs_from_results(res, run_dir=run.path)
    assert [c.fp8 is not None for c in cfgs].count(True) == 1 and cfgs[-1].fp8["layers"] == chosen["layers"]


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
    assert rec["chosen"] is not None and rec["chosen"]["kept"] == [] and len(rec["chosen"]["layers"]) == 42
    assert rec["sensitivity"] == [] and "not measured" in rec["sensitivity_note"]
    assert all(len(c) == 42 for c in gentle.calls)  # the search and the saved render: no one-layer ranking


def test_a_quantizer_too_harsh_for_every_share_leaves_no_composition(fp8_run):
    card, run, pipe, report, s = fp8_run
    harsh = noisy_quantizer(small=5.0)  # every layer damaged: no share of kept layers is enough
    rec = s.fp8_tune(quantize=harsh)
    assert rec["ran"] is True and rec["chosen"] is None
    assert [t["passed"] for t in rec["tries"]] == [False, False]
    assert "no schedule" in rec["reason"]


# -- the verdict -------------------------------------------------------------------------
def _cache(fp8_repro_ok=True, fp8_psnr=33.0):
    f8 = {"name": "dbcache", "family": "cache", "config": {"threshold": 0.1}, "skipped_fraction": 0.4,
          "holdout_quality": {"psnr_min": fp8_psnr, "ssim_min": 0.97, "n": 4}, "candidates": 42,
          "layers": [f"l{i}" for i in range(32)], "kept": [f"k{i}" for i in range(10)]}
    return {"gates": {"psnr": 30.0, "ssim": 0.9, "tile_margin_db": 10.0},
            "chosen": {"name": "dbcache", "family": "cache", "config": {"threshold": 0.2}},
            "chosen_detail": {"skipped_fraction": 0.5, "holdout_quality": {"psnr_min": 34.0, "ssim_min": 0.98, "n": 4}},
            "strategies": [], "compiled": {"ran": False},
            "reproduction": {"ran": True, "ok": True, "max_abs": 0.0,
                             "fp8": {"max_abs": 0.0 if fp8_repro_ok else 0.2, "ok": fp8_repro_ok}},
            "fp8": {"ran": True, "chosen": f8}}


def _bench(plain=1.5, fp8=1.8, fp8_passed=True):
    row = lambda name, sp, passed=True: {"name": name, "speedup": sp, "e2e_ms": 100 / sp, "passed": passed,  # noqa: E731
                                         "source": "measured here", "psnr_min": 33.0, "ssim_min": 0.97}
    return {"summary": [row("baseline", 1.0), row("dbcache[threshold=0.2]", plain),
                        row("dbcache[threshold=0.1]+fp8[32/42]", fp8, fp8_passed)],
            "timing": {"drift": 1.0, "limit": 0.1, "stable": True}}


def test_the_verdict_ships_the_fp8_composition_only_when_faster_correct_and_reproduced():
    from ditbook.benchmark.verdict import headline, verdict

    v = verdict(_bench(), _cache())
    assert v["ship"] and v["name"] == "dbcache[threshold=0.1]+fp8[32/42]" and v["speedup"] == 1.8
    assert v["holdout"]["psnr_min"] == 33.0 and v["config"]["fp8_layers"][0] == "l0"
    assert "32 of 42 block linears in fp8" in v["reason"] and v["fp8"]["plain"] == "dbcache[threshold=0.2]"
    assert "Ship dbcache[threshold=0.1]+fp8[32/42]" in headline(v)
    plain = [r for r in v["runner_ups"] if r["name"] == "dbcache[threshold=0.2]"]
    assert plain and "without fp8" in plain[0]["why_not"]

    for bench, cache, why in ((_bench(fp8=1.4), _cache(), "not faster"),
                              (_bench(), _cache(fp8_repro_ok=False), "fresh process differs"),
                              (_bench(fp8_passed=False), _cache(), "did not pass its gates"),
                              (_bench(), _cache(fp8_psnr=29.0), "gates on held-out")):
        v = verdict(bench, cache)
        assert v["name"] == "dbcache[threshold=0.2]" and v["speedup"] == 1.5 and v["ship"], why
        assert v["fp8"]["shipped"] is False and why in v["fp8"]["why_not"], (why, v["fp8"]["why_not"])
    # uncompiled and slower: the verdict says that the compiled form was not timed
    assert "benchmark.compile is off" in verdict(_bench(fp8=1.4), _cache())["fp8"]["why_not"]


def test_the_benchmark_times_the_composition_warm_and_gives_it_no_second_fp8_twin():
    from ditbook.accel.fp8 import Fp8Refused  # noqa: F401  (the module the twins come from)
    from ditbook.accel.fp8 import Fp8, Fp8Settings
    from ditbook.configuration import Config

    composed = Config("dbcache[threshold=0.1]+fp8[32/42]", "cache/dbcache", lambda pipe: None,
                      params={"threshold": 0.1, "fp8": {"layers": 32, "candidates": 42, "tuned": True}})
    plain = Config("dbcache[threshold=0.2]", "cache/dbcache", lambda pipe: None, params={"threshold": 0.2})

    class Pipe:
        transformer = torch.nn.Linear(16, 16)

    twins = Fp8.variants(None, Pipe(), [plain, composed], Fp8Settings(), log=lambda m: None)
    names = [c.name for c in twins]
    assert names == ["fp8"]  # the CPU: one refused row; on a GPU the twins of baseline and plain only
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("ditbook.accel.fp8.fp8_refusal", lambda device, **k: None)
        names = [c.name for c in Fp8.variants(None, Pipe(), [plain, composed], Fp8Settings(), log=lambda m: None)]
    assert names == ["fp8", "dbcache[threshold=0.2]+fp8"]


def test_the_fp8_composition_and_its_compiled_twin_are_verdict_rows_timed_warm():
    from types import SimpleNamespace

    from ditbook.benchmark.stage import verdict_rows

    def ctx_for(cache):
        run = SimpleNamespace(has_results=lambda stage: stage == "cache", read_results=lambda stage: cache)
        return SimpleNamespace(run=run)

    plain = {"dbcache[threshold=0.2]", "dbcache[threshold=0.2]+compile"}
    assert verdict_rows(ctx_for(_cache())) == plain | {"dbcache[threshold=0.1]+fp8[32/42]",
                                                       "dbcache[threshold=0.1]+fp8[32/42]+compile"}
    no_fp8 = {**_cache(), "fp8": {"ran": False, "reason": "cache.fp8 is off"}}
    assert verdict_rows(ctx_for(no_fp8)) == plain


def test_the_verdict_line_on_fp8_says_what_became_of_it():
    from ditbook.benchmark.verdict import fp8_text, verdict

    shipped = fp8_text(verdict(_bench(), _cache()), _cache())
    assert shipped.startswith("fp8: shipped dbcache[threshold=0.1]+fp8[32/42] (32 of 42 block linears in fp8, 10 kept")
    assert "33.00 dB" in shipped and "1.80× end to end" in shipped and "faster than dbcache[threshold=0.2]" in shipped
    slower = fp8_text(verdict(_bench(fp8=1.4), _cache()), _cache())
    assert "1.40× end to end) not shipped: not faster (1.40× against 1.50× without fp8)" in slower
    for rec, want in (({"ran": False, "refused": "fp8 needs a CUDA GPU", "reason": "fp8 refused: fp8 needs a CUDA GPU"},
                       "fp8: refused: fp8 needs a CUDA GPU."),
                      ({"ran": True, "chosen": None, "reason": "no schedule of dbcache passed on held-out seeds"},
                       "fp8: no composition: no schedule of dbcache passed on held-out seeds."),
                      ({"ran": False, "reason": "cache.fp8 is off"}, "")):
        cache = {**_cache(), "fp8": rec}
        assert fp8_text(verdict(_bench(), cache), cache) == want


def test_result_md_and_the_report_carry_the_fp8_line(tmp_path):
    from ditbook.benchmark.report import build_report, result_markdown
    from ditbook.benchmark.synthetic import make_synthetic_run

    run_dir = make_synthetic_run(tmp_path / "a")
    path = run_dir / "cache" / "results.json"
    cache = json.loads(path.read_text())
    assert "fp8:" not in result_markdown(run_dir)  # the card did not ask for fp8: no line
    cache["fp8"] = {"ran": False, "refused": "fp8 needs a CUDA GPU of compute capability >= 8.9",
                    "reason": "fp8 refused"}
    path.write_text(json.dumps(cache))
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
    cache = {**_cache(), "chosen": {"name": "scm", "family": "cache", "config": {}}}
    cache["fp8"]["chosen"] = {**cache["fp8"]["chosen"], "name": "scm", "config": {"mask": [1, 0, 1]}}
    assert chosen_row_name(cache["chosen"]) == "scm"
    assert fp8_row_name(cache) == "scm" + fp8_suffix(cache["fp8"]["chosen"]) == "scm+fp8[32/42]"
    assert set(holdout_records(cache)) == {"scm", "scm+fp8[32/42]"}
