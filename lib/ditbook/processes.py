"""Ending every process a ditbook command started, on Ctrl-C or SIGTERM.

A stage runs in a Jupyter kernel (papermill), which may start torchrun in a session of its own,
which starts the ranks. A signal to the ``ditbook`` process reaches none of them, so the
command's handler walks its process tree (children by parent pid, which a new session does not
change) and ends each process: SIGTERM first, SIGKILL for those still there after a grace period.
The tree is read before anything is ended, so a rank whose torchrun parent died first is still
found. psutil (a dependency of ipykernel) reads the tree.
"""

from __future__ import annotations

import os
import signal


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM reached a ditbook command; its processes have been ended."""

    def __init__(self, signame: str = "SIGINT", message: str = ""):
        super().__init__(message or signame)
        self.signame = signame
        self.message = message


def descendants(pid: int | None = None) -> list:
    """Every live process below ``pid`` (default: this one), as psutil processes."""
    import psutil

    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def end_processes(procs: list, grace: float = 5.0) -> list[int]:
    """SIGTERM each process, SIGKILL those left after ``grace`` seconds; returns the pids ended."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return [p.pid for p in procs]


def end_descendants(grace: float = 5.0) -> list[int]:
    """End every process this process started, and theirs."""
    return end_processes(descendants(), grace)


_received: list[str] = []


def received() -> str | None:
    """The name of the signal the active handler caught (SIGINT/SIGTERM), else None."""
    return _received[-1] if _received else None


class signals_end_children:
    """While active, SIGINT and SIGTERM end every descendant process and then raise
    ``Interrupted`` in the main thread. Only installs in the main thread; restores the previous
    handlers on exit."""

    def __init__(self, grace: float = 5.0):
        self.grace = grace
        self.previous: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        _received.append(name)
        # ignore a second signal while ending the children, then re-raise as Interrupted
        for sig in self.previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            end_descendants(self.grace)
        finally:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
        raise Interrupted(name)

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        _received.clear()
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}
        _received.clear()
        return False


__all__ = ["Interrupted", "descendants", "end_processes", "end_descendants", "signals_end_children", "received"]
