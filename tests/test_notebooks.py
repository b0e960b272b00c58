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


def test_committed_kernelspec_is_ipykernels(tmp_path):
    """A notebook whose kernelspec differs from ipykernel's is named (JupyterLab would rewrite it
    on opening), and ``strip`` sets it."""
    path = tmp_path / "k.ipynb"
    nb = nbformat.read(str(NOTEBOOKS[0]), as_version=4)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(nb, str(path))
    assert any("kernelspec" in p for p in problems(path))
    strip(path)
    assert problems(path) == []


def test_committed_metadata_is_what_jupyterlab_writes(tmp_path):
    """The kernelspec and language_info JupyterLab sets on opening (the installed kernel's) are
    what the notebooks carry; a notebook with only ``language_info.name`` (as they were) is named,
    and ``strip`` sets both."""
    from ditbook.notebook_hygiene import jupyterlab_metadata

    want = jupyterlab_metadata()
    assert set(want["language_info"]) >= {"name", "version", "mimetype", "file_extension", "pygments_lexer"}
    path = tmp_path / "l.ipynb"
    nb = nbformat.read(str(NOTEBOOKS[0]), as_version=4)
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, str(path))
    assert any("language_info" in p and "modified" in p for p in problems(path))
    strip(path)
    assert problems(path) == [] and nbformat.read(str(path), as_version=4).metadata["language_info"] == want["language_info"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_opening_in_jupyterlab_leaves_the_notebook_unmodified(path, tmp_path):
    """The notebook read and saved back through the Jupyter server's contents API (the file
    manager behind ``/api/contents``), with the metadata JupyterLab sets on opening applied as
    JupyterLab applies it (a key is changed only when it differs, ``deepEqual``): nothing is
    changed, so JupyterLab does not mark it modified, and the saved file is byte for byte the
    committed one (``git status`` stays clean)."""
    import shutil

    from jupyter_server.services.contents.filemanager import FileContentsManager

    from ditbook.notebook_hygiene import jupyterlab_metadata

    shutil.copy(path, tmp_path / path.name)
    cm = FileContentsManager(root_dir=str(tmp_path))
    model = cm.get(path.name, content=True, type="notebook")
    changed = []
    for key, value in jupyterlab_metadata().items():  # NotebookPanel._updateSpec / _updateLanguage
        if model["content"].metadata.get(key) != value:
            changed.append(key)
            model["content"].metadata[key] = value
    assert changed == [], f"JupyterLab would mark {path.name} modified on opening: it rewrites {changed}"
    cm.save({"type": "notebook", "format": "json", "content": model["content"]}, path.name)
    assert (tmp_path / path.name).read_bytes() == path.read_bytes()


def _executed(tmp_path, outputs):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", outputs=outputs, execution_count=1)])
    path = tmp_path / "e.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_noise_finds_logs_warnings_and_stuck_bars(tmp_path):
    from ditbook.notebook_hygiene import noise

    out = nbformat.v4.new_output
    clean = _executed(tmp_path, [out("stream", name="stdout", text="baseline: 8/8 p3_s1 (6.2s)\n")])
    assert noise(clean) == []
    for bad in (out("stream", name="stdout", text="[12-01 05:11:46] [Cache-DiT] Skipped Forward Pattern Check\n"),
                out("stream", name="stderr", text="x.py:23: FutureWarning: `torch_dtype` is deprecated\n"),
                out("stream", name="stdout", text="Loading weights:   0%|          | 0/36\n"),
                out("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "a"},
                                          "text/plain": "Loading weights:   0%|"})):
        assert noise(_executed(tmp_path, [bad])), bad


@pytest.mark.slow
def test_an_executed_stage_notebook_has_no_log_or_warning_lines(tmp_path, monkeypatch, capfd):
    """The intake stage on the shipped reference model through the runner: the executed notebook
    carries no library log lines, warnings or stuck progress bars, and the run's own output has
    neither the kernel's unencrypted-TCP warning nor nbconvert's missing alt text."""
    from ditbook.notebook_hygiene import noise
    from ditbook.runner import start_run

    monkeypatch.delenv("DITBOOK_NOTEBOOKS", raising=False)
    for var in ("CACHE_DIT_LOG_LEVEL", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(var, raising=False)
    light = {"device": "cpu", "generation.prompts": ["a red circle on the left"], "generation.seeds": [0],
             "generation.steps": 2}
    outcome = start_run(ROOT / "models" / "reference.yaml", stages=["intake"], overrides=light, run_id="quiet",
                        outputs_root=tmp_path, log=lambda s: None)
    assert outcome.ok, outcome.failure
    assert noise(outcome.run.path / "01_intake.ipynb") == []
    captured = capfd.readouterr()
    assert "without encryption" not in captured.err + captured.out
    assert "Alternative text" not in captured.err + captured.out
    assert (outcome.run.path / "report.html").is_file()
