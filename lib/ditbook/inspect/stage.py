"""The inspect stage in two calls: ``run_inspection`` (static + traced + code surface + plan)
and ``save_inspection`` (the stage's files in the run folder). The notebook, the CLI and the
tests all go through here."""

from __future__ import annotations

import inspect as _inspect
import json
from dataclasses import dataclass
from pathlib import Path

from .code_surface import CodeSurface, code_surface
from ..records import InspectResults
from .plan import build_plan, write_plan
from ..arch.report import ArchReport
# the 02_inspect notebook imports this module (and the display helpers) only: the other names it uses
from ..context import open_stage  # noqa: F401
from .tables import block_rows, fact_rows  # noqa: F401


@dataclass
class Inspection:
    report: ArchReport
    surface: CodeSurface
    plan: dict
    traced_size: list[int] | None = None  # [height, width] of the traced generation: its sequence lengths hold there

    def to_dict(self) -> dict:
        return {"report": self.report.to_dict(), "code_surface": self.surface.to_dict(), "plan": self.plan}


def source_paths(pipe) -> list[str]:
    """The pipeline's and the transformer's source files."""
    paths = []
    for obj in (pipe, getattr(pipe, "transformer", None)):
        if obj is None:
            continue
        try:
            paths.append(_inspect.getsourcefile(type(obj)))
        except TypeError:
            pass
    return [p for p in paths if p]


def run_inspection(pipe, card, steps: int | None = None, size: int | None = None) -> Inspection:
    from ..arch import inspect_pipeline, trace_knobs

    steps, size = trace_knobs(card, steps, size)
    report = inspect_pipeline(pipe, card, steps, size)
    surface = code_surface(source_paths(pipe), report)
    plan = build_plan(report, surface, card)
    traced = [int(size), int(size)] if size else [card.generation.height, card.generation.width]
    return Inspection(report, surface, plan, traced)


def save_inspection(folder: str | Path, result: Inspection) -> InspectResults:
    """Write arch.json, code_surface.json, plan.json, plan.md; return the stage's record."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    result.report.save(folder / "arch.json")
    (folder / "code_surface.json").write_text(json.dumps(result.surface.to_dict(), indent=2) + "\n")
    write_plan(folder, result.plan)
    r = result.report
    return InspectResults(plan_hash=result.plan["hash"], transformer_class=r.transformer_class,
                          block_lists=[b.path for b in r.block_lists],
                          forward_patterns=[b.forward_pattern for b in r.block_lists],
                          loop_extra_work=r.loop_extra_work, cfg_style=r.cfg.style, heads=r.attention.heads,
                          kv_heads=r.attention.kv_heads, risks=[x["id"] for x in result.plan["risks"]],
                          port_estimate_lines=result.surface.port_estimate_lines, traced_size=result.traced_size)
