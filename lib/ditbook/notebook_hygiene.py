"""Committed notebooks carry no outputs, execution counts or papermill metadata, and keep their
``parameters`` cell. ``python -m ditbook.notebook_hygiene [--fix] notebooks/*.ipynb``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

REQUIRED_PARAMETERS = ("CARD", "RUN_DIR", "OVERRIDES", "INTERACTIVE")


def problems(path: str | Path) -> list[str]:
    nb = nbformat.read(str(path), as_version=4)
    out = []
    if "papermill" in nb.metadata:
        out.append("notebook metadata holds papermill data")
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(params) != 1:
        out.append(f"expected one cell tagged 'parameters', found {len(params)}")
    else:
        missing = [n for n in REQUIRED_PARAMETERS if f"{n} =" not in params[0].source]
        if missing:
            out.append(f"parameters cell does not set {missing}")
        lines = [l for l in params[0].source.splitlines() if "=" in l and not l.lstrip().startswith("#")]
        uncommented = [l.split("=")[0].strip() for l in lines if "#" not in l]
        if uncommented:
            out.append(f"parameters without a comment: {uncommented}")
    if not nb.cells or nb.cells[0].cell_type != "markdown" or not nb.cells[0].source.lstrip().startswith("# "):
        out.append("first cell must be a markdown title")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            out.append(f"cell {i} has outputs")
        if cell.get("execution_count") is not None:
            out.append(f"cell {i} has an execution count")
        if "papermill" in cell.get("metadata", {}) or "execution" in cell.get("metadata", {}):
            out.append(f"cell {i} has execution metadata")
    return out


def strip(path: str | Path) -> None:
    nb = nbformat.read(str(path), as_version=4)
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        for key in ("papermill", "execution"):
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(nb, str(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--fix", action="store_true", help="strip outputs and metadata in place")
    args = ap.parse_args(argv)
    bad = 0
    for p in args.notebooks:
        if args.fix:
            strip(p)
        for prob in problems(p):
            print(f"{p}: {prob}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
