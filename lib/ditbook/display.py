"""Small display helpers for notebooks: HTML tables and image grids, no pandas needed."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


class Table:
    """An HTML table that notebooks display and tests can read (``rows``)."""

    def __init__(self, rows: Sequence[Sequence], headers: Sequence[str], title: str | None = None):
        self.rows = [list(r) for r in rows]
        self.headers = list(headers)
        self.title = title

    def _repr_html_(self) -> str:
        def cell(v):
            if isinstance(v, float):
                v = f"{v:.4g}"
            return html.escape(str(v))
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in self.rows)
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f'<table class="ditbook">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    def __repr__(self) -> str:
        widths = [max(len(str(x)) for x in col) for col in zip(self.headers, *self.rows)] if self.rows else [len(h) for h in self.headers]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
        return "\n".join([line(self.headers)] + [line(r) for r in self.rows])


def dict_table(d: dict, title: str | None = None) -> Table:
    return Table([(k, v) for k, v in d.items()], ["item", "value"], title)


def image_grid(images: Iterable[np.ndarray], labels: Iterable[str], cols: int = 4, scale: float = 2.0):
    """A matplotlib figure with the images in a grid, each titled by its label."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    images, labels = list(images), list(labels)
    n = max(len(images), 1)
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(scale * cols, scale * rows + 0.3), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, img, label in zip(axes.flat, images, labels):
        ax.imshow(np.clip(img, 0, 1), interpolation="nearest")
        ax.set_title(label, fontsize=7)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
