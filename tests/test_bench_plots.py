"""Plots, difference maps, the summary/readout logic, stage inputs, and the headless explorer."""

import numpy as np
import pytest
from PIL import Image

from ditbook.benchmark.inputs import cache_rows, parallel_rows, residual_series
from ditbook.benchmark.plots import contact_sheet, diff_map, pareto_frontier, plot_residuals, plot_scaling, plot_tradeoff
from ditbook.benchmark.summary import recommend
from ditbook.widgets import ExplorerData, explorer_state


def test_pareto_frontier_keeps_only_undominated_points():
    pts = [(1.0, 100.0), (1.5, 40.0), (1.4, 35.0), (2.0, 32.0), (2.0, 20.0)]
    assert pareto_frontier(pts) == [0, 1, 3]


def test_diff_map_is_black_for_equal_and_marks_nan():
    a = np.random.default_rng(0).random((8, 8, 3)).astype(np.float32)
    assert diff_map(a, a).max() == 0
    b = a.copy()
    b[0, 0, 0] = np.nan
    b[4, 4] += 0.2
    d = diff_map(b, a)
    assert tuple(d[0, 0]) == (1.0, 0.0, 1.0)
    assert d[4, 4].sum() > 0 and d[7, 7].sum() == 0
    with pytest.raises(ValueError):
        diff_map(a, a[:4])


def _png_size(path):
    with Image.open(path) as im:
        return im.size


def test_plots_write_pngs(tmp_path):
    rows = [{"name": "baseline", "family": "baseline", "speedup": 1.0, "psnr_min": 100.0, "ssim_min": 1.0},
            {"name": "a", "family": "cache/dbcache", "speedup": 1.8, "psnr_min": 34.0, "ssim_min": 0.95},
            {"name": "b", "family": "cache/teacache", "speedup": 2.4, "psnr_min": None, "ssim_min": 0.8}]
    for metric in ("psnr_min", "ssim_min"):
        assert _png_size(plot_tradeoff(rows, metric, tmp_path / f"{metric}.png", gate=30))[0] > 100
    assert _png_size(plot_residuals({"baseline": [0.5, 0.2, 0.1]}, tmp_path / "r.png"))[0] > 100
    assert _png_size(plot_scaling([{"name": "ulysses", "nproc": 2, "speedup": 1.7}], tmp_path / "s.png"))[0] > 100
    base = np.zeros((16, 16, 3), np.float32)
    sheet = contact_sheet("p0_s0", base, {"a": base + 0.1, "b": base}, tmp_path / "sheet.png",
                          {"a": {"psnr": 20.0, "ssim": 0.5}})
    w, h = _png_size(sheet)
    assert h > w / 3  # two rows of three panels


def test_recommend_picks_fastest_passing_and_lists_faster_rejected():
    rows = [{"name": "baseline", "family": "baseline", "speedup": 1.0, "psnr_min": 100, "ssim_min": 1},
            {"name": "safe", "family": "cache/dbcache", "speedup": 1.8, "psnr_min": 34.0, "ssim_min": 0.95,
             "passed": True, "source": "measured here"},
            {"name": "greedy", "family": "cache/dbcache", "speedup": 3.0, "psnr_min": 24.0, "ssim_min": 0.85,
             "passed": False},
            # a parallel plan needs > 35 dB
            {"name": "ulysses", "family": "parallel", "speedup": 2.0, "psnr_min": 33.0, "ssim_min": 0.99, "nproc": 2}]
    rec = recommend(rows)
    assert rec.name == "safe" and "1.80×" in rec.reason
    assert {r.split(" ")[0] for r in rec.rejected} == {"greedy", "ulysses"}
    assert "35" in next(r for r in rec.rejected if r.startswith("ulysses"))
    # gates from the card change the verdict
    assert recommend(rows, {"parallel": {"psnr": 30}}).name == "ulysses"


def test_recommend_ships_baseline_when_nothing_helps():
    rows = [{"name": "baseline", "family": "baseline", "speedup": 1.0},
            {"name": "slow", "family": "cache", "speedup": 1.01, "psnr_min": 50, "ssim_min": 0.99}]
    rec = recommend(rows)
    assert rec.name == "baseline" and "ship the baseline" in rec.reason


def test_stage_inputs_accept_documented_key_variants():
    cache = {"strategies": [{"strategy": "dbcache", "psnr": 31.0, "ssim": 0.91, "speedup": 1.4}],
             "residual_changes": {"cal": [0.2, 0.1]}}
    rows = cache_rows(cache)
    assert rows[0]["family"] == "cache/dbcache" and rows[0]["psnr_min"] == 31.0
    assert residual_series(cache) == {"cal": [0.2, 0.1]}
    par = {"baseline_seconds": 4.0, "runs": [{"plan": "ring", "world_size": 2, "seconds": 2.5, "cache": "F1B0"}]}
    prow = parallel_rows(par)[0]
    assert prow["nproc"] == 2 and prow["speedup"] == pytest.approx(1.6) and prow["family"] == "cache+parallel"
    assert cache_rows(None) == [] and parallel_rows({}) == []


def test_explorer_state_headless():
    rng = np.random.default_rng(1)
    base = rng.random((8, 8, 3)).astype(np.float32)
    acc = np.clip(base + 0.05, 0, 1)
    data = ExplorerData({"baseline": {"p0_s0": base}, "fast": {"p0_s0": acc}}, {"p0_s0": "a red circle"})
    assert data.configs == ["fast"] and data.keys == ["p0_s0"]
    on = explorer_state(data, "fast", "p0_s0", accelerated=True)
    off = explorer_state(data, "fast", "p0_s0", accelerated=False)
    assert on.showing == "accelerated" and np.array_equal(on.image, acc)
    assert off.showing == "baseline" and np.array_equal(off.image, base)
    assert np.array_equal(on.diff, off.diff) and on.diff.max() > 0
    assert 20 < on.psnr < 40 and "a red circle" in on.caption
    with pytest.raises(KeyError):
        explorer_state(data, "baseline", "p0_s0")
    with pytest.raises(KeyError):
        explorer_state(data, "fast", "p9_s9")


def test_explorer_widget_builds():
    pytest.importorskip("ipywidgets")
    from ditbook.widgets import explorer

    base = np.zeros((8, 8, 3), np.float32)
    box = explorer(ExplorerData({"baseline": {"k": base}, "c": {"k": base + 0.5}}))
    img = box.children[2].children[0]
    assert img.value[:4] == b"\x89PNG"
    box.children[1].value = "baseline"  # toggling re-renders without error
    assert box.children[2].children[0].value[:4] == b"\x89PNG"


def test_progress_is_plain_log_when_not_interactive():
    from ditbook.progress import progress

    lines = []
    assert list(progress(["a", "b"], False, "config", log=lines.append)) == ["a", "b"]
    assert lines == ["config 1/2: a", "config 2/2: b"]


# -- the verdict, the plot's keys and the image grid ---------------------------------------------
def _cache(psnr=33.1, ssim=0.95, chosen=True):
    ch = {"name": "dbcache_taylorseer", "family": "cache-dit DBCache", "config": {"threshold": 0.24, "Fn": 1}}
    return {"gates": {"psnr": 30.0, "ssim": 0.9},
            "chosen": ch if chosen else None,
            "chosen_detail": {**ch, "skipped_fraction": 0.5,
                              "holdout_quality": {"n": 4, "psnr_min": psnr, "ssim_min": ssim}} if chosen else None}


def _bench(speedup=1.9):
    return {"summary": [
        {"name": "baseline", "family": "baseline", "source": "measured here", "speedup": 1.0, "psnr_min": 100.0},
        # faster, and better on the benchmark's (calibration) seeds: still not the verdict
        {"name": "teacache_fitted[threshold=0.3]", "family": "cache/teacache_fitted", "source": "measured here",
         "speedup": 2.6, "psnr_min": 37.61, "ssim_min": 0.97, "passed": True},
        {"name": "dbcache_taylorseer[Fn=1,threshold=0.24]", "family": "cache/dbcache_taylorseer",
         "source": "measured here", "speedup": speedup, "psnr_min": 35.0, "ssim_min": 0.96, "passed": True}]}


def test_verdict_is_the_cache_stages_choice_with_held_out_quality():
    from ditbook.benchmark.verdict import headline, verdict

    v = verdict(_bench(), _cache())
    assert v["ship"] and v["name"] == "dbcache_taylorseer[Fn=1,threshold=0.24]" and v["speedup"] == 1.9
    text = headline(v)
    assert text.startswith("Ship dbcache_taylorseer") and "held-out worst PSNR 33.10 dB (gate > 30)" in text
    assert "37.61" not in text and "teacache" not in text


def test_verdict_refuses_what_the_evidence_does_not_support():
    from ditbook.benchmark.verdict import headline, verdict

    # held-out quality below the gate
    v = verdict(_bench(), _cache(psnr=29.0))
    assert not v["ship"] and "does not meet the gates" in v["reason"]
    # not faster than the baseline by more than the noise
    v = verdict(_bench(speedup=1.01), _cache())
    assert not v["ship"] and "ship the baseline" in v["reason"]
    # nothing confirmed on held-out seeds
    v = verdict(_bench(), _cache(chosen=False))
    assert v["name"] == "baseline" and not v["ship"] and headline(v).startswith("Ship the baseline")
    # the benchmark did not time the chosen configuration
    b = _bench()
    b["summary"] = b["summary"][:2]
    v = verdict(b, _cache())
    assert not v["ship"] and "speed-up unknown" in v["reason"]


def test_verdict_names_its_rule_and_the_faster_passing_runner_up():
    """The issue's case: teacache_fitted is faster here (2.6× against 1.9×) and passes on held-out
    seeds, but skips less work; it is named as the runner-up with why it was not chosen. A faster
    row with no held-out record is named too ("not confirmed on held-out seeds"); a parallel plan
    of a CPU run is no runner-up (no speed-up)."""
    from ditbook.benchmark.verdict import RULE, runner_up_text, verdict

    cache = _cache()
    v = verdict(_bench(), cache)
    assert v["rule"] == RULE and [r["name"] for r in v["runner_ups"]] == ["teacache_fitted[threshold=0.3]"]
    assert "not confirmed on held-out seeds" in v["runner_ups"][0]["why_not"]
    cache["strategies"] = [{"name": "teacache_fitted", "config": {"threshold": 0.3}, "split": "holdout",
                            "passed": True, "skipped_fraction": 0.48, "quality": {"psnr_min": 31.56, "ssim_min": 0.93}}]
    bench = _bench()
    bench["device"] = "cpu"
    bench["summary"].append({"name": "te2", "family": "parallel", "nproc": 2, "source": "measured here",
                             "speedup": 2.27, "psnr_min": 100.0, "ssim_min": 1.0, "passed": True})
    v = verdict(bench, cache)
    (up,) = v["runner_ups"]
    assert up["name"] == "teacache_fitted[threshold=0.3]" and up["speedup"] == 2.6 and up["psnr_min"] == 31.56
    assert up["quality_on"] == "held-out" and up["why_not"].startswith("skips less work (0.480 of block evaluations against 0.500)")
    text = runner_up_text(v)
    assert text.startswith(f"Chosen by the cache stage's rule: {RULE}.") and "Runner-up: teacache_fitted" in text
    assert "2.60×, held-out worst PSNR 31.56 dB" in text and "te2" not in text
    # a failing alternative, or one slower and worse, is no runner-up
    cache["strategies"][0]["passed"] = False
    assert verdict(bench, cache)["runner_ups"] == []


def test_timing_stable_reads_the_drift_and_a_recorded_guard():
    from ditbook.benchmark.verdict import checklist

    meta = {"stages": {}}

    def item(bench):
        return {c["item"]: c for c in checklist(meta, {"benchmark": bench, "cache": _cache()})}["timing stable"]

    bad = item({**_bench(), "baseline_drift": 0.402})
    assert bad["ok"] is False and "0.402" in bad["figure"] and "not reliable" in bad["figure"]
    good = item({**_bench(), "baseline_drift": 0.97})
    assert good["ok"] is True and "0.970" in good["figure"]
    # the benchmark's own timing record (the guard's bound, its verdict) wins over the default bound
    guard = {"drift": 0.97, "limit": 0.01, "stable": False, "warmup": 1, "repeats": 3}
    assert item({**_bench(), "baseline_drift": 0.97, "timing": guard})["ok"] is False
    loose = {"drift": 0.6, "limit": 0.5, "stable": True, "warmup": 1, "repeats": 3}
    assert "±50%" in item({**_bench(), "baseline_drift": 0.6, "timing": loose})["figure"]
    assert item({**_bench(), "baseline_drift": 0.6, "timing": loose})["ok"] is True


def test_checklist_reads_the_stages_and_says_not_recorded():
    from ditbook.benchmark.verdict import NOT_RECORDED, checklist

    meta = {"card": {"approved_plan": "abc"}, "stages": {"intake": {"status": "passed"}}}
    cache = _cache()
    cache["adapter_checks"] = [{"name": "dbcache", "checked": True, "reproduces": True, "max_abs": 0.0}]
    cache["noise_floor"] = {"rerun_vs_intake": {"psnr_min": 100.0}, "rerun_max_abs": 0.0}
    parallel = {"plans": [{"name": "ulysses2", "passed": True, "quality": {"psnr_min": 48.0}}]}
    results = {"intake": {"images": [1, 2]}, "inspect": {"plan_hash": "abc"}, "cache": cache,
               "parallel": parallel, "benchmark": _bench()}
    items = {c["item"]: c for c in checklist(meta, results)}
    assert [c["ok"] for c in items.values()] == [True, True, True, None, True, True, None]
    assert NOT_RECORDED in items["parity per plan, sharding verified"]["figure"]
    assert items["timing stable"]["figure"] == "baseline drift " + NOT_RECORDED
    # each check can fail
    parallel["plans"][0]["details"] = {"sharding": {"verified": True}}
    assert {c["item"]: c for c in checklist(meta, results)}["parity per plan, sharding verified"]["ok"] is True
    # the record the parallel stage writes (ditbook.cp.sharding): verified, and a plan that split nothing
    item = "parity per plan, sharding verified"
    parallel["plans"][0]["details"] = {"sharding": {"error": None, "check": {"degree": 2}}}
    assert {c["item"]: c for c in checklist(meta, results)}[item]["ok"] is True
    parallel["plans"][0]["details"] = {"sharding": {"error": "ShardingError: blocks saw 64, expected 32", "check": None}}
    assert {c["item"]: c for c in checklist(meta, results)}[item]["ok"] is False
    parallel["plans"][0]["details"] = {"sharding": {"verified": False}}
    cache["adapter_checks"][0]["reproduces"] = False
    results["inspect"]["plan_hash"] = "def"
    results["cache"] = {**cache, **_cache(psnr=25.0)}
    bad = {c["item"]: c["ok"] for c in checklist(meta, results)}
    assert bad["plan approved"] is False and bad["caching off reproduces the baseline"] is False
    assert bad["parity per plan, sharding verified"] is False and bad["held-out confirmation"] is False
    meta["stages"]["intake"]["status"] = "failed"
    assert checklist(meta, results)[0]["ok"] is False


def test_short_labels_distinguish_process_counts_and_the_plot_is_2x(tmp_path):
    from ditbook.benchmark.plots import row_id, short_labels

    rows = [{"name": "baseline", "family": "baseline", "speedup": 1.0, "psnr_min": 100.0},
            {"name": "ulysses", "family": "parallel", "nproc": 2, "speedup": 1.7, "psnr_min": 48.0},
            {"name": "ulysses", "family": "parallel", "nproc": 4, "speedup": 2.5, "psnr_min": 47.0},
            {"name": "a_very_long_configuration_name[Fn=1,Bn=0,threshold=0.24,max_warmup_steps=2]",
             "family": "cache/dbcache", "speedup": 1.9, "psnr_min": 33.0}]
    labels = short_labels(rows)
    assert list(labels.values()) == ["A", "B", "C"] and row_id(rows[2]) in labels
    w, h = _png_size(plot_tradeoff(rows, "psnr_min", tmp_path / "t.png", gate=30, labels=labels,
                                   highlight=rows[3]["name"]))
    assert w >= 1280 and h >= 800  # 2x resolution; the legend outside the axes is kept (tight box)


def test_image_grid_has_a_row_per_configuration_and_a_column_pair_per_prompt(tmp_path):
    from ditbook.benchmark.plots import image_grid

    rng = np.random.default_rng(0)
    base = {f"p{i}_s0": rng.random((16, 16, 3)).astype(np.float32) for i in range(3)}
    one = image_grid(base, {"a": {k: v + 0.01 for k, v in base.items()}}, tmp_path / "g1.png",
                     {k: "a prompt" for k in base})
    three = image_grid(base, {n: {k: v + 0.01 for k, v in base.items()} for n in "abc"}, tmp_path / "g3.png")
    (w1, h1), (w3, h3) = _png_size(one), _png_size(three)
    assert abs(w1 - w3) < 40 and h3 > 1.6 * h1  # more configurations: more rows, same columns


def test_tradeoff_marks_the_verdict_and_keeps_capped_points_from_squashing_the_range(tmp_path, monkeypatch):
    from ditbook.benchmark import plots

    seen = {}
    save = plots._save

    def spy(fig, path, **kw):
        ax = fig.axes[0]
        seen["ylim"] = ax.get_ylim()
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["texts"] = [t.get_text() for t in ax.texts]
        seen["yticks"] = [t.get_text() for t in ax.get_yticklabels()]
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "_save", spy)
    rows = [{"name": "baseline", "family": "baseline", "speedup": 1.0, "psnr_min": 100.0},
            {"name": "exact", "family": "parallel", "nproc": 2, "speedup": 0.9, "psnr_min": 100.0},
            {"name": "a", "family": "cache/x", "speedup": 1.4, "psnr_min": 41.0},
            {"name": "b", "family": "cache/y", "speedup": 3.5, "psnr_min": 37.0}]
    plots.plot_tradeoff(rows, "psnr_min", tmp_path / "t.png", gate=30, highlight="a")
    assert "verdict" in seen["legend"]
    assert seen["ylim"][1] < 60  # the range near the gate is not squashed by the 100 dB points
    # identical images sit on a band whose tick says so: no number is made up for them, and the
    # baseline is the line at 1× (in the legend), not a point at some PSNR
    assert seen["yticks"][-1] == "identical" and all(float(t) <= 42 for t in seen["yticks"][:-1]), seen["yticks"]
    assert "A" in seen["texts"] and "base" not in seen["texts"]
    assert any(t.startswith("baseline (1×") for t in seen["legend"])


def test_grid_row_labels_keep_the_setting_that_tells_rows_apart(tmp_path, monkeypatch):
    """Two configurations that differ only in their last setting get different row labels (the
    labels were cut to three lines of 18 characters), and no setting is broken inside."""
    from ditbook.benchmark import plots

    seen = {}
    save = plots._save

    def spy(fig, path, **kw):
        seen["labels"] = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "_save", spy)
    rng = np.random.default_rng(0)
    base = {"p0_s0": rng.random((8, 8, 3)).astype(np.float32)}
    stem = "dbcache_taylorseer[Bn=0,Fn=1,max_warmup_steps=2,residual_diff_threshold=0.12,taylorseer_order="
    names = [stem + "1]", stem + "2]"]
    plots.image_grid(base, {n: dict(base) for n in names}, tmp_path / "g.png", labels={names[0]: "A", names[1]: "E"})
    a, e = seen["labels"][1:3]  # after the baseline row; before the colour bar
    assert a.replace("\n", "").replace(" ", "") == "A:" + names[0] and e.replace("\n", "").replace(" ", "") == "E:" + names[1]
    for line in a.splitlines():
        assert line.endswith(("[", ",", "]", ":")), line


def test_headline_speed_carries_its_spread():
    """The verdict's speed-up comes with the range its timings allow (baseline min / config max
    to baseline max / config min)."""
    from ditbook.benchmark.verdict import headline, verdict

    bench = _bench()
    bench["baseline"] = {"timing": {"end_to_end": {"median": 1.9, "min": 1.8, "max": 2.0}}}
    bench["configs"] = [{"name": "dbcache_taylorseer[Fn=1,threshold=0.24]",
                         "timing": {"end_to_end": {"median": 1.0, "min": 0.9, "max": 1.2}}}]
    v = verdict(bench, _cache())
    assert v["speedup_range"] == [1.5, 2.222]
    assert "1.90× end to end (timings allow 1.50–2.22×)" in headline(v)
    assert "timings allow" not in headline(verdict(_bench(), _cache()))  # no timings: no range invented


def test_a_speed_up_whose_timings_allow_a_slowdown_is_not_shipped():
    """The median clears MIN_USEFUL_SPEEDUP, but the slowest configuration call against the fastest
    baseline call is a slowdown: the speed-up is not shown and the baseline is shipped, with the
    range named. The same medians with a tight range ship."""
    from ditbook.benchmark.verdict import headline, verdict

    bench = _bench()
    bench["baseline"] = {"timing": {"end_to_end": {"median": 1.9, "min": 1.3, "max": 2.0}}}
    bench["configs"] = [{"name": "dbcache_taylorseer[Fn=1,threshold=0.24]",
                         "timing": {"end_to_end": {"median": 1.0, "min": 0.9, "max": 1.4}}}]
    v = verdict(bench, _cache())
    assert v["speedup"] == 1.9 and v["speedup_range"][0] < 1.0
    assert not v["ship"] and "a slowdown among them" in v["reason"] and "0.93–2.22×" in v["reason"], v["reason"]
    assert headline(v).startswith("Do not ship dbcache_taylorseer") and headline(v).endswith("ship the baseline (more "
                                                                                   "benchmark.repeats, or a quieter host, narrow the range).")
    bench["baseline"]["timing"]["end_to_end"]["min"] = 1.8
    bench["configs"][0]["timing"]["end_to_end"]["max"] = 1.2
    assert verdict(bench, _cache())["ship"]


def test_parallel_plans_are_parity_on_cpu_and_speed_against_one_gpu_on_gpus():
    """The same parallel plan: on a CPU host no speed-up (parity only); on GPUs its speed-up is
    shown against the single-process run, with the device count in the label."""
    from ditbook.benchmark.shown import display_name, shown_rows, speed_text

    rows = [{"name": "te2", "family": "parallel", "nproc": 2, "speedup": 2.27, "psnr_min": 100.0, "passed": True}]
    (cpu,) = shown_rows(rows, {"device": "cpu"}, None)
    assert cpu["parity_only"] and cpu["speedup_shown"] is None and speed_text(cpu).startswith("parity only")
    assert display_name(cpu) == "te2 (2 CPU processes)" and cpu["quality_on"] == "calibration"
    (gpu,) = shown_rows(rows, {"device": "cuda:0"}, None)
    assert not gpu["parity_only"] and speed_text(gpu) == "2.27× vs 1 GPU" and display_name(gpu) == "te2 (2 GPUs)"


def test_compiled_twin_takes_the_held_out_figure_only_when_the_compiled_check_passed():
    from ditbook.benchmark.shown import shown_rows

    cache = _cache()
    rows = [{"name": "dbcache_taylorseer[Fn=1,threshold=0.24]", "family": "cache/x", "psnr_min": 41.2, "ssim_min": 0.99},
            {"name": "dbcache_taylorseer[Fn=1,threshold=0.24]+compile", "family": "cache/x", "psnr_min": 41.1,
             "ssim_min": 0.99}]
    plain, twin = shown_rows(rows, {}, cache)
    assert plain["psnr"] == 33.1 and plain["quality_on"] == "held-out" and plain.get("psnr_calibration") is None
    assert twin["psnr"] == 41.1 and twin["quality_on"] == "calibration"  # no compiled check: its own figure
    cache["compiled"] = {"ran": True, "ok": True}
    assert shown_rows(rows, {}, cache)[1]["psnr"] == 33.1


def test_runner_up_text_names_the_fastest_three_and_counts_the_rest():
    from ditbook.benchmark.verdict import runner_up_text

    ups = [{"name": f"c{i}", "speedup": 3.0 - i / 10, "psnr_min": 35.0, "quality_on": "calibration",
            "why_not": "not confirmed on held-out seeds"} for i in range(5)]
    text = runner_up_text({"runner_ups": ups})
    assert "c0 (3.00×" in text and "c2 (" in text and "c3 (" not in text and "2 more in benchmark/results.json" in text
