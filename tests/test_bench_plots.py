"""Plots, difference maps, the summary/readout logic, stage inputs, and the headless explorer."""

import numpy as np
import pytest
from PIL import Image

from records_fixtures import bench_record, cache_record, config_row, holdout_row, parallel_record, quality

from ditbook.benchmark.inputs import cache_rows, parallel_rows
from ditbook.benchmark.plots import contact_sheet, diff_map, pareto_frontier, plot_residuals, plot_scaling, plot_tradeoff
from ditbook.records import PlanRow, ShardingSummary
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


def test_stage_inputs_read_the_records():
    cache = cache_record([holdout_row("dbcache", {"threshold": 0.1}, 31.0, 0.91, 0.4)])
    rows = cache_rows(cache)
    assert rows[0]["name"] == "dbcache[threshold=0.1]" and rows[0]["family"] == "cache/dbcache"
    assert rows[0]["psnr_min"] == 31.0 and rows[0]["quality_on"] == "held-out"
    par = parallel_record([PlanRow("ring2+cache", 2, True, quality(48.0, 0.999), seconds=2.5, speedup=1.6)])
    prow = parallel_rows(par)[0]
    assert prow["nproc"] == 2 and prow["speedup"] == 1.6 and prow["family"] == "cache+parallel"
    assert cache_rows(None) == [] and parallel_rows(None) == []


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


# -- the verdict (ditbook.ship's rule over the measured candidates), the plot's keys, the grid --------
DBC = {"Fn": 1, "threshold": 0.24}
TEA = {"threshold": 0.3}


def _cache(psnr=33.1, ssim=0.95, chosen=True, tea_psnr=31.56):
    """The cache stage chose dbcache_taylorseer (most work skipped); teacache_fitted passed too."""
    dbc = holdout_row("dbcache_taylorseer", DBC, psnr, ssim, 0.5)
    tea = holdout_row("teacache_fitted", TEA, tea_psnr, 0.93, 0.48)
    return cache_record([dbc, tea], chosen=dbc if chosen else None)


def _bench(speedup=1.9, tea=2.6, **kw):
    return bench_record([config_row("teacache_fitted[threshold=0.3]", tea, 37.61, 0.97),
                         config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", speedup)], **kw)


def test_verdict_ships_the_fastest_configuration_that_passes_on_held_out_seeds():
    """teacache_fitted skips a little less work than the cache stage's choice but measures 2.6×
    against 1.9×, outside each other's spread: the one rule ships the faster (the old rule shipped
    the one skipping most), names the other a runner-up, and quotes held-out figures only."""
    from ditbook.benchmark.verdict import headline, runner_up_text, verdict

    v = verdict(_bench(), _cache())
    assert v.ship and v.name == "teacache_fitted[threshold=0.3]" and v.speedup == 2.6
    text = headline(v)
    assert text.startswith("Ship teacache_fitted") and "held-out worst PSNR 31.56 dB (gate > 30)" in text
    assert "37.61" not in text  # its figure on the calibration seeds is not the one shown
    (up,) = v.runner_ups
    assert up["name"] == "dbcache_taylorseer[Fn=1,threshold=0.24]" and up["why_not"].startswith("slower (1.90×")
    assert "Runner-up: dbcache_taylorseer" in runner_up_text(v)


def test_within_the_measured_spread_the_better_held_out_quality_ships():
    """make demo's case: dbcache_taylorseer 1.44× at 33.31 dB, scm 1.49× at 37.95 dB; the timings
    overlap, so the better one on held-out seeds ships — never one another beats on both."""
    from ditbook.benchmark.verdict import verdict

    dbc = holdout_row("dbcache_taylorseer", DBC, 33.31, 0.987, 0.52)
    scm = holdout_row("scm", {"computed": 10}, 37.95, 0.995, 0.42)
    bench = bench_record([config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", 1.44, spread=0.05),
                          config_row("scm[computed=10]", 1.49, spread=0.05)])
    v = verdict(bench, cache_record([dbc, scm], chosen=dbc))
    assert v.ship and v.name == "scm[computed=10]" and v.holdout.psnr_min == 37.95
    # swapped medians within the spread: the better one on held-out seeds still ships
    bench = bench_record([config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", 1.49, spread=0.05),
                          config_row("scm[computed=10]", 1.44, spread=0.05)])
    v = verdict(bench, cache_record([dbc, scm], chosen=dbc))
    assert v.ship and v.name == "scm[computed=10]" and "better on held-out seeds" in v.reason
    assert "worse on held-out seeds" in v.runner_ups[0]["why_not"]
    # the same medians, timings far apart: the faster ships, as fast and better or not
    bench = bench_record([config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", 3.0),
                          config_row("scm[computed=10]", 1.49)])
    assert verdict(bench, cache_record([dbc, scm], chosen=dbc)).name == "dbcache_taylorseer[Fn=1,threshold=0.24]"


def test_verdict_refuses_what_the_evidence_does_not_support():
    from ditbook.benchmark.verdict import headline, verdict

    # held-out quality below the gate (both configurations)
    v = verdict(_bench(), _cache(psnr=29.0, tea_psnr=29.5))
    assert not v.ship and "does not pass the gates" in v.reason and "ship the baseline" in v.reason
    # not faster than the baseline by more than the noise
    v = verdict(_bench(speedup=1.01, tea=1.02), _cache())
    assert not v.ship and "does not beat the baseline" in v.reason
    # timings that allow a slowdown
    v = verdict(bench_record([config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", 1.2, spread=0.3)]),
                cache_record([holdout_row("dbcache_taylorseer", DBC, 33.1, 0.95, 0.5)]))
    assert not v.ship and "a slowdown among them" in v.reason
    # nothing confirmed on held-out seeds
    v = verdict(_bench(), cache_record([]))
    assert v.name == "baseline" and not v.ship and headline(v).startswith("Ship the baseline")
    # not timed by the benchmark
    v = verdict(bench_record([]), _cache())
    assert not v.ship and "not timed" in v.reason
    # unstable timings: no speed-up read at all
    v = verdict(_bench(drift=0.5), _cache())
    assert not v.ship and v.speedup is None and v.reason.startswith("timing unstable")
    # its images in the benchmark fail the gates: not eligible, whatever its speed
    bad = bench_record([config_row("teacache_fitted[threshold=0.3]", 5.0, passed=False),
                        config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", 1.9)])
    v = verdict(bad, _cache())
    assert v.name == "dbcache_taylorseer[Fn=1,threshold=0.24]" and v.ship
    assert any("do not pass the gates" in r["why_not"] for r in v.refused)


def test_the_compiled_form_ships_only_when_the_compiled_check_agrees():
    from ditbook.benchmark.verdict import verdict
    from ditbook.records import CompiledCheck

    name = "dbcache_taylorseer[Fn=1,threshold=0.24]"
    bench = bench_record([config_row(name, 1.9), config_row(name + "+compile", 2.6)])
    cache = cache_record([holdout_row("dbcache_taylorseer", DBC, 33.1, 0.95, 0.5)],
                         chosen=holdout_row("dbcache_taylorseer", DBC, 33.1, 0.95, 0.5))
    v = verdict(bench, cache)
    assert v.name == name + "+compile" and v.form == "compiled" and v.ship
    cache.compiled = CompiledCheck(ran=True, ok=False, quality={"psnr_min": 12.0})
    v = verdict(bench, cache)
    assert v.name == name and any("compiled images differ" in r["why_not"] for r in v.refused)


def test_timing_stable_reads_the_benchmarks_record():
    from ditbook.benchmark.verdict import checklist

    meta = {"stages": {}}

    def item(bench):
        return {c["item"]: c for c in checklist(meta, {"benchmark": bench, "cache": _cache()})}["timing stable"]

    bad = item(_bench(drift=0.402))
    assert bad["ok"] is False and "0.402" in bad["figure"] and "not reliable" in bad["figure"]
    good = item(_bench(drift=0.97))
    assert good["ok"] is True and "0.970" in good["figure"] and "1 warm-up, 3 repeats" in good["figure"]
    loose = item(_bench(drift=0.6, limit=0.5))
    assert loose["ok"] is True and "±50%" in loose["figure"]
    none = _bench()
    none.timing = None
    assert item(none)["ok"] is None


def test_checklist_reads_the_stages_and_says_not_recorded():
    from ditbook.benchmark.verdict import NOT_RECORDED, checklist
    from ditbook.records import ImageRow, InspectResults, IntakeResults

    meta = {"card": {"approved_plan": "abc"}, "stages": {"intake": {"status": "passed"}}}
    cache = _cache()
    cache.adapter_checks = [{"name": "dbcache", "checked": True, "reproduces": True, "max_abs": 0.0}]
    cache.noise_floor = {"rerun_vs_intake": {"psnr_min": 100.0}, "rerun_max_abs": 0.0}
    parallel = parallel_record([PlanRow("ulysses2", 2, True, quality(48.0, 0.999))])
    rows = [ImageRow(f"p0_s{i}", "a", i, "x.png", "x.npy") for i in (0, 1)]
    results = {"intake": IntakeResults(images=rows, placement={}),
               "inspect": InspectResults(plan_hash="abc", transformer_class="T"), "cache": cache,
               "parallel": parallel, "benchmark": _bench()}
    bench = results["benchmark"]
    bench.timing = None
    items = {c["item"]: c for c in checklist(meta, results)}
    assert [c["ok"] for c in items.values()] == [True, True, True, None, True, True, None]
    assert NOT_RECORDED in items["parity per plan, sharding verified"]["figure"]
    assert items["timing stable"]["figure"] == "baseline drift " + NOT_RECORDED
    # each check can fail: the record the parallel stage writes per plan (records.ShardingSummary)
    item = "parity per plan, sharding verified"
    parallel.sharding = {"ulysses2": ShardingSummary(verified=True)}
    assert {c["item"]: c for c in checklist(meta, results)}[item]["ok"] is True
    parallel.sharding = {"ulysses2": ShardingSummary(verified=False)}
    cache.adapter_checks[0]["reproduces"] = False
    results["inspect"].plan_hash = "def"
    low = _cache(psnr=25.0, tea_psnr=25.0)
    low.adapter_checks, low.noise_floor = cache.adapter_checks, cache.noise_floor
    results["cache"] = low
    bad = {c["item"]: c["ok"] for c in checklist(meta, results)}
    assert bad["plan approved"] is False and bad["caching off reproduces the baseline"] is False
    assert bad["parity per plan, sharding verified"] is False and bad["held-out confirmation"] is False
    meta["stages"]["intake"]["status"] = "failed"
    assert checklist(meta, results)[0]["ok"] is False
    # a strategy whose caching-off check raised is named with its error, not as a difference of 0
    checks = results["cache"].adapter_checks = [
        {"name": "dbcache", "checked": True, "reproduces": True, "max_abs": 0.0},
        {"name": "fbc", "checked": True, "reproduces": False, "error": "TypeError: x"}]
    off = {c["item"]: c for c in checklist(meta, results)}["caching off reproduces the baseline"]
    assert off["ok"] is False and off["figure"] == "fbc could not run with caching off (TypeError: x)"
    checks.append({"name": "pab", "checked": True, "reproduces": False, "max_abs": 0.5})
    off = {c["item"]: c for c in checklist(meta, results)}["caching off reproduces the baseline"]
    assert off["figure"] == "differs for pab (max abs diff 0.5); fbc could not run with caching off (TypeError: x)"


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

    cache = cache_record([holdout_row("dbcache_taylorseer", DBC, 33.1, 0.95, 0.5)])
    v = verdict(bench_record([config_row("dbcache_taylorseer[Fn=1,threshold=0.24]", 1.9, spread=0.1)]), cache)
    assert v.speedup_range == [round(0.98 / (1.1 / 1.9), 3), round(1.02 / (0.9 / 1.9), 3)]
    assert f"1.90× end to end (timings allow {v.speedup_range[0]:.2f}–{v.speedup_range[1]:.2f}×)" in headline(v)


def test_parallel_plans_are_parity_on_cpu_and_speed_against_one_gpu_on_gpus():
    """The same parallel plan: on a CPU host no speed-up (parity only); on GPUs its speed-up is
    shown against the single-process run, with the device count in the label."""
    from ditbook.benchmark.shown import display_name, shown_rows, speed_text

    rows = [{"name": "te2", "family": "parallel", "nproc": 2, "speedup": 2.27, "psnr_min": 100.0, "passed": True}]
    (cpu,) = shown_rows(rows, bench_record([], device="cpu"), None)
    assert cpu["parity_only"] and cpu["speedup_shown"] is None and speed_text(cpu).startswith("parity only")
    assert display_name(cpu) == "te2 (2 CPU processes)" and cpu["quality_on"] == "calibration"
    (gpu,) = shown_rows(rows, bench_record([], device="cuda:0"), None)
    assert not gpu["parity_only"] and speed_text(gpu) == "2.27× vs 1 GPU" and display_name(gpu) == "te2 (2 GPUs)"


def test_compiled_twin_takes_the_held_out_figure_only_when_the_compiled_check_passed():
    from ditbook.benchmark.shown import shown_rows

    from ditbook.records import CompiledCheck

    cache = _cache()
    rows = [{"name": "dbcache_taylorseer[Fn=1,threshold=0.24]", "family": "cache/x", "psnr_min": 41.2, "ssim_min": 0.99},
            {"name": "dbcache_taylorseer[Fn=1,threshold=0.24]+compile", "family": "cache/x", "psnr_min": 41.1,
             "ssim_min": 0.99}]
    plain, twin = shown_rows(rows, None, cache)
    assert plain["psnr"] == 33.1 and plain["quality_on"] == "held-out" and plain.get("psnr_calibration") is None
    assert twin["psnr"] == 41.1 and twin["quality_on"] == "calibration"  # no compiled check: its own figure
    cache.compiled = CompiledCheck(ran=True, ok=True)
    assert shown_rows(rows, None, cache)[1]["psnr"] == 33.1


def test_runner_up_text_names_the_fastest_three_and_counts_the_rest():
    from ditbook.benchmark.verdict import runner_up_text

    from ditbook.records import Verdict
    from ditbook.settings import Gates

    ups = [{"name": f"c{i}", "speedup": 3.0 - i / 10, "psnr": 35.0, "why_not": "slower"} for i in range(5)]
    text = runner_up_text(Verdict("x", True, "", "the rule", Gates(), runner_ups=ups))
    assert "c0 (3.00×" in text and "c2 (" in text and "c3 (" not in text and "2 more in benchmark/results.json" in text
