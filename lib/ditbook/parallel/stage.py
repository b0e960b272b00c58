"""What the ``04_parallel`` notebook calls: choose plans, time the GQA paths, run, and write
``parallel/results.json`` (``records.ParallelResults``).
"""

from __future__ import annotations

from pathlib import Path

from ..cp.attention import model_gqa_shapes, time_gqa
from .feasibility import FeasibilityTable
from .launch import run_plans
from ..records import NotRun, ParallelResults, ShardingSummary
from .plans import parse_plan, refusal
# the 04_parallel notebook imports this module (and the display helpers) only: the other names it uses
from ..context import open_stage  # noqa: F401
from ..arch.report import ArchReport  # noqa: F401
from .feasibility import feasibility  # noqa: F401


def choose_plans(table: FeasibilityTable, nproc: int, wanted: list[str] | None = None,
                 with_cache: bool = False, with_graph: bool = False,
                 present: int | None = None, cache_refused: str | None = None) -> tuple[list[str], list[dict]]:
    """Plans to launch at ``nproc`` processes, and those ruled out with their reason. ``with_graph``
    adds each feasible plan as ``+compile+graph``; ``present``: the GPUs the ranks can use (None on
    the CPU); ``cache_refused``: why the cache stage refused caching (every ``+cache`` plan not run)."""
    run, skipped = _choose_plans(table, nproc, wanted, with_cache, with_graph)
    if present is not None and nproc > present:
        skipped += [{"name": p, "reason": f"not run: needs {parse_plan(p).world_size} GPUs, {present} present"}
                    for p in run]
        run = []
    if cache_refused:
        skipped += [{"name": p, "reason": f"not run: the cache stage refused caching ({cache_refused})"}
                    for p in run if parse_plan(p).cache]
        run = [p for p in run if not parse_plan(p).cache]
    return run, skipped


def cache_refusal(ctx) -> str | None:
    """Why the cache stage of this run refused caching (``cache/results.json`` ``refused``), or None."""
    cache = ctx.run.results_or_none("cache")
    return cache.refused if cache is not None else None


def ranks_for(ctx) -> int | None:
    """GPUs this stage's ranks can use (None when they run on the CPU)."""
    from .launch import ranks_present

    return ranks_present(ctx.placement.device)


def _choose_plans(table: FeasibilityTable, nproc: int, wanted: list[str] | None,
                  with_cache: bool, with_graph: bool) -> tuple[list[str], list[dict]]:
    if wanted:
        run, skipped = [], []
        for p in wanted:
            row = table.check(p)
            why = refusal(parse_plan(p), table.facts.get("device"))
            if why:
                skipped.append({"name": p, "reason": why})
            elif parse_plan(p).world_size != nproc:
                skipped.append({"name": p, "reason": f"needs {parse_plan(p).world_size} processes, run has {nproc}"})
            elif row is None or not row.feasible or not row.launchable:
                skipped.append({"name": p, "reason": row.reason if row else "not in the feasibility table"})
            else:
                run.append(p)
        return run, skipped
    base, skipped = _refused([p for p in table.feasible_plans(nproc) if p != "single"])
    run = list(base)
    if with_cache:
        cached = [f"{p}+cache" for p in base if parse_plan(p).uses_cp or parse_plan(p).cfg > 1]
        ok, no = _refused(cached, table.facts.get("device"))
        run, skipped = run + ok, skipped + no
    if with_graph:
        ok, no = _refused([f"{p}+compile+graph" for p in base])
        run, skipped = run + ok, skipped + no
    return run, skipped


def _refused(plans: list[str], device: str | None = None) -> tuple[list[str], list[dict]]:
    """(the plans ``refusal`` lets run, the others with their reason)."""
    why = {p: refusal(parse_plan(p), device) for p in plans}
    return [p for p in plans if not why[p]], [{"name": p, "reason": why[p]} for p in plans if why[p]]


def graph_plans_apply(ctx) -> bool:
    """Whether this stage's model runs on a CUDA GPU (where ``+graph`` plans can run)."""
    import torch

    from ..loading import choose_placement

    return torch.cuda.is_available() and choose_placement(ctx.card).device.startswith("cuda")


def gqa_timings(report, card, placement, repeats: int = 5) -> dict | None:
    """Time both GQA paths on the model's real shapes on this device; None without GQA."""
    shapes = model_gqa_shapes(None, report)
    if shapes is None:
        return None
    return time_gqa(shapes["heads"], shapes["kv_heads"], shapes["head_dim"], shapes["seq_len"],
                    device=placement.device, dtype=placement.dtype, repeats=repeats).to_dict()


def run_stage_plans(ctx, report, plans: list[str], nproc: int, gqa: dict | None, timeout: float = 300.0):
    cfg_style = report.cfg.style if report.cfg.style in ("separate", "batched") else None
    kind = report.attention.kind if report.attention.kind in ("joint", "cross", "self") else None
    gqa_path = gqa["faster"] if gqa and gqa.get("faster") else "enable_gqa"
    return run_plans(ctx.card.card_path, plans, nproc, ctx.dir, overrides=ctx.overrides, timeout=timeout,
                     cfg_style=cfg_style, attention_kind=kind, gqa_path=gqa_path,
                     gates=ctx.card.parallel.gates, cache_gates=ctx.card.cache.gates)


def stage_results(table: FeasibilityTable, results, launch, gqa: dict | None, not_run: list[dict],
                  stage_dir: Path) -> ParallelResults:
    files = sorted(p.name for p in Path(stage_dir).glob("cp_plan_*.py"))
    return ParallelResults(
        feasibility=table.to_dict(), passed=all(r.passed for r in results), plans=list(results),
        not_run=[NotRun(**n) for n in not_run], gqa={"timing": gqa, "applied": gqa["faster"] if gqa else None},
        launch={"command": launch.command, "nproc": launch.nproc, "seconds": round(launch.seconds, 2),
                "attempts": list(getattr(launch, "attempts", None) or [])} if launch else None,
        cp_plan_file=files[0] if files else None,
        sharding={r.name: ShardingSummary.of(r.details["sharding"]) if "sharding" in r.details else None
                  for r in results},
        device=table.facts.get("device"))


