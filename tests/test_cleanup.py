"""Cleanup: the session check of ``conftest.py`` fails a session that leaves ``ditbook*`` in the
temp folder (and passes one that cleans up); ``make clean`` removes build and cache folders and
never touches ``outputs/``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _session(tmp_path, body: str):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_leak.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_session_check_fails_on_a_leftover(tmp_path):
    leak = _session(tmp_path, "import tempfile\n\ndef test_leaks():\n    tempfile.mkdtemp(prefix='ditbook_leak_')\n")
    assert leak.returncode == 1, leak.stdout + leak.stderr
    assert "left behind" in leak.stdout and "ditbook_leak_" in leak.stdout
    clean = _session(tmp_path, "import shutil, tempfile\n\ndef test_cleans():\n"
                               "    shutil.rmtree(tempfile.mkdtemp(prefix='ditbook_tidy_'))\n")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "left behind" not in clean.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_clean_removes_build_and_caches_not_outputs(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    made = ["build/lib/x.py", "lib/ditbook.egg-info/PKG-INFO", "lib/ditbook/__pycache__/a.pyc",
            ".pytest_cache/v/x", "tests/__pycache__/b.pyc"]
    kept = ["outputs/reference/r1/run.json", "outputs/reference/r1/__pycache__/keep.pyc", "lib/ditbook/a.py",
            "outputs/README.md"]
    for rel in made + kept:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    proc = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for rel in made:
        assert not (tmp_path / rel).exists(), rel
    for rel in ("build", "lib/ditbook.egg-info", "lib/ditbook/__pycache__", ".pytest_cache"):
        assert not (tmp_path / rel).exists(), rel
    for rel in kept:
        assert (tmp_path / rel).exists(), rel


def test_importing_generated_adapter_source_leaves_no_temp_folder():
    """Issue 17: importing a generated adapter left /tmp/ditbook_adapter_* folders behind."""
    import tempfile

    from ditbook.adapter.build import import_adapter_module

    before = {p.name for p in Path(tempfile.gettempdir()).iterdir()}
    module = import_adapter_module("VALUE = 17\n", None, "cleanup_probe")
    assert module.VALUE == 17
    after = {p.name for p in Path(tempfile.gettempdir()).iterdir()}
    assert not [n for n in after - before if n.startswith("ditbook")]


def test_adapter_file_is_written_even_when_the_same_source_was_imported_before(tmp_path):
    # the run folder's adapter file is part of its record: a second run with the same model in the
    # same process (same source, module already imported) must still get its file
    from ditbook.adapter.build import import_adapter_module

    source = "VALUE = 42\n"
    first = import_adapter_module(source, tmp_path / "a" / "adapter_x.py", name="x")
    second = import_adapter_module(source, tmp_path / "b" / "adapter_x.py", name="x")
    assert first.VALUE == second.VALUE == 42 and first.__file__ != second.__file__
    assert (tmp_path / "a" / "adapter_x.py").read_text() == source
    assert (tmp_path / "b" / "adapter_x.py").read_text() == source
