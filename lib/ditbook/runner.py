"""Executing the stage notebooks with papermill, in order, into one run folder.

Stages are discovered from ``notebooks/NN_<stage>.ipynb``: a later stage joins by adding a
notebook. A failing stage keeps its executed notebook (with the error), marks ``run.json``
failed with the failing cell, and leaves the earlier stages' results in place.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .card import GateError, ModelCard
from .kernels import KERNEL_LOG_ENV, KernelAhead, ahead_depth, kernel_config, settle_abandoned_tasks, start_ahead
from .preflight import start_check
from .processes import Interrupted, end_descendants, received
from .runs import RunError, RunFolder, outputs_dir  # noqa: F401 (outputs_dir: where runs go, in runs)

PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent.parent
_STAGE_RE = re.compile(r"^(\d+)_([a-z0-9_]+)\.ipynb$")


def notebooks_dir() -> Path:
    """``$DITBOOK_NOTEBOOKS``, else the stage notebooks shipped in the package (``ditbook/notebooks``:
    in a checkout a link to ``notebooks/``, in an installed wheel a copy)."""
    env = os.environ.get("DITBOOK_NOTEBOOKS")
    if env:
        return Path(env)
    shipped = PACKAGE_ROOT / "notebooks"
    return shipped if shipped.is_dir() else REPO_ROOT / "notebooks"


@dataclass
class Stage:
    order: int
    name: str
    notebook: Path


def discover_stages(folder: Path | None = None) -> list[Stage]:
    folder = Path(folder or notebooks_dir())
    stages = []
    for p in sorted(folder.glob("*.ipynb")):
        m = _STAGE_RE.match(p.name)
        if m:
            stages.append(Stage(int(m.group(1)), m.group(2), p))
    stages.sort(key=lambda s: s.order)
    return stages


def select_stages(names: list[str] | None, folder: Path | None = None) -> list[Stage]:
    stages = discover_stages(folder)
    if not names:
        return stages
    by_name = {s.name: s for s in stages}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise RunError(f"unknown stage(s) {unknown}; stages in {folder or notebooks_dir()}: {list(by_name)}")
    return [s for s in stages if s.name in names]


@dataclass
class StageOutcome:
    stage: str
    status: str  # passed | failed | skipped
    seconds: float = 0.0
    error: str | None = None
    failing_cell: str | None = None

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass
class RunOutcome:
    run: RunFolder
    stages: list[StageOutcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.status != "failed" for s in self.stages)

    @property
    def failure(self) -> StageOutcome | None:
        return next((s for s in self.stages if s.status == "failed"), None)


def _failure_details(exc: BaseException) -> tuple[str, str | None]:
    """The error line and the failing cell's source, from a papermill execution error."""
    ename = getattr(exc, "ename", None)
    if ename:
        evalue = getattr(exc, "evalue", "")
        cell = getattr(exc, "source", None)
        exec_count = getattr(exc, "exec_count", None)
        label = f"cell [{exec_count}]" if exec_count else "cell"
        return f"{ename}: {evalue}", f"{label}:\n{cell}" if cell else None
    return f"{type(exc).__name__}: {exc}", None


@contextmanager
def kernel_environment():
    """The stage kernel's settings when papermill starts it: quiet library loggers
    (``kernels.KERNEL_LOG_ENV``, values the user set win) and IPC transport in a private temporary
    folder (``kernels.kernel_config``), removed however the stage ends."""
    saved = {k: os.environ.get(k) for k in KERNEL_LOG_ENV}
    for k, v in KERNEL_LOG_ENV.items():
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="ditbook-kernel-") as sockets:
        try:
            yield kernel_config(sockets)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# a kernel started ahead may still be importing when its stage begins: wait for it this long
AHEAD_START_TIMEOUT = 900


def _papermill(stage: Stage, run: RunFolder, card: ModelCard, overrides: dict, kernel_name: str | None,
               ahead: KernelAhead | None) -> None:
    import papermill as pm

    given = {"km": ahead.km, "start_timeout": AHEAD_START_TIMEOUT} if ahead is not None else {}
    with kernel_environment() as config:
        pm.execute_notebook(
            str(stage.notebook), str(run.path / stage.notebook.name),
            parameters={"CARD": str(card.card_path), "RUN_DIR": str(run.path), "OVERRIDES": overrides,
                        "INTERACTIVE": False},
            kernel_name=kernel_name, cwd=str(run.path), log_output=False,
            # cell n of m on stderr while the stage runs; the bar is removed when it ends
            progress_bar={"desc": f"[{stage.order:02d} {stage.name}]", "leave": False, "file": sys.stderr},
            request_save_on_cell_execute=True, config=config, **given,
        )


def _usable(ahead: KernelAhead | None, run: RunFolder) -> KernelAhead | None:
    """The kernel started ahead if it is still alive and works in the run folder (one that died at
    start-up, or could not be moved into the run folder, is dropped, and papermill starts a kernel of
    its own)."""
    if ahead is None:
        return None
    from jupyter_core.utils import run_sync

    try:
        if run_sync(ahead.km.is_alive)() and ahead.enter(run.path):
            ahead.used = True
            return ahead
    except Exception:
        pass
    ahead.close()
    return None


def execute_stage(stage: Stage, run: RunFolder, card: ModelCard, overrides: dict, *,
                  kernel_name: str | None = None, log: Callable[[str], None] = print,
                  ahead: KernelAhead | None = None) -> StageOutcome:
    """Run one stage notebook; ``ahead``: its kernel, started while the stage before it ran
    (``kernels.KernelAhead``; shut down here when the stage ends)."""
    out_nb = run.path / stage.notebook.name
    run.update_stage(stage.name, status="running", notebook=out_nb.name, started=time.time())
    start = time.perf_counter()
    ahead = _usable(ahead, run)
    try:
        _papermill(stage, run, card, overrides, kernel_name, ahead)
    except BaseException as exc:  # papermill raises PapermillExecutionError; anything else is recorded too
        seconds = time.perf_counter() - start
        signame = received()
        if isinstance(exc, KeyboardInterrupt) or signame:
            # Ctrl-C or SIGTERM: the command's handler has ended the kernel and what it started
            # (torchrun, ranks); without that handler (library use) end them here
            signame = signame or getattr(exc, "signame", None) or "SIGINT"
            if received() is None:
                end_descendants()
            settle_abandoned_tasks()
            run.update_stage(stage.name, status="interrupted", seconds=round(seconds, 2),
                             error=f"interrupted by {signame}", failing_cell=None)
            run.set_status("interrupted")
            raise Interrupted(signame, f"stage '{stage.name}' interrupted by {signame}; {run.path} is marked "
                                       f"interrupted — continue it with: ditbook run --resume {run.path}") from None
        if not isinstance(exc, Exception):
            raise
        error, cell = _failure_details(exc)
        run.update_stage(stage.name, status="failed", seconds=round(seconds, 2), error=error, failing_cell=cell,
                         traceback=traceback.format_exception_only(type(exc), exc)[-1].strip())
        return StageOutcome(stage.name, "failed", seconds, error, cell)
    finally:
        if ahead is not None:
            ahead.close()
    seconds = time.perf_counter() - start
    run.update_stage(stage.name, status="passed", seconds=round(seconds, 2), error=None, failing_cell=None)
    return StageOutcome(stage.name, "passed", seconds)


def write_report(run: RunFolder, log: Callable[[str], None] = print) -> None:
    """result.md and report.html after every run, a failed one included (the failure is in them)."""
    try:
        from .benchmark.report import rebuild

        md, html = rebuild(run.path, figures=False)
        log(f"report: {html}")
    except Exception as exc:  # the report must never hide the run's own outcome
        log(f"report could not be written: {type(exc).__name__}: {exc}")


def run_stages(run: RunFolder, card: ModelCard, stages: list[Stage], overrides: dict, *,
               kernel_name: str | None = None, log: Callable[[str], None] = print,
               ahead: KernelAhead | None = None) -> RunOutcome:
    """``ahead``: the first stage's kernel, started while the command checked the card."""
    outcome = _run_stages(run, card, stages, overrides, kernel_name=kernel_name, log=log, ahead=ahead)
    write_report(run, log)
    return outcome


def _run_stages(run: RunFolder, card: ModelCard, stages: list[Stage], overrides: dict, *,
                kernel_name: str | None = None, log: Callable[[str], None] = print,
                ahead: KernelAhead | None = None) -> RunOutcome:
    outcome = RunOutcome(run)
    # each stage's kernel, started ahead (None: its start failed, papermill starts one at its turn)
    kernels: dict[str, KernelAhead | None] = {stages[0].name: ahead} if stages and ahead is not None else {}
    try:
        depth = ahead_depth()
        run.set_status("running")
        for i, stage in enumerate(stages):
            log(f"[{stage.order:02d} {stage.name}] running ...")
            for later in stages[i + 1: i + 1 + depth]:
                if later.name not in kernels:
                    kernels[later.name] = start_ahead(later, run.path, card, kernel_name, log)
            res = execute_stage(stage, run, card, overrides, kernel_name=kernel_name, log=log,
                                ahead=kernels.pop(stage.name, None))
            outcome.stages.append(res)
            if not _stage_went_on(res, stage, run, log):
                return outcome
    finally:
        for unused in kernels.values():  # a stage before them failed or was interrupted: not needed
            if unused is not None:
                unused.close()
    meta = run.read_meta()
    all_stage_names = [s.name for s in discover_stages(stages[0].notebook.parent)] if stages else []
    done = {k for k, v in meta.get("stages", {}).items() if v.get("status") == "passed"}
    run.set_status("finished" if set(all_stage_names) <= done else "partial")
    return outcome


def _stage_went_on(res: StageOutcome, stage: Stage, run: RunFolder, log: Callable[[str], None]) -> bool:
    """Log a stage's end; False (and the run marked failed) when it failed."""
    if res.status == "failed":
        log(f"[{stage.order:02d} {stage.name}] FAILED after {res.seconds:.1f}s: {res.error}")
        if res.failing_cell:
            log("  failing " + res.failing_cell.replace("\n", "\n    "))
        log(f"  executed notebook kept at {run.path / stage.notebook.name}")
        run.set_status("failed")
        return False
    log(f"[{stage.order:02d} {stage.name}] passed in {res.seconds:.1f}s")
    return True


def start_run(card_path: str | Path, *, stages: list[str] | None = None, overrides: dict | None = None,
              run_id: str | None = None, outputs_root: Path | None = None, kernel_name: str | None = None,
              log: Callable[[str], None] = print) -> RunOutcome:
    """Gate-check the card, create a new run folder, and execute the chosen stages."""
    overrides = dict(overrides or {})
    chosen = select_stages(stages)
    ahead = _first_kernel(chosen, card_path, overrides, None, kernel_name, log)
    try:
        card = start_check(card_path, overrides)
        if not chosen:
            raise RunError(f"no stage notebooks found in {notebooks_dir()}")
        run = RunFolder.create(card, outputs_root or outputs_dir(), run_id, overrides)
        with run.acquire("ditbook run"):
            meta = run.read_meta()
            meta["requested_stages"] = [s.name for s in chosen]
            run.write_meta(meta)
            log(f"run folder: {run.path}")
            given, ahead = ahead, None
            return run_stages(run, card, chosen, overrides, kernel_name=kernel_name, log=log, ahead=given)
    finally:
        if ahead is not None:  # refused before its stage: not needed
            ahead.close()


def _first_kernel(stages: list[Stage], card_path, overrides: dict, run_path: Path | None, kernel_name: str | None,
                  log: Callable[[str], None]) -> KernelAhead | None:
    """The first stage's kernel, started before the command's own start check (which imports the
    pipeline's libraries too), so the two imports overlap; None when turned off, when there is no
    stage, or when the card does not even load (the start check then says why)."""
    from .card import load_card
    from .kernels import ahead_enabled

    if not stages or not ahead_enabled():
        return None
    try:
        card = load_card(card_path, overrides)
    except Exception:  # the start check reports it
        return None
    return start_ahead(stages[0], run_path, card, kernel_name, log)


def resume_run(run_dir: str | Path, *, kernel_name: str | None = None, log: Callable[[str], None] = print) -> RunOutcome:
    """Continue a run from its first unfinished stage, if its card is unchanged."""
    run = RunFolder(run_dir)
    run.refuse_finished("--resume")
    with run.acquire("ditbook run --resume"):
        return _resume(run, kernel_name=kernel_name, log=log)


def _resume(run: RunFolder, *, kernel_name: str | None, log: Callable[[str], None]) -> RunOutcome:
    meta = run.read_meta()
    if meta.get("status") == "finished":  # finished by another process before the lock was ours
        raise RunError(f"{run.path} is finished; a finished run is never overwritten — start a new run")
    if "card_path" not in meta:
        raise RunError(f"{run.meta_path} has no 'card_path'; it is not a run ditbook can resume")
    overrides = meta.get("overrides") or {}
    stages = discover_stages()
    done = {k for k, v in meta.get("stages", {}).items() if v.get("status") == "passed"}
    requested = meta.get("requested_stages") or [s.name for s in stages]
    todo = [s for s in stages if s.name in requested and s.name not in done]
    ahead = _first_kernel(todo, meta["card_path"], overrides, run.path, kernel_name, log)
    try:
        card = start_check(meta["card_path"], overrides)
        if card.content_hash() != meta.get("card_hash"):
            raise RunError(
                f"card {meta['card_path']} changed since {run.path} started (hash {meta.get('card_hash')} -> "
                f"{card.content_hash()}); a resumed run must use the same card — start a new run instead"
            )
        if not todo:
            raise RunError(f"{run.path}: every requested stage already passed")
        log(f"resuming {run.path} at stage '{todo[0].name}'")
        given, ahead = ahead, None
        return run_stages(run, card, todo, overrides, kernel_name=kernel_name, log=log, ahead=given)
    finally:
        if ahead is not None:
            ahead.close()


@dataclass
class BatchRow:
    model: str
    card: str
    passed: list[str]
    failure: str | None
    run_dir: str | None


def run_batch(card_paths: list[str | Path], *, stages: list[str] | None = None, overrides: dict | None = None,
              outputs_root: Path | None = None, kernel_name: str | None = None,
              log: Callable[[str], None] = print) -> list[BatchRow]:
    """Run several models one after another, going on past failures."""
    rows = []
    for path in card_paths:
        log(f"=== {path}")
        try:
            outcome = start_run(path, stages=stages, overrides=overrides, outputs_root=outputs_root,
                                kernel_name=kernel_name, log=log)
        except GateError as exc:
            log(str(exc))
            rows.append(BatchRow(Path(path).stem, str(path), [], "gate: " + "; ".join(exc.problems), None))
            continue
        except (RunError, OSError) as exc:
            log(str(exc))
            rows.append(BatchRow(Path(path).stem, str(path), [], str(exc).splitlines()[0], None))
            continue
        fail = outcome.failure
        rows.append(BatchRow(
            outcome.run.read_meta().get("model", Path(path).stem), str(path),
            [s.stage for s in outcome.stages if s.status == "passed"],
            f"{fail.stage}: {fail.error}" if fail else None, str(outcome.run.path),
        ))
    return rows


def format_batch_table(rows: list[BatchRow]) -> str:
    head = ["model", "stages passed", "failure"]
    body = [[r.model, ",".join(r.passed) or "-", (r.failure or "-")[:100]] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])
