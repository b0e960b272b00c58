"""``benchmarks/cell_times.py``: the per-cell breakdown the GPU check records (where a stage's
time went), read from the executed notebooks papermill keeps in a run folder."""

from __future__ import annotations

import json

import cell_times


def _notebook(path, durations, total):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": ["# title"]}]
    for i, d in enumerate(durations):
        meta = {"papermill": {"duration": d}} if d is not None else {}
        cells.append({"cell_type": "code", "metadata": meta, "source": [f"# comment\n", f"step_{i}()\n"]})
    path.write_text(json.dumps({"cells": cells, "metadata": {"papermill": {"duration": total}}}))


def test_cells_sorted_summed_and_filtered(tmp_path):
    _notebook(tmp_path / "03_cache.ipynb", [0.2, 5.0, None, 1.5], 9.0)
    _notebook(tmp_path / "01_intake.ipynb", [2.0], 3.0)
    (tmp_path / "notes.ipynb").write_text("{}")  # not a stage notebook: ignored
    got = cell_times.run_cells(tmp_path, min_seconds=1.0)
    assert list(got) == ["intake", "cache"]
    cache = got["cache"]
    assert cache["notebook_s"] == 9.0 and cache["cells_s"] == 6.7
    assert [(c["seconds"], c["code"]) for c in cache["cells"]] == [(5.0, "step_1()"), (1.5, "step_3()")]


def test_cli_refuses_a_folder_without_notebooks(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        cell_times.main([str(tmp_path)])
    assert "no executed stage notebook" in capsys.readouterr().err


def test_kernel_wait_and_shutdown_from_the_stamps(tmp_path):
    """The wait before the first cell (the kernel's start-up) and after the last, from papermill's
    start and end stamps; None where a stamp is missing."""
    cells = [{"cell_type": "code", "source": ["a()\n"], "metadata": {"papermill": {
                 "duration": 1.0, "start_time": "2026-12-02T10:00:12.5+00:00", "end_time": "2026-12-02T10:00:13.5+00:00"}}},
             {"cell_type": "code", "source": ["b()\n"], "metadata": {"papermill": {
                 "duration": 2.0, "start_time": "2026-12-02T10:00:13.5+00:00", "end_time": "2026-12-02T10:00:15.5+00:00"}}}]
    meta = {"papermill": {"duration": 6.0, "start_time": "2026-12-02T10:00:10+00:00", "end_time": "2026-12-02T10:00:16+00:00"}}
    (tmp_path / "02_inspect.ipynb").write_text(json.dumps({"cells": cells, "metadata": meta}))
    got = cell_times.stage_cells(tmp_path / "02_inspect.ipynb")
    assert got["kernel_wait_s"] == 2.5 and got["shutdown_s"] == 0.5 and got["cells_s"] == 3.0
    _notebook(tmp_path / "01_intake.ipynb", [2.0], 3.0)
    assert cell_times.stage_cells(tmp_path / "01_intake.ipynb")["kernel_wait_s"] is None
