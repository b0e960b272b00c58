"""Where a run's time went, cell by cell: papermill records each executed cell's duration in the
notebook it keeps in the run folder (``<run>/NN_<stage>.ipynb``, ``metadata.papermill.duration``).

    python benchmarks/cell_times.py outputs/reference/<run-id> [--min 0.5] [--json]

Prints per stage the notebook's whole time, the sum of its cells, the wait for the kernel before the
first cell (its start-up imports, when they were not done ahead) and the kernel's shut-down after the
last cell (from the cells' start and end stamps), and each cell at or above ``--min`` seconds with
its first code line.
``benchmarks/gpu_check.py`` keeps the same breakdown in its record (``cells``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path


def _first_line(source) -> str:
    text = "".join(source) if isinstance(source, list) else str(source)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line[:100]
    return text.strip().splitlines()[0][:100] if text.strip() else ""


def _stamp(meta: dict, key: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(meta[key]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def _gap(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 2)


def stage_cells(notebook: Path, min_seconds: float = 0.5) -> dict:
    """One executed notebook: its papermill duration, the cells' sum, the seconds from the notebook's
    start to its first cell's (``kernel_wait_s``: the kernel's start-up) and from the last cell's end
    to the notebook's (``shutdown_s``), and the cells at or above ``min_seconds`` (index, seconds,
    first code line), slowest first."""
    nb = json.loads(notebook.read_text())
    cells = []
    total = 0.0
    first = last = None
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        pm = (cell.get("metadata") or {}).get("papermill") or {}
        d = pm.get("duration")
        if d is None:
            continue
        first = first if first is not None else _stamp(pm, "start_time")
        last = _stamp(pm, "end_time") or last
        total += float(d)
        if float(d) >= min_seconds:
            cells.append({"cell": i, "seconds": round(float(d), 2), "code": _first_line(cell.get("source", ""))})
    cells.sort(key=lambda c: -c["seconds"])
    meta = (nb.get("metadata") or {}).get("papermill") or {}
    nb_d = meta.get("duration")
    return {"notebook_s": round(float(nb_d), 2) if nb_d is not None else None, "cells_s": round(total, 2),
            "kernel_wait_s": _gap(_stamp(meta, "start_time"), first), "shutdown_s": _gap(last, _stamp(meta, "end_time")),
            "cells": cells}


def run_cells(run: Path, min_seconds: float = 0.5) -> dict:
    """Every executed stage notebook in a run folder, by stage name (``01_intake`` → ``intake``)."""
    out = {}
    for nb in sorted(Path(run).glob("[0-9][0-9]_*.ipynb")):
        out[nb.stem.split("_", 1)[1]] = stage_cells(nb, min_seconds)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder (outputs/<model>/<run-id>)")
    ap.add_argument("--min", type=float, default=0.5, help="list cells of at least this many seconds")
    ap.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    args = ap.parse_args(argv)
    if not args.run.is_dir():
        ap.error(f"no run folder at {args.run}")
    data = run_cells(args.run, args.min)
    if not data:
        ap.error(f"no executed stage notebook (NN_<stage>.ipynb) in {args.run}")
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    for stage, s in data.items():
        print(f"{stage}: notebook {s['notebook_s']} s, cells {s['cells_s']} s, kernel wait {s['kernel_wait_s']} s, "
              f"shut-down {s['shutdown_s']} s")
        for c in s["cells"]:
            print(f"  {c['seconds']:8.2f} s  [{c['cell']:>2}] {c['code']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
