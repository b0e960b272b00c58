"""What a stage notebook opens first: its card, its run folder, its own output folder.

A notebook's parameters cell sets ``CARD``, ``RUN_DIR``, ``OVERRIDES`` and ``INTERACTIVE``;
``open_stage`` turns them into a ``StageContext``. Run interactively without ``RUN_DIR``, it
starts a fresh run folder so nothing earlier is overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .card import ModelCard, gate_check
from .approval import ApprovalError, check_approval  # noqa: F401 (ApprovalError: re-exported)
from .loading import Placement, choose_placement
from .runs import RunError, RunFolder


@dataclass
class StageContext:
    card: ModelCard
    run: RunFolder
    stage: str
    placement: Placement
    overrides: dict

    @property
    def dir(self) -> Path:
        return self.run.stage_dir(self.stage)

    def results(self, stage: str):
        """Another stage's record (``ditbook.records``)."""
        return self.run.read_results(stage)

    def write_results(self, record) -> Path:
        """This stage's record as its ``results.json``."""
        return self.run.write_results(self.stage, record)

    def load_pipeline(self, **kwargs):
        from .loading import load_pipeline

        return load_pipeline(self.card, self.placement, **kwargs)

    def baseline(self) -> dict:
        """The intake stage's baseline images, key -> float array."""
        from .render import load_images

        return load_images(self.run.stage_dir("intake"), self.run.read_results("intake").images)

    def require_approved_plan(self) -> dict:
        """The approved integration plan, or ``ApprovalError`` naming the command to approve."""
        return check_approval(self.card, self.run)


def _refuse_foreign_lock(run: RunFolder) -> None:
    """A stage may write a locked run only on behalf of the lock's holder (the runner that
    started this kernel, or this process itself)."""
    import os

    holder = run.lock_holder()
    if holder is None or holder == os.getpid():
        return
    try:
        import psutil

        ancestors = {p.pid for p in psutil.Process().parents()}
    except Exception:  # no process table to read: trust the lock file alone
        ancestors = set()
    if holder not in ancestors:
        raise RunError(f"{run.path} is being written by process {holder} (lock file {run.lock_path}); "
                       f"two processes never write one run")


def run_overrides(run: RunFolder, given: dict | None, command: str) -> dict:
    """The overrides a command writing into ``run`` runs with: the run's own (``run.json``), and
    the command's ``-p`` where they add a key. A ``-p`` that changes one of the run's values is
    refused: the run's baseline was made with the run's value."""
    own = run.read_meta().get("overrides") or {}
    from .card import override_key

    own = {override_key(k): v for k, v in own.items()}
    given = {override_key(k): v for k, v in (given or {}).items()}
    clash = [f"{k}={given[k]!r} (the run has {own[k]!r})" for k in given if k in own and given[k] != own[k]]
    if clash:
        raise RunError(f"{command}: {run.path} was made with other overrides: {', '.join(clash)}; its results "
                       f"hold for the run's own values — drop the -p, or start a new run")
    return {**own, **given}


def open_run_for(command: str, run: RunFolder, card_path: str, overrides: dict | None = None,
                 approval: bool = True) -> tuple[ModelCard, dict]:
    """What every command that writes into an existing run checks first (the same as a stage
    of that run): the run exists and is not finished, it is this card's model's, the run's
    own overrides apply, the card passes its gate with them, and (``approval``) its approved
    plan is the run's, with the same weights and gates no looser. Returns the card and the
    overrides to run with."""
    if not run.exists():
        raise RunError(f"{run.path} is not a run folder (it has no run.json)")
    run.refuse_finished(command)
    overrides = run_overrides(run, overrides, command)
    from .preflight import start_check

    card = start_check(card_path, overrides)
    model = run.read_meta().get("model")
    if model is not None and model != card.name:
        raise RunError(f"{command}: {run.path} is a run of model {model!r}, the card {card_path} is {card.name!r}")
    if approval:
        try:
            check_approval(card, run)
        except ApprovalError as exc:
            raise RunError(f"{command}: {exc}") from None
    return card, overrides


def project_root(start: str | Path | None = None) -> Path:
    """The folder a notebook's relative paths are written from: the nearest folder, from
    ``start`` (the current directory) up, that holds a ``.git`` (a checkout's root); ``start``
    itself outside a checkout. JupyterLab starts a notebook's kernel in the notebook's own folder
    (``notebooks/``), while ``models/...`` and ``outputs/`` are the root's."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return folder
    return here


def resolve_from_root(path: str | Path, start: str | Path | None = None) -> Path:
    """``path`` as given when it exists (or is absolute); else, relative, the first folder from
    ``start`` up to :func:`project_root` where it exists (``models/reference.yaml`` typed in a
    notebook opened from ``notebooks/``); else unchanged, for the caller's own error."""
    given = Path(path)
    if given.is_absolute() or given.exists():
        return given
    here = Path(start or Path.cwd()).resolve()
    root = project_root(here)
    for folder in (here, *here.parents):
        if (folder / given).exists():
            return folder / given
        if folder == root:
            break
    return given


def open_stage(card_path: str, run_dir: str | None, stage: str, overrides: dict | None = None,
               outputs_root: str | Path | None = None) -> StageContext:
    """The stage's context from a notebook's parameters: ``CARD`` and ``RUN_DIR`` relative to the
    current directory or, in a notebook started from ``notebooks/``, to the project's root
    (:func:`resolve_from_root`); without ``RUN_DIR`` a new run under ``$DITBOOK_OUTPUTS``, else
    under the project root's ``outputs/`` (git-ignored there), never ``notebooks/outputs``."""
    import os

    overrides = dict(overrides or {})
    card_path = str(resolve_from_root(card_path)) if card_path else card_path
    card = gate_check(card_path, overrides)
    if run_dir:
        run_dir = str(resolve_from_root(run_dir))
    if not run_dir and outputs_root is None and not os.environ.get("DITBOOK_OUTPUTS"):
        outputs_root = project_root() / "outputs"
    if run_dir:
        run = RunFolder(run_dir)
        if not run.exists():
            raise RunError(f"RUN_DIR {run_dir} is not a run folder")
        run.refuse_finished(f"the {stage} stage")
        _refuse_foreign_lock(run)
    else:
        from .runs import outputs_dir

        run = RunFolder.create(card, outputs_root or outputs_dir(), overrides=overrides)
    return StageContext(card=card, run=run, stage=stage, placement=choose_placement(card), overrides=overrides)
