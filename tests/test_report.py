"""result.md, report.html (self-contained; a failed stage is reported), ditbook report/compare."""

import json
import re

import pytest

from ditbook.benchmark.report import build_report, rebuild, result_markdown
from synthetic_run import make_synthetic_run
from ditbook.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    ok = make_synthetic_run(root / "a", step_scale=4.0)  # the runner-up order rests on its timings
    failed = make_synthetic_run(root / "b", failed_stage="cache")
    no_bench = make_synthetic_run(root / "c", failed_stage="cache", benchmark=False, parallel=False)
    return ok, failed, no_bench


def test_result_md_has_commands_environment_table_readout_and_plots(runs):
    ok, _, _ = runs
    md = result_markdown(ok)
    assert "ditbook run " in md and "-p generation.steps=3" in md and f"ditbook report {ok}" in md
    assert "| torch |" in md and "| cpu_count |" in md
    assert "| configuration | key | family | from |" in md and "| `gentle` | fake | here |" in md
    # the verdict comes first and names the cache stage's choice, with its held-out quality
    assert md.index("## Verdict") < md.index("## Reproduce") < md.index("## Summary")
    assert re.search(r"\*\*(Ship|Do not ship) fake gentle\b", md) and "held-out worst PSNR 41.50 dB" in md
    assert "Configuration key: `gentle`" in md  # the full key below the words
    assert "| held-out confirmation | ✔ |" in md and "| plan approved | – | not recorded |" in md
    for p in ("plots/tradeoff_psnr.png", "plots/residuals.png", "plots/grid.png"):
        assert f"benchmark/{p}" in md
        assert (ok / "benchmark" / p).is_file()
    # a CPU run: the parallel plans are parity results, not drawn as a scaling (speed) plot
    assert not (ok / "benchmark" / "plots" / "scaling.png").exists() and "plots/scaling.png" not in md
    assert "| ulysses2 | - | parallel | parallel | 2 CPU processes | - | parity only (CPU processes) | - | - | - |" in md


def test_result_md_says_the_rule_the_runner_up_and_one_quality_figure(runs):
    """The verdict names its rule and the runner-up with why it was not chosen; the chosen
    configuration's quality is its held-out figure, in the held-out columns only (its
    calibration figure, 60.25 dB in the cache record, appears nowhere), and the summary's
    held-out and calibration columns never share a row."""
    ok, _, _ = runs
    md = result_markdown(ok)
    assert "The ship rule (ditbook.ship): the fastest configuration that passes the gates on held-out seeds" in md
    # the other candidate is listed, in words, with why it was not chosen and its key (a runner-up,
    # or not eligible, as this host's timings decide)
    assert re.search(r"- fake brisk\b.*(not chosen|: ).*\(`brisk`\)", md), md
    assert "60.25" not in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and ln.count("|") == 14]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[10:12] == ["worst PSNR / SSIM vs uncached baseline", "parity vs one process"]
    rows = {(c[1] if c[1] != "-" else c[0]).strip("`"): c for c in ([x.strip() for x in ln.strip("|").split("|")] for ln in table[2:])}
    assert rows["gentle"][10] == "41.50 dB / 0.9900 (held-out seeds)"
    assert rows["rough"][10] == "21.50 dB / 0.6200 (held-out seeds)"  # failed there: not eligible


def test_report_html_is_self_contained(runs):
    ok, _, _ = runs
    html = build_report(ok).read_text()
    assert 'id="summary-table"' in html and 'id="verdict"' in html and 'id="checklist"' in html
    srcs = re.findall(r"<img[^>]*\ssrc=\"([^\"]*)\"", html)
    assert len(srcs) >= 4 and all(s.startswith("data:image/") for s in srcs)
    assert len(srcs) == len(set(srcs))  # no image twice: the notebook's copies link to the ones above
    assert html.index('id="verdict"') < html.index('id="plot"') < html.index('id="grid"') < html.index('id="summary"')
    assert "<details open" not in html and 'id="toc"' in html
    assert not re.search(r"<(script|link)[^>]*(src|href)=\"?(https?:)?//", html)
    assert "nb-01_intake" in html and "hello" in html  # the executed notebooks are in it


def test_failed_stage_is_reported(runs):
    _, failed, no_bench = runs
    for run in (failed, no_bench):
        md, html_path = rebuild(run)
        html = html_path.read_text()
        assert 'id="failed-cache"' in html and "adapter returned the wrong stream" in html
        assert "build_cache_adapter" in html  # the failing cell
        assert "Stage `cache` failed" in md.read_text()
    nb_html = build_report(no_bench).read_text()
    assert 'id="no-benchmark"' in nb_html and 'id="summary-table"' in nb_html
    assert "nb-03_cache" in nb_html and "RuntimeError" in nb_html


def test_cli_report_rebuilds_both(runs, capsys):
    ok, _, _ = runs
    (ok / "report.html").unlink(missing_ok=True)
    (ok / "result.md").unlink(missing_ok=True)
    assert main(["report", str(ok)]) == 0
    assert (ok / "report.html").is_file() and (ok / "result.md").is_file()
    assert main(["report", str(ok / "benchmark")]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_cli_compare_shows_deltas_and_notebook_diff(runs, capsys):
    ok, failed, _ = runs
    nb = failed / "01_intake.ipynb"
    nb.write_text(nb.read_text().replace("print('hello')", "print('hello again')"))
    assert main(["compare", str(ok), str(failed)]) == 0
    out = capsys.readouterr().out
    assert "metrics per configuration" in out and "gentle (fake gentle):" in out and "speedup" in out
    assert "cache" in out and "passed" in out and "failed" in out  # stage status change
    assert "=== notebook 01_intake.ipynb: source diff" in out and "hello again" in out
    assert "card.path:" in out and "verdict:" in out and "A: " in out
    assert main(["compare", str(ok), str(failed), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    gentle = next(d for d in data["deltas"] if d["name"] == "gentle")
    assert gentle["psnr"]["delta"] is not None and gentle["psnr"]["on_a"] == "held-out"
    assert main(["compare", str(ok), str(ok / "nope")]) == 2


def test_compare_is_short_and_leaves_out_widget_state_and_outputs(runs, capsys):
    """Two runs whose notebooks carry ipywidgets state and outputs that differ: compare names
    what differs (a card field, stage status, metrics, the verdicts, a source change) in under
    200 lines, and none of the widget state or outputs."""
    import nbformat

    ok, failed, _ = runs
    for run, tag in ((ok, "A"), (failed, "B")):
        path = run / "05_benchmark.ipynb"
        nb = nbformat.read(str(path), as_version=4)
        nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {
            "state": {f"model-{tag}-{i}": {"model_name": "FloatProgressModel", "state": {"value": i}}
                      for i in range(300)}}}
        nb.cells[-1].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                       text="".join(f"line {tag} {i}\n" for i in range(300)))]
        nbformat.write(nb, str(path))
    meta = json.loads((failed / "run.json").read_text())
    meta["card"]["generation"]["steps"] = 7
    (failed / "run.json").write_text(json.dumps(meta))
    assert main(["compare", str(ok), str(failed)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 200, len(lines)
    assert re.search(r"card.generation.steps: \d+ -> 7", out)
    assert re.search(r"cache\s+-\s+-\s+->\s+failed", out)
    assert "gentle (" in out and "verdict:" in out and re.search(r"^  A: (Ship|Do not ship|Ship the)", out, re.M)
    assert "FloatProgressModel" not in out and "line A 1" not in out and "widget-state" not in out
    # with outputs asked for, the outputs are there: the filter above is what kept them out
    assert main(["compare", str(ok), str(failed), "--cell-outputs"]) == 0
    assert "line A 1" in capsys.readouterr().out
    # the old option name still works, and says it is deprecated
    assert main(["compare", str(ok), str(failed), "--outputs"]) == 0
    got = capsys.readouterr()
    assert "line A 1" in got.out and "--outputs is deprecated" in got.err and "--cell-outputs" in got.err


def test_reproduce_lines_are_relative_to_where_the_run_started(tmp_path):
    """An installed package has no checkout to be relative to: the card and the run folder are
    written relative to the directory the run was started from (run.json ``cwd``)."""
    from ditbook.benchmark.report import environment_rows, reproduce_commands
    from ditbook.runs import RunFolder

    start = tmp_path / "work"
    (start / "outputs" / "m" / "r1").mkdir(parents=True)
    meta = {"cwd": str(start), "card_path": str(start / "models" / "m.yaml"),
            "source": {"version": "0.1.0", "revision": "abc123", "dirty": False, "root": None, "from": "build"}}
    lines = reproduce_commands(meta, RunFolder(start / "outputs" / "m" / "r1"))
    assert lines == ["ditbook run models/m.yaml", "ditbook report outputs/m/r1"]
    rows = dict(environment_rows(meta))
    assert rows["ditbook"] == "0.1.0 (installed package)" and "recorded when the package was built" in rows["git revision"]


def test_noise_floor_item_of_a_refused_cache_stage():
    """A cache stage that refused before its re-run records the re-run's max abs diff as None;
    the checklist said so instead of failing the benchmark stage with a TypeError."""
    from ditbook.benchmark.verdict import _noise_item

    from ditbook.records import CacheResults
    from ditbook.settings import Gates

    cache = CacheResults(adapter_module="a.py", gates=Gates(), refused="no block list",
                         noise_floor={"rerun_max_abs": None, "rerun_vs_intake": {"psnr_min": 80.0}})
    item = _noise_item(cache, None)
    assert "max abs diff -" in item["figure"], item
