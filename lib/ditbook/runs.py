"""Run folders: ``outputs/<model>/<run-id>/`` with ``run.json`` and one folder per stage.

Everything a later stage needs from an earlier one passes through these files. A finished run
is never overwritten; a failed stage leaves the earlier stages' outputs intact.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from pathlib import Path
from typing import Any

from .card import ModelCard
from .files import atomic_write_text
from .environment import environment

RUN_FILE = "run.json"
RESULTS_FILE = "results.json"


class RunError(RuntimeError):
    pass


LOCK_FILE = ".lock"
_SAFE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def safe_component(value, what: str) -> str:
    """``value`` as one safe path component (a model name or a run id), or ``RunError``.

    Letters, digits, '.', '_' and '-', starting with a letter or digit: no separators, no
    ``.``/``..``, no absolute paths, so a run folder always lies inside the outputs folder."""
    text = str(value) if value is not None else ""
    if not _SAFE_RE.fullmatch(text) or text in (".", ".."):
        raise RunError(f"{what} {text!r} must be one path component of letters, digits, '.', '_' and '-' "
                       f"starting with a letter or digit (it names a folder under the outputs folder)")
    return text


def _inside_root(root: Path, model: str) -> Path:
    """The outputs root, resolved once (it may itself be a link), after checking that
    ``root/model`` is a real folder inside it — a link from ``outputs/<model>`` to a folder
    elsewhere would put the run outside the outputs root."""
    resolved = root.resolve()
    where = (root / model).resolve()
    if (root / model).is_symlink() or where.parent != resolved:
        raise RunError(f"{root / model} leads to {where}, outside the outputs folder {resolved}; runs are only "
                       f"written inside it — remove the link, or point --outputs/$DITBOOK_OUTPUTS at where runs go")
    return resolved


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_json(path: Path, what: str) -> dict:
    """A JSON file, or ``RunError`` naming the file and what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                       f"it may be truncated — restore it or start a new run") from exc
    if not isinstance(data, dict):
        raise RunError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)  # no temp file left on a failed write; mode 0644 like the run's other files


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


BUILD_INFO = "_build.json"  # written into the package by setup.py's build step (the checkout it was built from)


def installed_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the package's own."""
    from importlib import metadata

    from . import __version__

    try:
        return metadata.version("ditbook")
    except metadata.PackageNotFoundError:
        return __version__


def build_info(package_dir: str | Path | None = None) -> dict:
    """What the build recorded of the checkout it was built from (``revision``, ``dirty``), from
    ``_build.json`` inside the package; ``{}`` when there is none (a checkout, or a build outside git)."""
    path = Path(package_dir or Path(__file__).resolve().parent) / BUILD_INFO
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def source_revision(root: str | Path | None = None) -> dict:
    """Which ditbook ran: ``version`` (the installed distribution's), ``revision`` and ``dirty``
    (uncommitted changes to tracked files) of the checkout it runs from, and ``root`` (that
    checkout). An installed copy is not a checkout, even inside one (a venv in a project): its
    revision is the one its build recorded (``from: "build"``), else ``None``, never the enclosing
    repository's."""
    import subprocess

    root = Path(root or Path(__file__).resolve().parent)

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    revision = git("rev-parse", "HEAD")
    tracked = bool(git("ls-files", "--", ".")) if revision else False  # the code here is the checkout's
    out = {"version": installed_version()}
    if not revision or not tracked:
        built = build_info() if root == Path(__file__).resolve().parent else {}
        if built.get("revision"):
            return {**out, "revision": built["revision"], "dirty": built.get("dirty"), "root": None, "from": "build"}
        return {**out, "revision": None, "dirty": None, "root": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {**out, "revision": revision, "dirty": bool(status) if status is not None else None,
            "root": git("rev-parse", "--show-toplevel"), "from": "checkout"}


def _environment_as_run() -> dict:
    """``environment()`` with ``offline`` as the stages load: every load goes through
    ``ditbook.loading``, which sets ``HF_HUB_OFFLINE=1`` whatever the shell said; the shell's own
    value is kept beside it (``hf_hub_offline_env``, None when unset)."""
    env = environment()
    env["hf_hub_offline_env"] = os.environ.get("HF_HUB_OFFLINE")
    env["offline"] = True
    return env


def outputs_dir() -> Path:
    """``$DITBOOK_OUTPUTS``, else ``outputs/`` in the current directory (the repository root for
    ``make demo``)."""
    env = os.environ.get("DITBOOK_OUTPUTS")
    return Path(env) if env else Path.cwd() / "outputs"


class RunFolder:
    """One run of the playbook on one model."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()

    # -- creation -----------------------------------------------------------------------
    @classmethod
    def create(cls, card: ModelCard, outputs_root: str | Path, run_id: str | None = None,
               overrides: dict | None = None) -> "RunFolder":
        model = safe_component(card.name, "model name (card field 'name')")
        chosen = safe_component(run_id, "run id") if run_id is not None else None
        root = Path(outputs_root)
        if root.exists() and not root.is_dir():
            raise RunError(f"outputs folder {root} is not a folder")
        try:
            (root / model).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the outputs folder {root / model}: {exc.strerror or exc}") from exc
        root = _inside_root(root, model)
        # mkdir without exist_ok is the claim: of two processes creating one id, one gets it and
        # the other gets a clear refusal (explicit id) or the next free id (a timestamp id)
        base = chosen or new_run_id()
        for attempt in range(1 if chosen else 100):
            path = root / model / (base if attempt == 0 else f"{base}-{attempt + 1}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                if chosen:
                    raise RunError(f"run folder {path} already exists; a finished or started run is never "
                                   f"overwritten — pick another --run-id or continue it with --resume {path}") from None
            except OSError as exc:
                raise RunError(f"cannot create run folder {path}: {exc.strerror or exc}") from exc
        else:
            raise RunError(f"no free run id under {root / model} after 100 tries")
        run_id = path.name
        run = cls(path)
        run.write_meta({
            "model": card.name,
            "run_id": run_id,
            "created": _dt.datetime.now().isoformat(timespec="seconds"),
            "card_path": str(card.card_path),
            "cwd": str(Path.cwd()),  # where the command ran: reproduce lines are written against it
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
        return _read_json(self.meta_path, "run file")

    def write_meta(self, meta: dict) -> None:
        _atomic_write(self.meta_path, json.dumps(_jsonable(meta), indent=2, sort_keys=False) + "\n")

    def update_stage(self, stage: str, **fields: Any) -> dict:
        meta = self.read_meta()
        entry = meta.setdefault("stages", {}).setdefault(stage, {})
        entry.update(fields)
        self.write_meta(meta)
        return meta

    def record_approval(self, approved_plan: str | None, plan_hash: str, card: str) -> None:
        """``run.json`` ``approval``: the approved hash a stage accepted for the plan ``plan_hash``
        (``approval.check_approval``); ``approval_state`` reads it."""
        meta = self.read_meta()
        meta["approval"] = {"approved_plan": approved_plan, "plan_hash": plan_hash, "card": card}
        self.write_meta(meta)

    def set_status(self, status: str) -> None:
        meta = self.read_meta()
        meta["status"] = status
        self.write_meta(meta)

    @property
    def status(self) -> str:
        return self.read_meta().get("status", "unknown")

    def refuse_finished(self, command: str = "this command") -> None:
        """``RunError`` when the run is finished: a finished run is never written again."""
        if self.read_meta().get("status") == "finished":
            raise RunError(f"{self.path} is a finished run; {command} would overwrite its results — a finished run "
                           f"is never overwritten: start a new run (ditbook run CARD) instead")

    # -- the lock: one writer per run folder ----------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_FILE

    def lock_holder(self) -> int | None:
        """The pid of the live process holding this run's lock, else None."""
        try:
            pid = int(self.lock_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _pid_alive(pid) else None

    def acquire(self, command: str = "ditbook") -> "RunLock":
        """Take the run's lock (a file holding our pid) or raise ``RunError`` naming its holder.
        A lock left by a dead process is taken over. Use as ``with run.acquire(): ...``."""
        return RunLock(self, command)

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

    def write_results(self, stage: str, record) -> Path:
        """Write ``<stage>/results.json`` from the stage's record (``ditbook.records``); a stage
        without a registered record (one a user added) writes its mapping as it is."""
        from .records import RECORDS

        if stage in RECORDS:
            if not isinstance(record, RECORDS[stage]):
                raise TypeError(f"stage '{stage}' writes a {RECORDS[stage].__name__}, not a {type(record).__name__}")
            record = record.to_dict()
        results = _jsonable(record)
        _check_scalars(results)
        path = self.results_path(stage)
        _atomic_write(path, json.dumps(results, indent=2) + "\n")
        return path

    def read_results(self, stage: str):
        """The stage's record read back (``ditbook.records``; ``SchemaVersionError`` for a file of
        another schema version); a stage without a registered record: its mapping."""
        from .records import RECORDS

        path = self.results_path(stage)
        if not path.is_file():
            raise RunError(f"stage '{stage}' has no results in {self.path} — run it first "
                           f"(ditbook run CARD --stages ...,{stage})")
        data = _read_json(path, f"results of stage '{stage}'")
        return RECORDS[stage].from_dict(data, where=str(path)) if stage in RECORDS else data

    def results_or_none(self, stage: str):
        """The stage's record, or None when the stage has written none."""
        return self.read_results(stage) if self.has_results(stage) else None

    def has_results(self, stage: str) -> bool:
        return self.results_path(stage).is_file()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"


class RunLock:
    """``<run>/.lock`` with the holder's pid, created exclusively; reentrant within a process
    (a command that locks and calls another locking step keeps one lock)."""

    _held: dict[str, int] = {}

    def __init__(self, run: RunFolder, command: str):
        self.run = run
        self.command = command
        key = str(run.path)
        if RunLock._held.get(key):
            RunLock._held[key] += 1
            return
        for _ in range(3):
            try:
                fd = os.open(run.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = run.lock_holder()
                if holder is not None and holder != os.getpid():
                    raise RunError(f"{run.path} is being written by process {holder} (lock file {run.lock_path}); "
                                   f"wait for it to end, or stop it — two processes never write one run") from None
                # a stale lock (its process is gone) or an unreadable one: take it over
                try:
                    run.lock_path.unlink()
                except FileNotFoundError:
                    pass
                continue
            except OSError as exc:
                raise RunError(f"cannot lock {run.path}: {exc.strerror or exc}") from exc
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{os.getpid()} {command}\n")
            RunLock._held[key] = 1
            return
        raise RunError(f"could not take the lock {run.lock_path}: another process keeps taking it")

    def release(self) -> None:
        key = str(self.run.path)
        count = RunLock._held.get(key, 0)
        if count > 1:
            RunLock._held[key] = count - 1
            return
        RunLock._held.pop(key, None)
        try:
            if self.run.lock_path.read_text().split()[0] == str(os.getpid()):
                self.run.lock_path.unlink()
        except (OSError, IndexError):
            pass

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def approval_state(meta: dict, plan_hash: str | None) -> dict:
    """Whether the run's plan ``plan_hash`` is approved: ``{ok, approved, plan_hash, source}``.
    The approval a stage accepted (``RunFolder.record_approval``) when one did, else the card
    snapshot the run began with; ``ok`` None when the run made no plan."""
    recorded = meta.get("approval") or {}
    if recorded.get("plan_hash") == plan_hash and recorded.get("approved_plan"):
        approved, source = recorded["approved_plan"], "accepted by the stages"
    else:
        approved, source = (meta.get("card") or {}).get("approved_plan"), "in the card"
    return {"ok": None if not plan_hash else approved == plan_hash, "approved": approved, "plan_hash": plan_hash,
            "source": source}


def latest_run(outputs_root: str | Path, model: str, with_stage: str | None = None) -> RunFolder | None:
    """The newest run folder of a model (optionally one that has results for ``with_stage``)."""
    root = Path(outputs_root) / model
    if not root.is_dir():
        return None
    runs = [RunFolder(p) for p in root.iterdir() if (p / RUN_FILE).is_file()]
    if with_stage:
        runs = [r for r in runs if r.has_results(with_stage)]
    def created(r: RunFolder) -> str:
        try:
            return r.read_meta().get("created", "")
        except RunError:  # an unreadable run.json never hides the other runs
            return ""

    runs.sort(key=lambda r: (created(r), r.path.name))
    return runs[-1] if runs else None
