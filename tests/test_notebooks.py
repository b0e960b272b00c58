"""Committed notebooks stay reviewable: no outputs, counts or papermill data; a parameters cell."""

from pathlib import Path

import nbformat
import pytest

from ditbook.notebook_hygiene import problems, strip

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_stage_notebooks():
    assert (ROOT / "notebooks" / "01_intake.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_clean(path):
    assert problems(path) == []


def test_hygiene_catches_and_strips_outputs(tmp_path):
    dirty = tmp_path / "d.ipynb"
    nb = nbformat.read(str(NOTEBOOKS[0]), as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.execution_count = 3
    cell.outputs = [nbformat.v4.new_output("stream", text="hi")]
    nb.metadata["papermill"] = {"parameters": {}}
    nbformat.write(nb, str(dirty))
    found = problems(dirty)
    assert any("outputs" in p for p in found) and any("papermill" in p for p in found)
    strip(dirty)
    assert problems(dirty) == []


def test_git_diff_of_notebooks_is_configured():
    assert "*.ipynb diff=jupyternotebook" in (ROOT / ".gitattributes").read_text()
    assert (ROOT / "nbdime_config.json").is_file()
