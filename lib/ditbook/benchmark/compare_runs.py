"""What changed between two runs of a model: metric deltas and the nbdime diff of each notebook."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..runs import RunFolder
from .report import notebooks
from .summary import summary_rows

METRICS = ("speedup", "e2e_ms", "psnr_min", "ssim_min")


@dataclass
class RunComparison:
    run_a: str
    run_b: str
    model_a: str
    model_b: str
    deltas: list[dict] = field(default_factory=list)  # per configuration: a, b, b - a per metric
    stage_status: list[dict] = field(default_factory=list)
    notebook_diffs: dict[str, str] = field(default_factory=dict)  # notebook -> pretty nbdime diff
    only_in: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"run_a": self.run_a, "run_b": self.run_b, "model_a": self.model_a, "model_b": self.model_b,
                "deltas": self.deltas, "stage_status": self.stage_status, "only_in": self.only_in,
                "notebook_diffs": self.notebook_diffs}

    def format(self) -> str:
        out = [f"A: {self.run_a} ({self.model_a})", f"B: {self.run_b} ({self.model_b})"]
        if self.model_a != self.model_b:
            out.append("warning: the runs are of different models")
        out += ["", "stages:"]
        out += [f"  {r['stage']:10s} {r['a'] or '-':8s} -> {r['b'] or '-'}" for r in self.stage_status]
        out += ["", "metrics (B - A):"]
        for d in self.deltas:
            cells = []
            for m in METRICS:
                a, b, delta = d[m]["a"], d[m]["b"], d[m]["delta"]
                cells.append(f"{m} {_f(a)} -> {_f(b)} ({'+' if (delta or 0) >= 0 else ''}{_f(delta)})" if delta is not None
                             else f"{m} {_f(a)} -> {_f(b)}")
            out.append(f"  {d['name']}: " + "; ".join(cells))
        for side, names in self.only_in.items():
            if names:
                out.append(f"  only in {side}: {', '.join(names)}")
        for name, diff in self.notebook_diffs.items():
            out += ["", f"=== nbdime diff of {name}", diff.rstrip() or "(no differences)"]
        return "\n".join(out) + "\n"


def _f(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _rows(run: RunFolder) -> dict[str, dict]:
    if not run.has_results("benchmark"):
        return {}
    return {r["name"]: r for r in summary_rows(run.read_results("benchmark"))}


def notebook_diff(path_a: Path, path_b: Path, outputs: bool = False) -> str:
    """nbdime's diff of two notebooks, pretty-printed without colour; outputs left out unless
    ``outputs`` (images and timings differ on every run)."""
    import nbdime
    import nbformat
    from nbdime.prettyprint import PrettyPrintConfig, pretty_print_diff

    a = nbformat.read(str(path_a), as_version=4)
    b = nbformat.read(str(path_b), as_version=4)
    if not outputs:
        for nb in (a, b):
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs = []
                    cell.execution_count = None
                cell.metadata.pop("papermill", None)
                cell.metadata.pop("execution", None)
            nb.metadata.pop("papermill", None)
    diff = nbdime.diff_notebooks(a, b)
    buf = io.StringIO()
    pretty_print_diff(a, diff, "", PrettyPrintConfig(out=buf, use_color=False, use_git=False))
    return buf.getvalue()


def compare_runs(run_a: str | Path, run_b: str | Path, outputs: bool = False) -> RunComparison:
    a, b = RunFolder(run_a), RunFolder(run_b)
    ma, mb = a.read_meta(), b.read_meta()
    cmp = RunComparison(str(a.path), str(b.path), ma.get("model", "?"), mb.get("model", "?"))
    stages = list(dict.fromkeys([*(ma.get("stages") or {}), *(mb.get("stages") or {})]))
    cmp.stage_status = [{"stage": s, "a": (ma.get("stages") or {}).get(s, {}).get("status"),
                         "b": (mb.get("stages") or {}).get(s, {}).get("status")} for s in stages]
    ra, rb = _rows(a), _rows(b)
    for name in [n for n in ra if n in rb]:
        d = {"name": name}
        for m in METRICS:
            va, vb = ra[name].get(m), rb[name].get(m)
            delta = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
            d[m] = {"a": va, "b": vb, "delta": None if delta is None else round(float(delta), 6)}
        cmp.deltas.append(d)
    cmp.only_in = {"A": [n for n in ra if n not in rb], "B": [n for n in rb if n not in ra]}
    nbs_b = {p.name: p for p in notebooks(b)}
    for p in notebooks(a):
        if p.name in nbs_b:
            cmp.notebook_diffs[p.name] = notebook_diff(p, nbs_b[p.name], outputs)
    return cmp


__all__ = ["RunComparison", "compare_runs", "notebook_diff", "json"]
