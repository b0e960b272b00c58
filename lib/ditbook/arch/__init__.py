"""Architecture facts read from a transformer's code and a traced run: block lists, call conventions, forward patterns,
loop work, attention facts, the CFG style and what diffusers and cache-dit already support. ``inspect_pipeline`` is
the one entry (``static`` then ``trace``); the inspect stage writes ``inspect/arch.json`` and techniques read it
(``ArchReport.load``)."""

from __future__ import annotations

from .report import ArchReport, AttentionFacts, BlockList, CallConvention, CfgFacts, SupportFacts


def trace_knobs(card, steps: int | None = None, size: int | None = None) -> tuple[int, int | None]:
    """Trace steps and size: arguments, else the card's ``inspect`` section (2 steps at the card's size)."""
    steps = steps or card.inspect.trace_steps
    size = size or card.inspect.trace_size
    return steps, (int(size) if size else None)


def inspect_pipeline(pipe, card, steps: int | None = None, size: int | None = None) -> ArchReport:
    """The static facts of ``pipe.transformer``, completed by one traced generation of ``pipe``."""
    from .static import inspect_transformer
    from .trace import trace_pipeline

    steps, size = trace_knobs(card, steps, size)
    report = inspect_transformer(pipe.transformer, type(pipe).__name__)
    return trace_pipeline(pipe, card, steps=steps, size=size, report=report)


__all__ = ["ArchReport", "AttentionFacts", "BlockList", "CallConvention", "CfgFacts", "SupportFacts",
           "inspect_pipeline", "trace_knobs"]
