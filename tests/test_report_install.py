"""What a new user meets first: the package installs without the checkout (notebooks shipped as
package data, outputs under the current directory), the command has a version and help for
everything, run.json says which source ran, and the intake form keeps a card as written."""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ditbook.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent


def _missing_help(parser: argparse.ArgumentParser, name: str = "ditbook") -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for sub, p in action.choices.items():
                if not helps.get(sub):
                    missing.append(f"{name} {sub}")
                missing += _missing_help(p, f"{name} {sub}")
        elif not action.help:
            missing.append(f"{name} {action.dest}")
    return missing


def test_every_subcommand_and_argument_has_help():
    assert _missing_help(build_parser()) == []


def test_help_check_finds_an_argument_without_help():
    """The check can fail: a parser with one undocumented argument is named."""
    p = argparse.ArgumentParser(prog="x")
    sub = p.add_subparsers()
    s = sub.add_parser("go", help="documented")
    s.add_argument("thing")
    assert _missing_help(p, "x") == ["x go thing"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    import ditbook

    assert capsys.readouterr().out.strip() == f"ditbook {ditbook.__version__}"


def test_outputs_default_to_the_current_directory(tmp_path, monkeypatch):
    from ditbook.runner import discover_stages, outputs_dir

    monkeypatch.delenv("DITBOOK_OUTPUTS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert outputs_dir() == tmp_path / "outputs"
    assert [s.name for s in discover_stages()] == ["intake", "inspect", "cache", "parallel", "benchmark"]


def test_parallel_without_out_writes_under_outputs(tmp_path, monkeypatch):
    from ditbook.commands.parallel import default_out

    monkeypatch.setenv("DITBOOK_OUTPUTS", str(tmp_path / "outs"))
    out = default_out(argparse.Namespace(run=None, card="models/reference.yaml"))
    assert out.parent == tmp_path / "outs" / "reference" and out.name.startswith("parallel-")
    assert default_out(argparse.Namespace(run=str(tmp_path / "r"), card="c.yaml")) == tmp_path / "r" / "parallel" / "runs"


@pytest.mark.slow
def test_non_editable_install_ships_the_notebooks(tmp_path):
    """``pip install .`` (here ``--target``, no dependencies, no build isolation: no download),
    then ``ditbook stages`` from another directory finds the five notebooks inside the package."""
    target = tmp_path / "site"
    src = tmp_path / "src"
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "outputs", "models", "build",
                                                             "*.egg-info", "__pycache__", ".pytest_cache"),
                    symlinks=True)
    # built from a checkout: the build records its commit (setup.py, ditbook/_build.json)
    env_git = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "build me"]):
        subprocess.run(["git", "-C", str(src), *cmd], check=True, env=env_git, capture_output=True)
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(src)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shipped = sorted(p.name for p in (target / "ditbook" / "notebooks").glob("*.ipynb"))
    assert shipped == ["01_intake.ipynb", "02_inspect.ipynb", "03_cache.ipynb", "04_parallel.ipynb",
                       "05_benchmark.ipynb"]
    assert not (target / "ditbook" / "notebooks").is_symlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DITBOOK_NOTEBOOKS", "DITBOOK_OUTPUTS")}
    env["PYTHONPATH"] = str(target)
    proc = subprocess.run([sys.executable, "-c", "import ditbook, sys; print(ditbook.__file__); "
                           "from ditbook.cli import main; sys.exit(main(['stages']))"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(str(target))
    assert len([ln for ln in lines[1:] if str(target / "ditbook" / "notebooks") in ln]) == 5
    # the installed copy's provenance: its version, and the commit it was built from
    proc = subprocess.run([sys.executable, "-c", "import json; from ditbook.runs import source_revision; "
                           "print(json.dumps(source_revision()))"], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    got = json.loads(proc.stdout)
    assert got["revision"] == commit and got["from"] == "build" and got["version"], got


def test_run_json_records_the_source_revision(tmp_path):
    from ditbook.runs import source_revision

    here = source_revision(REPO / "lib")
    if shutil.which("git") and (REPO / ".git").exists():
        assert len(here["revision"]) == 40 and isinstance(here["dirty"], bool)
    # outside a checkout: recorded as unknown, not guessed
    assert source_revision(tmp_path) == {"version": here["version"], "revision": None, "dirty": None, "root": None}


def test_an_untracked_copy_inside_a_checkout_is_not_that_checkout(tmp_path):
    """A package installed into a venv inside some git repository (files the repository does not
    track) does not take that repository's revision for its own."""
    from ditbook.runs import installed_version, source_revision

    if not shutil.which("git"):
        pytest.skip("git is not installed")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    repo = tmp_path / "project"
    (repo / ".venv" / "site" / "ditbook").mkdir(parents=True)
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / ".venv" / "site" / "ditbook" / "__init__.py").write_text("")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=env, capture_output=True)
    assert source_revision(repo)["revision"]  # the project itself is a checkout
    got = source_revision(repo / ".venv" / "site" / "ditbook")
    assert got["revision"] is None and got["version"] == installed_version()


def test_card_form_keeps_comments_and_layout(tmp_path, good_card_text):
    from ditbook.intake.card_form import save_answers

    text = ("# my model, trained last week\n" +
            good_card_text.replace("  class: FluxTransformer2DModel\n", "")
            .replace("steps: 2\n", "steps: 2  # short, for a smoke run\n"))
    p = tmp_path / "c.yaml"
    p.write_text(text)
    target, left = save_answers(p, {"transformer.class": "FluxTransformer2DModel"})
    assert left == []
    out = target.read_text()
    assert out.startswith("# my model, trained last week\n")
    assert "steps: 2  # short, for a smoke run" in out
    assert 'prompts: ["a red circle"]' in out  # flow style and quotes as written
    assert "class: FluxTransformer2DModel" in out
    # nothing but the answer changed
    assert out.replace("  class: FluxTransformer2DModel\n", "", 1) == text
