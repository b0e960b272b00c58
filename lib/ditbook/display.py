"""Small display helpers for notebooks: HTML tables and image grids, no pandas needed."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


def cell_text(v, digits: int = 4) -> str:
    """How a value reads in a table: '-' for missing, yes/no for booleans, short floats."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if v != v else f"{v:.{digits}g}"
    return str(v)


class Table:
    """One table for every view: HTML in a notebook (``_repr_html_``), text on a console
    (``repr``), Markdown for result files (``markdown``); tests read ``rows``."""

    def __init__(self, rows: Sequence[Sequence], headers: Sequence[str], title: str | None = None,
                 max_width: int = 60):
        self.rows = [list(r) for r in rows]
        self.headers = list(headers)
        self.title = title
        self.max_width = max_width

    @classmethod
    def from_dicts(cls, rows: Iterable[dict], columns: Sequence[str] | None = None, title: str | None = None,
                   **kw) -> "Table":
        rows = list(rows)
        columns = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
        return cls([[r.get(c) for c in columns] for r in rows], columns, title, **kw)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>(none)</p>"
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(cell_text(v))}</td>" for v in r) + "</tr>"
                       for r in self.rows)
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f'<table class="ditbook">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    def __repr__(self) -> str:
        if not self.rows:
            return "(none)"
        cells = [[cell_text(v)[: self.max_width] for v in r] for r in self.rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(self.headers)]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
        return "\n".join([line(self.headers), line(["-" * w for w in widths])] + [line(r) for r in cells])

    def markdown(self) -> str:
        if not self.rows:
            return "_(none)_"
        head = "| " + " | ".join(self.headers) + " |"
        sep = "| " + " | ".join("---" for _ in self.headers) + " |"
        body = ["| " + " | ".join(cell_text(v).replace("|", "\\|") for v in r) + " |" for r in self.rows]
        return "\n".join([head, sep, *body])


def show(rows: Iterable[dict] | Table, title: str | None = None) -> None:
    """Display rows as an HTML table in a notebook, or print them as text elsewhere."""
    table = rows if isinstance(rows, Table) else Table.from_dicts(rows, title=title)
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            display(table)
            return
    except ImportError:
        pass
    print(repr(table))


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
