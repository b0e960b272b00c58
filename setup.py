"""The build step records which checkout a package was built from (``ditbook/_build.json``:
``revision``, ``dirty``), so a non-editable install's run.json names its commit
(``ditbook.runs.source_revision``). Everything else is in pyproject.toml."""

import json
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _git(*args):
    try:
        proc = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


class BuildWithRevision(build_py):
    def run(self):
        super().run()
        revision = _git("rev-parse", "HEAD")
        if not revision:  # not built from a checkout: nothing to record, nothing guessed
            return
        status = _git("status", "--porcelain", "--untracked-files=no")
        target = Path(self.build_lib) / "ditbook" / "_build.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"revision": revision, "dirty": bool(status) if status is not None else None}))


setup(cmdclass={"build_py": BuildWithRevision})
