"""Parallel stage: plan feasibility from the architecture, and multi-process launch of plans
judged for parity with one process (``feasibility``, ``parse_plan``, ``run_plans``, ``launch``).
"""

from .feasibility import Feasibility, FeasibilityTable, feasibility
from .launch import LaunchResult, ParallelRunError, launch, run_plans
from .plans import PlanSpec, parse_plan, plan_name
from ..cp.sharding import ShardingError


__all__ = ["Feasibility", "FeasibilityTable", "feasibility", "LaunchResult", "ParallelRunError",
           "launch", "run_plans", "PlanSpec", "parse_plan", "plan_name", "ShardingError"]
