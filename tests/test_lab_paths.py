"""A stage notebook opened in JupyterLab runs its kernel in ``notebooks/``: the parameters a
person types (``CARD = "models/reference.yaml"``, ``RUN_DIR = ""`` or a run folder under
``outputs/``) are resolved against the project's root, and new runs land in the root's
``outputs/`` (git-ignored), never in ``notebooks/outputs`` (issue 41)."""

from pathlib import Path

import pytest

from synthetic_run import CARD
from ditbook.context import open_stage, project_root, resolve_from_root

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A checkout-like project: ``.git``, ``models/<card>``, ``notebooks/`` as the current folder."""
    (tmp_path / ".git").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "models" / "synthetic.yaml").write_text(CARD.format(path=tmp_path / "model"))
    monkeypatch.chdir(tmp_path / "notebooks")
    monkeypatch.delenv("DITBOOK_OUTPUTS", raising=False)
    return tmp_path


def test_relative_card_and_run_folder_resolve_against_the_project_root(project):
    assert project_root() == project
    assert resolve_from_root("models/synthetic.yaml") == project / "models" / "synthetic.yaml"
    assert resolve_from_root("../models/synthetic.yaml").resolve() == project / "models" / "synthetic.yaml"
    assert resolve_from_root("models/none.yaml") == Path("models/none.yaml")  # not found: the caller says so


def test_a_new_run_from_notebooks_lands_in_the_root_outputs(project):
    ctx = open_stage("models/synthetic.yaml", "", "intake", {})
    assert ctx.run.path.parent.parent == project / "outputs"
    assert not (project / "notebooks" / "outputs").exists()
    again = open_stage("models/synthetic.yaml", str(ctx.run.path.relative_to(project)), "inspect", {})
    assert again.run.path == ctx.run.path


def test_the_intake_gate_reads_the_card_from_the_root(project):
    from ditbook.intake.stage import gate_problems

    card, problems = gate_problems("models/synthetic.yaml")
    assert problems == [] and card.name == "synthetic"


def test_outside_a_checkout_the_current_folder_is_the_root(tmp_path, monkeypatch):
    if any((p / ".git").exists() for p in tmp_path.resolve().parents):
        pytest.skip("the temporary folder is inside a checkout here")
    monkeypatch.chdir(tmp_path)
    assert project_root() == tmp_path.resolve()


def test_make_lab_starts_at_the_repository_root():
    text = (REPO / "Makefile").read_text()
    lab = text.split("\nlab:", 1)[1].split("\n\n", 1)[0]
    assert "--ServerApp.root_dir=" in lab and "notebooks/" not in lab, lab
