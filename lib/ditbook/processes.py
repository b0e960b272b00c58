"""Ending every process a ditbook command started, on Ctrl-C, SIGTERM or SIGHUP, and when it dies.

A stage runs in a Jupyter kernel (papermill), which may start torchrun in a session of its own,
which starts the ranks. A signal to the ``ditbook`` process reaches none of them, so the
command's handler walks its process tree (children by parent pid, which a new session does not
change) and ends each process: SIGTERM first, SIGKILL for those still there after a grace period.
The tree is read before anything is ended, so a rank whose torchrun parent died first is still
found. psutil (a dependency of ipykernel) reads the tree.

A ditbook killed by SIGKILL runs no handler, so the processes it starts in a session of their
own are tied to it by the kernel instead: ``die_with_parent`` (a ``preexec_fn``) asks Linux to
send the child SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``). torchrun's ranks are
torchrun's children, not ours: each rank runs ``watch_parent``, a thread that ends the rank as
soon as its parent (torchrun) is gone, and asks the kernel for SIGKILL on that parent's death.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a closed terminal or ssh sends SIGHUP


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP reached a ditbook command; its processes have been ended."""

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


def _pdeathsig(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the process that
    started it dies, SIGKILL included. A parent already gone between fork and prctl ends the
    child at once."""
    parent = os.getpid()

    def preexec() -> None:
        _pdeathsig(sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


LAUNCHER_ENV = "DITBOOK_LAUNCHER_PID"  # the ditbook process that started torchrun, for its ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_parent(interval: float = 0.5, sig: int = signal.SIGKILL) -> threading.Thread:
    """End this process (``sig``) once its parent is gone, or the ditbook process named by
    ``$DITBOOK_LAUNCHER_PID``: for processes started by a process that is not ours (torchrun's
    ranks), so they never outlive it. The launcher's pid also covers a parent that died before
    this ran (then the parent seen here is already the reaper). The kernel's parent-death
    signal is asked for too."""
    parent = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_ENV, "0") or 0)
    _pdeathsig(sig)

    def poll() -> None:
        while True:
            gone = parent if os.getppid() != parent else launcher if launcher and not _alive(launcher) else None
            if gone:
                sys.stderr.write(f"ditbook: process {os.getpid()}: process {gone}, which started it, is gone; ending\n")
                sys.stderr.flush()
                os.kill(os.getpid(), sig)
            time.sleep(interval)

    t = threading.Thread(target=poll, daemon=True, name="ditbook-parent-watch")
    t.start()
    return t


class TimeLimitExceeded(TimeoutError):
    """Code run under ``time_limit`` did not finish in time."""


class time_limit:
    """Raise ``TimeLimitExceeded(message)`` in the calling thread when the block runs longer than
    ``seconds``: SIGALRM in the main thread (it also breaks a blocking sleep or read), an
    asynchronous exception elsewhere (at the next bytecode). The previous alarm is restored."""

    def __init__(self, seconds: float, message: str):
        self.seconds, self.message = float(seconds), message
        self._timer = self._old = None

    def _raise(self, *_):
        raise TimeLimitExceeded(self.message)

    def __enter__(self):
        if self.seconds <= 0:
            return self
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            self._old = (signal.signal(signal.SIGALRM, self._raise), signal.setitimer(signal.ITIMER_REAL, self.seconds))
        else:
            tid = threading.get_ident()
            exc = type("TimeLimit", (TimeLimitExceeded,), {"__init__": lambda e: TimeLimitExceeded.__init__(e, self.message)})
            self._timer = threading.Timer(self.seconds, lambda: ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(tid), ctypes.py_object(exc)))
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            handler, (delay, interval) = self._old
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, handler)
            if delay:
                signal.setitimer(signal.ITIMER_REAL, delay, interval)
        if self._timer is not None:
            self._timer.cancel()
        return False


_received: list[str] = []


def received() -> str | None:
    """The name of the signal the active handler caught (SIGINT/SIGTERM/SIGHUP), else None."""
    return _received[-1] if _received else None


class signals_end_children:
    """While active, SIGINT, SIGTERM and SIGHUP end every descendant process and then raise
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
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
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


__all__ = ["TimeLimitExceeded", "time_limit", "Interrupted", "die_with_parent", "watch_parent", "HANDLED", "descendants", "end_processes", "end_descendants", "signals_end_children", "received"]
