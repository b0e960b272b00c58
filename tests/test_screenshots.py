"""The README's screenshots of report.html are current (issue 26 item 10): ``docs/screenshots.json``
names the run the README's caption names, the four PNGs are the ones it lists (sha256), and its
first screen has the structure the current report code renders (checklist row labels, the parts
up to the checklist), read from a report built now on the synthetic run in headless Chromium. A
change to the first screen without ``ditbook screenshots`` (``make screenshots``) fails here.

Skipped only when chromium is absent outside CI; in CI (``CI`` set) a missing chromium fails."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ditbook.benchmark import screenshots
from ditbook.benchmark.report import build_report
from synthetic_run import make_synthetic_run

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def current_screen(tmp_path_factory):
    """The first screen the report code renders now, on the synthetic run, as Chromium reads it."""
    if screenshots.find_chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; in CI the Makefile must install Debian's chromium package")
        pytest.skip("chromium is not installed (make chromium); this test is required in CI")
    tmp = tmp_path_factory.mktemp("screens")
    report = build_report(make_synthetic_run(tmp))
    work = tmp / "work"
    work.mkdir()
    screen = screenshots.first_screen(report, work)
    screen.pop("heights", None)
    return screen


def manifest() -> dict:
    return json.loads((DOCS / screenshots.MANIFEST).read_text())


def test_readme_screenshots_are_current(current_screen):
    m = manifest()
    assert screenshots.staleness(m, DOCS, README.read_text(), current_screen) == []
    shown = m["first_screen"]
    assert shown["verdict"] and len(shown["checklist"]) == len(current_screen["checklist"]) >= 7
    for name in screenshots.SHOTS:  # the README shows each of them
        assert f"(docs/{name})" in README.read_text()


def test_staleness_sees_each_change(current_screen, tmp_path):
    # the check itself can fail: an image, the caption and the first screen's structure each show
    m = manifest()
    for name in screenshots.SHOTS:
        shutil.copy(DOCS / name, tmp_path / name)
    readme = README.read_text()
    assert screenshots.staleness(m, tmp_path, readme, current_screen) == []
    with open(tmp_path / "report_plot.png", "ab") as fh:
        fh.write(b"\0")
    assert [x.split(":")[0] for x in screenshots.staleness(m, tmp_path, readme, current_screen)] == ["report_plot.png"]
    shutil.copy(DOCS / "report_plot.png", tmp_path / "report_plot.png")
    assert "caption" in " ".join(screenshots.staleness(m, tmp_path, readme.replace(f"run {m['run']}", "run x"),
                                                       current_screen))
    renamed = dict(current_screen, checklist=[["gates passed", "✔", ""]] + current_screen["checklist"][1:])
    assert "first screen checklist" in " ".join(screenshots.staleness(m, tmp_path, readme, renamed))
    moved = dict(current_screen, ids=[i for i in current_screen["ids"] if i != "gates"])
    assert "first screen ids" in " ".join(screenshots.staleness(m, tmp_path, readme, moved))


def test_the_newest_finished_run_is_taken(tmp_path):
    for model, run, status, created in (("a", "old", "finished", "2026-01-01T10:00:00"),
                                        ("b", "new", "finished", "2026-01-02T10:00:00"),
                                        ("a", "newest", "failed", "2026-01-03T10:00:00")):
        (tmp_path / model / run).mkdir(parents=True)
        (tmp_path / model / run / "run.json").write_text(json.dumps({"run_id": run, "status": status, "created": created}))
    assert screenshots.newest_finished_run(tmp_path).path.name == "new"
    with pytest.raises(screenshots.ScreenshotError, match="no finished run"):
        screenshots.newest_finished_run(tmp_path / "a" / "old")
