"""Parallel stage: feasibility of plans from the architecture, CP plans (registered or derived,
written as code), CFG parallel, the GQA attention path, and multi-process launch with parity.

Main entry points:

- ``feasibility(report, card) -> FeasibilityTable`` (world sizes 1, 2, 4, 8, with reasons)
- ``resolve_cp_plan`` / ``derive_cp_plan`` / ``write_plan_code`` (``parallel/cp_plan_<model>.py``):
  plans split before the first block (``check_plan_sites`` rejects a split after the blocks)
- ``sharding``: what each rank's blocks received (``BlockInputRecorder``), ``check_sharding``
  raising ``ShardingError`` when it is not the full length / degree; every launched plan records
  it (``details.sharding``) and the judge fails a CP plan whose split is not verified
- ``plans.refusal``: plans ditbook refuses before launch (tensor parallel: nothing would be sharded)
- ``apply_cfg_parallel(transformer, style, group)``
- ``time_gqa(...)`` and ``route_attention(transformer, gqa_path)``
- ``run_plans(card, plans, nproc, out_dir) -> ([records.PlanRow], LaunchResult)``
"""

from .feasibility import Feasibility, FeasibilityTable, feasibility
from .launch import LaunchResult, ParallelRunError, launch, run_plans
from .plans import PlanSpec, parse_plan, plan_name
from ..cp.sharding import ShardingError


__all__ = ["Feasibility", "FeasibilityTable", "feasibility", "LaunchResult", "ParallelRunError",
           "launch", "run_plans", "PlanSpec", "parse_plan", "plan_name", "ShardingError"]
