"""Progress for long loops: a tqdm bar in interactive use, one plain log line per item otherwise
(papermill outputs keep no half-drawn bars)."""

from __future__ import annotations

import sys
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], interactive: bool, desc: str = "",
             log: Callable[[str], None] | None = None) -> Iterable[T]:
    items = list(items)
    if interactive:
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, leave=False)
    log = log or (lambda msg: print(msg, file=sys.stdout, flush=True))

    def gen():
        for i, item in enumerate(items, 1):
            log(f"{desc} {i}/{len(items)}: {getattr(item, 'name', item)}".strip())
            yield item

    return gen()


__all__ = ["progress"]
