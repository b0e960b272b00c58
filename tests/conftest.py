import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the GPU speed suite (speedsuite) lives beside its scripts
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_card(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def no_launch(monkeypatch):
    """No process group may start: ``ditbook.parallel.launch`` starts its ranks through
    ``subprocess.Popen``, which here raises. For tests of refusals that must come before a launch."""
    import importlib
    import subprocess
    from types import SimpleNamespace

    launching = importlib.import_module("ditbook.parallel.launch")  # the module (the package exports a function of that name)

    def launched(*a, **kw):
        raise AssertionError("a process group was launched for a plan refused before launch")

    monkeypatch.setattr(launching, "subprocess", SimpleNamespace(**{**vars(subprocess), "Popen": launched}))


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


@pytest.fixture
def good_card_text(model_dir):
    return f"""name: demo
path: {model_dir}
pipeline:
  class: FluxPipeline
  source: diffusers
transformer:
  class: FluxTransformer2DModel
  source: diffusers
generation:
  prompts: ["a red circle"]
  seeds: [0]
  height: 32
  width: 32
  steps: 2
"""


# --- no temporary files left behind ------------------------------------------------------
# Every test session gets a temp folder of its own (so other processes on the machine cannot
# make it look dirty or clean); whatever starts with "ditbook" in it after the session and was
# not there before is a leftover of a stage or a test, and fails the session, listed by name.
TEMP_PREFIX = "ditbook"


def ditbook_temp_entries(folder) -> set[str]:
    return {p.name for p in Path(folder).iterdir() if p.name.startswith(TEMP_PREFIX)}


def pytest_sessionstart(session):
    import tempfile

    root = tempfile.mkdtemp(prefix="pytest-session-temp-")
    session.config._ditbook_temp = (root, os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = root  # subprocesses (stages, workers) too
    tempfile.tempdir = root
    session.config._ditbook_temp_before = ditbook_temp_entries(tempfile.gettempdir())


def pytest_sessionfinish(session, exitstatus):
    import shutil
    import tempfile

    saved = getattr(session.config, "_ditbook_temp", None)
    if saved is None:
        return
    root, old_env, old_tempdir = saved
    left = sorted(ditbook_temp_entries(root) - session.config._ditbook_temp_before)
    if old_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old_env
    tempfile.tempdir = old_tempdir
    shutil.rmtree(root, ignore_errors=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"temporary files left behind in the temp folder by this session ({len(left)}): "
                   + ", ".join(left))
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
