"""Progress on long loops: a live tqdm bar in interactive use, one plain line per item headless,
so papermill outputs hold no stale, half-drawn bars. Two shapes of the same thing: ``progress``
wraps an iterable; ``progress_printer`` is a ``(done, total, item)`` callback for loops that
report themselves (``render_all``)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def _print(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


def progress(items: Iterable[T], interactive: bool, desc: str = "",
             log: Callable[[str], None] | None = None) -> Iterable[T]:
    items = list(items)
    if interactive:
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, leave=False)
    log = log or _print

    def gen():
        for i, item in enumerate(items, 1):
            log(f"{desc} {i}/{len(items)}: {getattr(item, 'name', item)}".strip())
            yield item

    return gen()


def progress_printer(label: str, interactive: bool = False, log: Callable[[str], None] | None = None):
    """A ``progress(done, total, item)`` callback for render loops."""
    start = time.perf_counter()
    bar = None
    log = log or _print

    def report(done: int, total: int, item=None) -> None:
        nonlocal bar
        if interactive:
            if bar is None:
                from tqdm.auto import tqdm

                bar = tqdm(total=total, desc=label, leave=False)
            bar.update(1)
            if done >= total:
                bar.close()
            return
        log(f"{label}: {done}/{total} {getattr(item, 'key', '')} ({time.perf_counter() - start:.1f}s)".rstrip())

    return report


__all__ = ["progress", "progress_printer"]
