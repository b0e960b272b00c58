"""The stage kernels: their settings, and the next stage's kernel started ahead.

Every stage notebook runs in a fresh Jupyter kernel whose first cell imports torch, diffusers,
the card's pipeline class (and through it transformers) and the stage's package: 15-20 s of every
stage on an H200 host, the same on a small model as on a 12B one (``docs/gpu.md``). While one stage
runs, the runner starts the kernels of the next stages (``KernelAhead``), which do those imports at
their start-up (ipykernel's ``exec_lines``, before they answer any request), so each notebook finds
them done. The kernel is the one papermill would have started (same kernel name, working folder,
settings and environment); its notebook's cells are unchanged, and whatever the start-up prints
goes to no cell.

How far ahead: ``DITBOOK_KERNEL_AHEAD`` = the number of stages whose kernels are started ahead of
the one running (default 2: a stage shorter than a kernel's start-up, like the parallel stage on
one GPU, would otherwise leave the stage after it waiting); ``0`` (or ``off``) turns it off. Each
kernel ahead holds its imports and, on a GPU, a CUDA context (a few hundred MB of device memory).

A kernel started ahead and not used (the stage before it failed, or was interrupted) is shut
down; nothing of it stays behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Library loggers that would write into every executed notebook: a stage kernel starts them at
# ERROR unless the user set them (cache-dit and transformers read these at import).
KERNEL_LOG_ENV = {"CACHE_DIT_LOG_LEVEL": "error", "TRANSFORMERS_VERBOSITY": "error"}
AHEAD_ENV = "DITBOOK_KERNEL_AHEAD"
# nbclient's own start-up argument (a notebook run keeps no IPython history file)
HISTORY_ARG = "--HistoryManager.hist_file=:memory:"


def kernel_config(sockets: str):
    """IPC transport in a private folder: the kernel runs on this machine, so its sockets need no
    TCP port (and ipykernel has no unencrypted-TCP warning to print); its connection file lies
    there too, so nothing of the kernel is left behind after an interrupt."""
    from traitlets.config import Config

    return Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "kernel"),
                                     "connection_file": os.path.join(sockets, "kernel.json")}})


def kernel_env() -> dict:
    """The kernel's environment: this process's, with the quiet loggers where the user set none."""
    return {**KERNEL_LOG_ENV, **os.environ}


AHEAD_DEFAULT = 2


def ahead_depth() -> int:
    """How many stages' kernels run ahead of the current one (``DITBOOK_KERNEL_AHEAD``: a count,
    or off / on)."""
    raw = os.environ.get(AHEAD_ENV, "").strip().lower()
    if raw in ("", "on", "true", "yes"):
        return AHEAD_DEFAULT
    if raw in ("off", "false", "no"):
        return 0
    try:
        return max(0, int(raw))
    except ValueError:
        from .runs import RunError

        raise RunError(f"{AHEAD_ENV}={raw!r}: give a number of stages (0 turns it off), or on / off") from None


def ahead_enabled() -> bool:
    return ahead_depth() > 0


def notebook_kernel_name(notebook: Path) -> str | None:
    try:
        return (json.loads(Path(notebook).read_text()).get("metadata", {}).get("kernelspec") or {}).get("name")
    except (OSError, ValueError):
        return None


def warm_line(stage: str, card) -> str:
    """The kernel's ``exec_lines`` entry: the imports the stage's notebook starts with — its stage
    package, when it is one of ditbook's, and the card's pipeline class, when it comes from a package
    (a third-party file is imported by the stage's own gate check, as always). One statement of
    expressions ending in ``;``: no name is left in the notebook's namespace and nothing is shown;
    a failure is only printed by the kernel at start-up, and the notebook meets and reports it.
    Last, the card's device is started (``loading.warm_device``: CUDA's context, cuBLAS and the
    attention kernels' libraries; nothing on a CPU), which a fresh process otherwise pays at its
    first GPU call inside the stage."""
    parts = []
    if (Path(__file__).resolve().parent / stage / "stage.py").is_file():
        parts.append(f"__import__({f'ditbook.{stage}.stage'!r})")
    source = card.resolve_source(card.pipeline.source) if card.pipeline.source else None
    if source and card.pipeline.cls and not source.endswith(".py"):
        parts.append(f"getattr(__import__({source!r}, fromlist=['_']), {card.pipeline.cls!r}, None)")
    device = getattr(getattr(card, "runtime", None), "device", None) or "auto"
    parts.append(f"__import__('ditbook.loading', fromlist=['_']).warm_device({device!r})")
    return "; ".join(parts) + ";"


class KernelAhead:
    """A stage's kernel, started before its turn, doing the stage's imports at start-up."""

    def __init__(self, stage, run_path: Path | None, card, kernel_name: str | None = None):
        """``run_path`` None: the run folder does not exist yet (the first stage's kernel, started
        while the command checks the card); the kernel starts in its private folder and is moved
        into the run folder by :meth:`enter` before its notebook runs."""
        from jupyter_client.manager import AsyncKernelManager
        from jupyter_core.utils import run_sync

        self.stage = stage.name
        self.sockets = tempfile.mkdtemp(prefix="ditbook-kernel-")
        self.moved = run_path is not None
        self.used = False  # handed to its stage's papermill run (runner._usable)
        name = kernel_name or notebook_kernel_name(stage.notebook)
        kw = {"kernel_name": name} if name else {}
        self.km = AsyncKernelManager(config=kernel_config(self.sockets), **kw)
        try:
            run_sync(self.km.start_kernel)(cwd=str(run_path or self.sockets), env=kernel_env(),
                                           extra_arguments=[HISTORY_ARG, f"--IPKernelApp.exec_lines={warm_line(stage.name, card)}"])
        except BaseException:
            shutil.rmtree(self.sockets, ignore_errors=True)
            raise

    def enter(self, run_path: Path, timeout: float = 900) -> bool:
        """Make ``run_path`` the kernel's working folder (one silent request, nothing stored in the
        notebook's history or namespace), after its start-up imports; False if it did not answer."""
        from jupyter_core.utils import run_sync

        if self.moved:
            return True
        kc = self.km.client()
        kc.start_channels()
        try:
            run_sync(kc.wait_for_ready)(timeout=timeout)
            reply = run_sync(kc.execute_interactive)(f"__import__('os').chdir({str(run_path)!r})", silent=True,
                                                     store_history=False, timeout=60, output_hook=lambda msg: None)
            self.moved = reply.get("content", {}).get("status") == "ok"
        except Exception:  # not answering: papermill starts its own kernel instead
            self.moved = False
        finally:
            kc.stop_channels()
        return self.moved

    def close(self) -> None:
        """Shut the kernel down (politely after its stage ran, at once when it never ran one: it may
        still be importing) and remove its sockets folder."""
        from jupyter_core.utils import run_sync

        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        try:
            if run_sync(self.km.is_alive)():
                run_sync(self.km.shutdown_kernel)(now=not self.used)
            run_sync(self.km.cleanup_resources)()
        except Exception:  # already gone, or the manager failed: the process is ended below
            pass
        finally:
            if process is not None and process.poll() is None:  # whatever the manager did, it goes
                process.kill()
                process.wait(10)
            shutil.rmtree(self.sockets, ignore_errors=True)


def settle_abandoned_tasks() -> None:
    """Cancel and collect what an interrupted stage left pending on this thread's event loop.

    papermill runs the notebook inside jupyter_core's per-thread loop; a signal raised there leaves
    nbclient's cell task pending. The next call on that loop (shutting a kernel down) resumes it, it
    meets the dead kernel, and its ``DeadKernelError`` is printed at exit as never retrieved. Cancelled
    and gathered here, before anything else runs on the loop, no task is left to report."""
    import asyncio

    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop()
    if loop.is_running():
        return
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def start_ahead(stage, run_path: Path, card, kernel_name: str | None = None, log=None) -> KernelAhead | None:
    """The next stage's kernel, or None (turned off, or it could not start: papermill then starts
    one itself, as without this)."""
    if stage is None or not ahead_enabled():
        return None
    try:
        return KernelAhead(stage, run_path, card, kernel_name)
    except Exception as exc:  # no kernel ahead is a slower stage, never a failed one
        if log is not None:
            log(f"  (the {stage.name} stage's kernel could not be started ahead: {type(exc).__name__}: {exc})")
        return None
