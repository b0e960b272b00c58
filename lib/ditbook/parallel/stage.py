"""What the ``04_parallel`` notebook calls: choose plans, time the GQA paths, run, and write
``parallel/results.json``.

``parallel/results.json`` holds:

- ``feasibility``: ``FeasibilityTable.to_dict()`` (facts and one row per kind x world size);
- ``plans``: one entry per plan run — ``name``, ``world_size``, ``passed``, ``quality``
  (``SetQuality`` dict against the single-process run of the same launch), ``seconds`` (median
  per image), ``speedup`` (against that single-process run), ``reference``, ``details``;
- ``not_run``: plans asked for but ruled out, with their reason;
- ``gqa``: the GQA timing (``GqaTiming`` dict, or null for a model without GQA) and ``applied``;
- ``launch``: command, processes, wall seconds, ``attempts`` (one per torchrun launch: ``plans``,
  ``failed`` — the plan that failed in the ranks, recorded as not passed with its named ``error``;
  the plans after it ran in the next launch); ``cp_plan_file``: the emitted plan code;
- ``sharding``: per plan, per rank, the sequence lengths each block list's blocks received, the
  number of sharded parameters per rank, and whether the split was verified (a CP plan whose
  blocks did not get full length / degree fails with a ``ShardingError``; the full record is
  in each plan's ``details.sharding``); ``kinds``: for tp/vae/te/ring plans, that kind's check
  of every rank's record (``check``, or ``error`` naming ``TensorShardingError``,
  ``VaeShardingError``, ``TextEncoderShardingError`` or ``RingShardingError``).
"""

from __future__ import annotations

from pathlib import Path

from ..cp.attention import model_gqa_shapes, time_gqa
from .feasibility import FeasibilityTable
from .launch import run_plans
from .plans import parse_plan, refusal
# the 04_parallel notebook imports this module (and the display helpers) only: the other names it uses
from ..context import open_stage  # noqa: F401
from ..arch.report import ArchReport  # noqa: F401
from .feasibility import feasibility  # noqa: F401


def choose_plans(table: FeasibilityTable, nproc: int, wanted: list[str] | None = None,
                 with_cache: bool = False, with_graph: bool = False,
                 present: int | None = None, cache_refused: str | None = None) -> tuple[list[str], list[dict]]:
    """Plans to launch at ``nproc`` processes, and those ruled out with their reason.

    ``cache_refused``: why the cache stage refused caching on this model (``cache_refusal``);
    every ``+cache`` plan is then listed as not run with that reason, and the others go on.

    ``with_graph`` adds each feasible plan again as ``+compile+graph`` (regional compile, each
    transformer call replayed as a CUDA graph: GPU only, see ``parallel.graphs``). ``present``
    is the number of GPUs the ranks can use (``launch.ranks_present``; None on the CPU): a plan
    needing more is listed as not run, "needs 2 GPUs, 1 present", and never launched."""
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
    run = ctx.run
    if not run.has_results("cache"):
        return None
    return run.read_results("cache").get("refused") or None


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
    base = [p for p in table.feasible_plans(nproc) if p != "single"]
    skipped = [{"name": p, "reason": refusal(parse_plan(p))} for p in base if refusal(parse_plan(p))]
    base = [p for p in base if not refusal(parse_plan(p))]
    run = list(base)
    if with_cache:
        cached = [f"{p}+cache" for p in base if parse_plan(p).uses_cp or parse_plan(p).cfg > 1]
        skipped += [{"name": p, "reason": refusal(parse_plan(p), table.facts.get("device"))}
                    for p in cached if refusal(parse_plan(p), table.facts.get("device"))]
        run += [p for p in cached if not refusal(parse_plan(p), table.facts.get("device"))]
    if with_graph:
        graphed = [f"{p}+compile+graph" for p in base]
        skipped += [{"name": p, "reason": refusal(parse_plan(p))} for p in graphed if refusal(parse_plan(p))]
        run += [p for p in graphed if not refusal(parse_plan(p))]
    return run, skipped


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
    gqa_path = (gqa or {}).get("faster") or "enable_gqa"
    return run_plans(ctx.card.card_path, plans, nproc, ctx.dir, overrides=ctx.overrides, timeout=timeout,
                     cfg_style=cfg_style, attention_kind=kind, gqa_path=gqa_path,
                     gates=ctx.card.parallel.gates, cache_gates=ctx.card.cache.gates)


def block_sequence_lengths(sharding: dict | None) -> dict | None:
    """Per rank, per block list: the sequence lengths its blocks received (and, for a CP plan,
    whether they were the full length / degree)."""
    if not sharding:
        return None
    return {"per_rank": [{name: rec["seq_lens"] for name, rec in (r or {}).get("block_inputs", {}).items()}
                         for r in sharding.get("ranks") or []],
            "sharded_parameters": [len((r or {}).get("sharded_parameters") or []) for r in sharding.get("ranks") or []],
            "rows_per_rank": [{name: rec.get("entries") for name, rec in (r or {}).get("block_inputs", {}).items()}
                              for r in sharding.get("ranks") or []],
            # True when every split the plan makes was checked on every rank's record: the block
            # sequence (CP), the CFG branches (rows entering the blocks), each kind's own record
            # (tensor / VAE / text-encoder parallel, ditbook's ring); None: the plan splits nothing
            "verified": _verified(sharding), "error": sharding.get("error"),
            "kinds": sharding.get("kinds") or {}}


def _verified(sharding: dict) -> bool | None:
    checks = []
    if (sharding.get("degree") or 1) > 1:
        checks.append(bool(sharding.get("check")) and not sharding.get("error"))
    if "cfg_check" in sharding:
        checks.append(bool(sharding["cfg_check"]))
    for rec in (sharding.get("kinds") or {}).values():
        checks.append(bool((rec or {}).get("check")) and not (rec or {}).get("error"))
    return all(checks) if checks else None


def stage_results(table: FeasibilityTable, results, launch, gqa: dict | None, not_run: list[dict],
                  stage_dir: Path) -> dict:
    files = sorted(p.name for p in Path(stage_dir).glob("cp_plan_*.py"))
    return {
        "feasibility": table.to_dict(),
        "plans": [r.to_dict() for r in results],
        "not_run": not_run,
        "gqa": {"timing": gqa, "applied": (gqa or {}).get("faster")},
        "launch": {"command": launch.command if launch else None, "nproc": launch.nproc if launch else None,
                   "seconds": round(launch.seconds, 2) if launch else None,
                   "attempts": list(getattr(launch, "attempts", None) or []) if launch else []},
        "cp_plan_file": files[0] if files else None,
        "sharding": {r.name: block_sequence_lengths(r.details.get("sharding")) for r in results},
        "passed": all(r.passed for r in results),
    }


