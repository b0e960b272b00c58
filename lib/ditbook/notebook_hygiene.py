"""Committed notebooks carry no outputs, execution counts or papermill metadata, and keep their
``parameters`` cell. ``python -m ditbook.notebook_hygiene [--fix] notebooks/*.ipynb``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

REQUIRED_PARAMETERS = ("CARD", "RUN_DIR", "OVERRIDES", "INTERACTIVE")
# the kernelspec ipykernel installs (JupyterLab rewrites any other one on opening, and the
# notebook shows as modified before anyone touched it)
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}



def jupyterlab_metadata() -> dict:
    """The notebook metadata JupyterLab writes on opening a notebook with the installed
    ``python3`` kernel: ``kernelspec`` (name, display name, language: its kernel.json) and
    ``language_info`` (the kernel's ``kernel_info`` reply, ipykernel's ``language_info``).
    JupyterLab sets both and marks the notebook modified unless they are equal to what is
    saved (``@jupyter/ydoc`` ``setMetadata`` compares with ``deepEqual``), so the committed
    notebooks carry exactly these."""
    spec = dict(KERNELSPEC)
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        ks = KernelSpecManager().get_kernel_spec(spec["name"])
        spec.update(display_name=ks.display_name, language=ks.language)
    except Exception:  # no jupyter_client or no installed kernelspec: ipykernel's default
        pass
    from ipykernel.ipkernel import IPythonKernel

    return {"kernelspec": spec, "language_info": json.loads(json.dumps(IPythonKernel.language_info))}


# what a reader of an executed notebook should not have to wade through: library log lines,
# warnings, and progress bars saved mid-way
_NOISE = re.compile(r"^\s*\[[^\]]*\]\s*\[Cache-DiT\]|\[Cache-DiT\]|^\[transformers\]|"
                    r"\b(Future|Deprecation|User|Runtime|Resource)Warning\b|^\s*warnings\.warn\(|"
                    r"\bWARNING\b\s*[|:]|^\s*(DEBUG|INFO|WARNING)\s*[:|]", re.MULTILINE)
_BAR = re.compile(r"\d+%\|")


def noise(path: str | Path) -> list[str]:
    """Lines in an executed notebook's outputs that are library logs or warnings (anything on
    stderr, cache-dit/transformers log lines, ``*Warning``), progress bars that did not reach
    100%, and saved widget state; ``[]`` for a notebook a person can read."""
    nb = nbformat.read(str(path), as_version=4)
    found = []
    if nb.metadata.get("widgets"):
        found.append("notebook metadata holds widget state (a progress bar or widget was left in it)")
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text = out.get("text", "")
                if out.get("name") == "stderr" and text.strip():
                    found += [f"cell {i} stderr: {ln}" for ln in text.splitlines() if ln.strip()][:5]
                    continue
                found += [f"cell {i}: {ln}" for ln in text.splitlines() if _NOISE.search(ln)]
                found += [f"cell {i} progress bar: {ln}" for ln in text.replace("\r", "\n").splitlines()
                          if _BAR.search(ln) and "100%|" not in ln]
            else:
                data = out.get("data") or {}
                if any("widget-view" in k for k in data):
                    found.append(f"cell {i}: a widget output ({str(data.get('text/plain', ''))[:80]})")
                plain = str(data.get("text/plain", ""))
                if out.get("output_type") == "error":
                    continue
                found += [f"cell {i}: {ln}" for ln in plain.splitlines() if _NOISE.search(ln)]
    return found


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
    for key, want in jupyterlab_metadata().items():
        if nb.metadata.get(key) != want:
            out.append(f"{key} is {nb.metadata.get(key)}, not what JupyterLab writes with the installed kernel "
                       f"({want}): opening it would mark it modified (--fix sets it)")
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
    nb.metadata.pop("widgets", None)
    nb.metadata.update(jupyterlab_metadata())
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
