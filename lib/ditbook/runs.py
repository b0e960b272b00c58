"""Run folders: ``outputs/<model>/<run-id>/`` with ``run.json`` and one folder per stage.

Everything a later stage needs from an earlier one passes through these files. A finished run
is never overwritten; a failed stage leaves the earlier stages' outputs intact.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .card import ModelCard
from .intake.environment import environment

RUN_FILE = "run.json"
RESULTS_FILE = "results.json"


class RunError(RuntimeError):
    pass


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _check_scalars(value: Any, where: str = "results") -> None:
    """results.json holds scalars, lists, mappings and relative paths only, never arrays."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_scalars(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_scalars(v, f"{where}[{i}]")
    elif value is None or isinstance(value, (str, int, float, bool)):
        return
    else:
        raise TypeError(f"{where} is a {type(value).__name__}; results.json holds scalars and relative paths only")


def _jsonable(value: Any) -> Any:
    """numpy scalars become Python numbers; anything else must already be plain."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def source_revision(root: str | Path | None = None) -> dict:
    """The git revision of the ditbook checkout that ran (``revision``, ``dirty``: uncommitted
    changes to tracked files, ``root``: the checkout, against which reproduce lines are written);
    ``{"revision": None}`` for an installed copy outside git."""
    import subprocess

    root = Path(root or Path(__file__).resolve().parent)

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    revision = git("rev-parse", "HEAD")
    if not revision:
        return {"revision": None, "dirty": None, "root": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"revision": revision, "dirty": bool(status) if status is not None else None,
            "root": git("rev-parse", "--show-toplevel")}


def _environment_as_run() -> dict:
    """``environment()`` with ``offline`` as the stages load: every load goes through
    ``ditbook.loading``, which sets ``HF_HUB_OFFLINE=1`` whatever the shell said; the shell's own
    value is kept beside it (``hf_hub_offline_env``, None when unset)."""
    env = environment()
    env["hf_hub_offline_env"] = os.environ.get("HF_HUB_OFFLINE")
    env["offline"] = True
    return env


class RunFolder:
    """One run of the playbook on one model."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()

    # -- creation -----------------------------------------------------------------------
    @classmethod
    def create(cls, card: ModelCard, outputs_root: str | Path, run_id: str | None = None,
               overrides: dict | None = None) -> "RunFolder":
        run_id = run_id or new_run_id()
        if not re.fullmatch(r"[A-Za-z0-9._-]+", run_id):
            raise RunError(f"run id {run_id!r} may hold letters, digits, '.', '_' and '-' only")
        path = Path(outputs_root) / card.name / run_id
        if path.exists():
            raise RunError(f"run folder {path} already exists; a finished or started run is never "
                           f"overwritten — pick another --run-id or continue it with --resume {path}")
        path.mkdir(parents=True)
        run = cls(path)
        run.write_meta({
            "model": card.name,
            "run_id": run_id,
            "created": _dt.datetime.now().isoformat(timespec="seconds"),
            "card_path": str(card.card_path),
            "card": card.to_dict(),
            "card_hash": card.content_hash(),
            "overrides": overrides or {},
            "environment": _environment_as_run(),
            "source": source_revision(),
            "status": "running",
            "stages": {},
        })
        return run

    # -- run.json -----------------------------------------------------------------------
    @property
    def meta_path(self) -> Path:
        return self.path / RUN_FILE

    def exists(self) -> bool:
        return self.meta_path.is_file()

    def read_meta(self) -> dict:
        if not self.exists():
            raise RunError(f"{self.path} is not a run folder (no {RUN_FILE})")
        return json.loads(self.meta_path.read_text())

    def write_meta(self, meta: dict) -> None:
        _atomic_write(self.meta_path, json.dumps(_jsonable(meta), indent=2, sort_keys=False) + "\n")

    def update_stage(self, stage: str, **fields: Any) -> dict:
        meta = self.read_meta()
        entry = meta.setdefault("stages", {}).setdefault(stage, {})
        entry.update(fields)
        self.write_meta(meta)
        return meta

    def set_status(self, status: str) -> None:
        meta = self.read_meta()
        meta["status"] = status
        self.write_meta(meta)

    @property
    def status(self) -> str:
        return self.read_meta().get("status", "unknown")

    def stage_status(self, stage: str) -> str | None:
        return self.read_meta().get("stages", {}).get(stage, {}).get("status")

    # -- stage folders ------------------------------------------------------------------
    def stage_dir(self, stage: str, create: bool = True) -> Path:
        d = self.path / stage
        if create:
            d.mkdir(parents=True, exist_ok=True)
        return d

    def results_path(self, stage: str) -> Path:
        return self.path / stage / RESULTS_FILE

    def write_results(self, stage: str, results: dict) -> Path:
        results = _jsonable(results)
        _check_scalars(results)
        path = self.results_path(stage)
        _atomic_write(path, json.dumps(results, indent=2) + "\n")
        return path

    def read_results(self, stage: str) -> dict:
        path = self.results_path(stage)
        if not path.is_file():
            raise RunError(f"stage '{stage}' has no results in {self.path} — run it first "
                           f"(ditbook run CARD --stages ...,{stage})")
        return json.loads(path.read_text())

    def has_results(self, stage: str) -> bool:
        return self.results_path(stage).is_file()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"


def latest_run(outputs_root: str | Path, model: str, with_stage: str | None = None) -> RunFolder | None:
    """The newest run folder of a model (optionally one that has results for ``with_stage``)."""
    root = Path(outputs_root) / model
    if not root.is_dir():
        return None
    runs = [RunFolder(p) for p in root.iterdir() if (p / RUN_FILE).is_file()]
    if with_stage:
        runs = [r for r in runs if r.has_results(with_stage)]
    runs.sort(key=lambda r: (r.read_meta().get("created", ""), r.path.name))
    return runs[-1] if runs else None
