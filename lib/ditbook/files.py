"""Writing a file so that a reader sees the old text or the new, never half of it.

``atomic_write_text`` writes a hidden temporary file beside the target and renames it over the
target. A failed write (a full disk, an interrupt) removes the temporary file, so nothing is
left behind. The file gets the mode a plain ``open(..., "w")`` would give it (0666 less the
umask, 0644 usually) — or the mode of the file it replaces — so every file of a run reads
alike (``tempfile.mkstemp`` alone makes 0600 files).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


__all__ = ["atomic_write_text"]
