"""Architecture inspection: block lists, call tracing, forward patterns, attention facts, the
code-surface report and the integration plan. Heavy imports (torch, diffusers) load on first use."""

from __future__ import annotations

from .report import ArchReport, AttentionFacts, BlockList, CallConvention, CfgFacts, SupportFacts

__all__ = [
    "ArchReport", "AttentionFacts", "BlockList", "CallConvention", "CfgFacts", "SupportFacts",
    "inspect_transformer", "trace_pipeline", "trace_calls", "code_surface", "build_plan", "plan_hash",
    "check_approval", "run_inspection", "save_inspection",
]


def __getattr__(name):
    if name == "inspect_transformer":
        from .static import inspect_transformer

        return inspect_transformer
    if name in ("trace_pipeline", "trace_calls"):
        from . import trace

        return getattr(trace, name)
    if name == "code_surface":
        from .code_surface import code_surface

        return code_surface
    if name in ("build_plan", "plan_hash", "check_approval"):
        from . import plan

        return getattr(plan, name)
    if name in ("run_inspection", "save_inspection"):
        from . import stage as inspection

        return getattr(inspection, name)
    raise AttributeError(name)
