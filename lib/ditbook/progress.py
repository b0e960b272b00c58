"""Progress on long loops: a live bar in interactive use, one plain line per step headless, so
papermill outputs hold no stale bars."""

from __future__ import annotations

import sys
import time


def progress_printer(label: str, interactive: bool = False):
    """A ``progress(done, total, item)`` callback for render loops."""
    start = time.perf_counter()
    bar = None

    def progress(done: int, total: int, item=None) -> None:
        nonlocal bar
        if interactive:
            if bar is None:
                from tqdm.auto import tqdm

                bar = tqdm(total=total, desc=label)
            bar.update(1)
            if done >= total:
                bar.close()
            return
        elapsed = time.perf_counter() - start
        key = getattr(item, "key", "")
        print(f"{label}: {done}/{total} {key} ({elapsed:.1f}s)", file=sys.stdout, flush=True)

    return progress
