"""Every figure a reviewer reads says what it is measured on, and no CPU parallel plan is on a
speed axis or in a speed column (issue 41).

A *figure* is a PSNR or SSIM value (a number in a clause that says PSNR, SSIM or dB). Each one,
in ``report.html`` (its own sections, the executed notebooks left out), ``result.md``, ``ditbook
compare`` and the text drawn on the report's figures, sits in a clause — a table cell, a list
item, a caption, a line, each split at ``;`` — that also names what it is measured on: held-out
seeds, calibration seeds, parity (against one process), the uncached baseline, or the noise
floor. A parallel plan run as CPU processes (``benchmark.results.parity_only``) carries no
speed figure (``1.23×``, ``speedup 1.2``) anywhere, and is not among the plot's points.

The checks read the synthetic run of ``synthetic_run`` (a CPU run with parallel
plans, a ``+cache`` plan, a plan not run, cache-stage records on held-out and calibration seeds).
"""

import json
import re
from html.parser import HTMLParser

import pytest

from ditbook.benchmark.report import build_report, result_markdown, table_html
from synthetic_run import make_synthetic_run
from ditbook.cli import main

LABEL = re.compile(r"held-out|calibration|parity|uncached|noise floor", re.I)
FIGURE = re.compile(r"(PSNR|SSIM|\bdB\b)")
SPEED = re.compile(r"\d\s*×|speed-?up \d", re.I)


def clauses(text: str) -> list[str]:
    return [c for c in re.split(r";\s", text) if c.strip()]


def unlabelled(units: list[str], tables: list[list[list[str]]] = ()) -> list[str]:
    """The clauses of ``units`` that hold a PSNR/SSIM figure and do not say what it is measured on;
    and the cells of ``tables`` (header row first) under a PSNR/SSIM header that hold a number
    without saying it in the cell itself (a bare ``41.25`` under "psnr" is a figure too)."""
    out = []
    for unit in units:
        for c in clauses(unit):
            if FIGURE.search(c) and re.search(r"\d", c) and not LABEL.search(c):
                out.append(c.strip())
    for table in tables:
        head = [h for h in table[0]] if table else []
        for row in table[1:]:
            for h, c in zip(head, row):
                if re.search(r"psnr|ssim", h, re.I) and re.search(r"\d", c) and not LABEL.search(c):
                    out.append(f"{h}: {c}")
    return out


class Units(HTMLParser):
    """The text of the innermost block (cell, item, caption, paragraph, division) each piece of
    text is in, with the row each cell belongs to; the executed notebooks are left out."""

    BLOCKS = {"td", "th", "li", "p", "figcaption", "pre", "div", "h1", "h2", "summary", "b"}

    def __init__(self):
        super().__init__()
        self.stack, self.units, self.rows, self.row, self.skip, self.tables = [], [], [], None, 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.skip or (tag == "section" and "nb" in (a.get("class") or "")):
            self.skip += tag == "section"
            return
        if tag == "br" and self.stack:
            self.stack[-1][1] += " "
        if tag == "tr":
            self.row = []
        if tag == "table":
            self.tables.append([])
        if tag in self.BLOCKS:
            self.stack.append([tag, ""])

    def handle_endtag(self, tag):
        if self.skip:
            self.skip -= tag == "section"
            return
        if tag in self.BLOCKS and self.stack and self.stack[-1][0] == tag:
            _, text = self.stack.pop()
            self.units.append(text)
            if tag in ("td", "th") and self.row is not None:
                self.row.append(text)
        if tag == "tr" and self.row is not None:
            self.rows.append(self.row)
            if self.tables:
                self.tables[-1].append(self.row)
            self.row = None

    def handle_data(self, data):
        if not self.skip and self.stack:
            self.stack[-1][1] += data


def html_units(text: str) -> Units:
    u = Units()
    u.feed(text)
    return u


def md_units(md: str) -> tuple[list[str], list[list[str]], list[list[list[str]]]]:
    """The clauses' containers of a markdown document: table cells (their rows, and the tables,
    header row first), list items and lines."""
    units, rows, tables, in_table = [], [], [], False
    for line in md.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not in_table:
                tables.append([])
            tables[-1].append(cells)
            rows.append(cells)
            units += cells
            in_table = True
        elif line.startswith("|"):
            continue  # the header's rule
        else:
            in_table = False
            if line.strip():
                units.append(line)
    return units, rows, tables


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_synthetic_run(tmp_path_factory.mktemp("labels") / "a")


def cpu_plans(run) -> list[str]:
    res = json.loads((run / "benchmark" / "results.json").read_text())
    names = [n.split(" ×")[0] for n in res["parity_only"]]
    assert names, "the synthetic run is a CPU run with parallel plans"
    return names


def plan_rows(rows: list[list[str]], names: list[str]) -> list[list[str]]:
    """The table rows that are a CPU parallel plan's (its name and "CPU processes" in the row)."""
    return [r for r in rows if any(re.search(rf"(^|\s|`){re.escape(n)}(`|\s|$)", c) for c in r for n in names)
            and any("CPU processes" in c for c in r)]


def test_every_figure_in_report_html_is_labelled_and_cpu_plans_have_no_speed(run):
    text = build_report(run).read_text()
    got = html_units(text)
    assert unlabelled(got.units, got.tables) == []
    rows = plan_rows(got.rows, cpu_plans(run))
    assert len(rows) >= 3, got.rows  # each plan once, in the summary table
    for r in rows:
        assert not any(SPEED.search(c) for c in r), r
    # a parallel plan shows its figure against the uncached baseline and its parity, each labelled
    cached = [r for r in rows if r[0].startswith("ulysses2+cache")]
    assert cached and any("32.00 dB" in c and "calibration seeds" in c for c in cached[0]), cached
    assert any("99.00 dB" in c and "parity" in c for c in cached[0]), cached
    # the plans not run are named with their reason
    assert "ring2+cache" in text and "needs CUDA" in text


def test_every_figure_in_result_md_is_labelled_and_cpu_plans_have_no_speed(run):
    md = result_markdown(run)
    units, rows, tables = md_units(md)
    assert unlabelled(units, tables) == []
    plans = plan_rows(rows, cpu_plans(run))
    assert len(plans) >= 3
    for r in plans:
        assert not any(SPEED.search(c) for c in r), r
    assert "ring2+cache" in md and "needs CUDA" in md


def test_every_figure_in_compare_is_labelled_and_cpu_plans_have_no_speed(run, capsys):
    assert main(["compare", str(run), str(run)]) == 0
    out = capsys.readouterr().out
    metrics = out.split("metrics per configuration", 1)[1].split("\nverdict:", 1)[0].splitlines()[1:]
    verdicts = out.split("\nverdict:", 1)[1].split("\n===", 1)[0].splitlines()
    assert metrics and unlabelled(metrics + verdicts) == []
    names = cpu_plans(run)
    lines = [ln for ln in metrics if any(ln.strip().startswith(f"{n} ×") for n in names)]
    assert len(lines) >= 3, metrics
    for ln in lines:  # the figures after the row's name (which carries its process count, "×2 proc")
        assert not SPEED.search(ln.split("):", 1)[1].replace("speedup: none", "")), ln


def test_the_benchmark_notebook_tables_label_their_figures_and_show_no_cpu_speed(run):
    """What the benchmark notebook displays (``table_html`` of the summary rows, the columns its
    summary cell asks for) is labelled too: it is embedded in the report."""
    res = json.loads((run / "benchmark" / "results.json").read_text())
    html = table_html(res["summary"], ["name", "family", "source", "nproc", "speedup", "e2e_ms",
                                       "psnr_min", "ssim_min", "passed"])
    got = html_units(html)
    assert unlabelled(got.units, got.tables) == []
    names = cpu_plans(run)
    for r in got.rows[1:]:
        if r[0] in names and r[3] != "1":
            assert not re.search(r"\d", r[4]), r


def test_text_drawn_on_the_report_figures_is_labelled(run, monkeypatch):
    """Every PSNR drawn on the speed plot, the image grid and the worst held-out image figure
    names its seeds; the plot draws no CPU parallel plan."""
    from ditbook.benchmark import plots
    from ditbook.benchmark.figures import make_figures
    from ditbook.runs import RunFolder

    texts: list[str] = []
    save = plots._save

    def spy(fig, path, **kw):
        for t in fig.findobj(lambda a: hasattr(a, "get_text")):
            texts.append(t.get_text())
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "_save", spy)
    res = make_figures(RunFolder(run))
    drawn = [t.replace("\n", " ") for t in texts if t.strip()]
    assert any("dB" in t for t in drawn)
    assert unlabelled(drawn) == []
    assert not set(res.parity_only) & set(res.plot_points) and res.parity_only


def test_the_checker_finds_an_unlabelled_figure_and_a_cpu_speed():
    """The checks above can fail: an unlabelled PSNR, and a speed figure in a CPU plan's row."""
    assert unlabelled(["dbcache: 41.25 dB / 0.9971"]) == ["dbcache: 41.25 dB / 0.9971"]
    assert unlabelled(["41.25 dB (held-out seeds); 100 dB"]) == ["100 dB"]
    assert unlabelled(["41.25 dB / 0.9971 (calibration seeds)"]) == []
    assert unlabelled([], [[["name", "psnr_holdout"], ["a", "41.25"], ["b", "-"]]]) == ["psnr_holdout: 41.25"]
    rows = plan_rows([["te2", "parallel", "2 CPU processes", "0.84×"]], ["te2"])
    assert rows and any(SPEED.search(c) for c in rows[0])
