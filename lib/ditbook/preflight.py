"""The gate a run meets before anything starts, shared by ``ditbook check`` and ``ditbook run``.

``card.gate_problems`` checks the card itself (schema, paths, classes that import). A run also
refuses, at its start, what the card cannot know by itself: a name that is not one safe folder
name (it names ``outputs/<name>/``), a ``runtime.device`` this machine lacks, cache strategies
that are not registered, a technique's settings it refuses (``runtime.compile``), and ``generation.extra`` arguments whose type the pipeline's
``__call__`` signature contradicts (a list where its default is a number). ``start_problems``
returns all of them, so the gate check and the run never disagree.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from .card import GateError, ModelCard, gate_problems, import_class


def name_problem(card: ModelCard) -> str | None:
    from .runs import RunError, safe_component

    try:
        safe_component(card.name, "model name (card field 'name')")
    except RunError as exc:
        return f"name: {exc}"
    return None


def device_problem(card: ModelCard) -> str | None:
    from .loading import DeviceUnavailableError, choose_placement

    try:
        choose_placement(card)
    except DeviceUnavailableError as exc:
        return f"runtime.device: {exc}"
    return None


def strategy_problem(card: ModelCard) -> str | None:
    from . import accel

    wanted = card.cache.strategies
    if wanted is None:
        return None
    unknown = [n for n in wanted if n not in accel.names("cache")]
    if unknown or not wanted:
        return (f"cache.strategies: {'unknown strategy name(s) ' + str(unknown) if unknown else 'the list is empty'}; "
                f"registered: {', '.join(accel.names('cache'))} (ditbook cache --list), or null for every one")
    return None


def technique_problems(card: ModelCard) -> list[str]:
    """What each pipeline-wide technique finds wrong in the card's settings for it (its
    ``requested(card)`` raising ``ValueError``: ``runtime.compile.turbo: unknown key``)."""
    from . import accel

    out = []
    for technique in accel.techniques():
        if isinstance(technique, type) and issubclass(technique, accel.PipelineTechnique):
            try:
                technique.requested(card)
            except ValueError as exc:
                out.append(str(exc))
    return out


def _same_kind(value: Any, default: Any) -> bool:
    """Whether ``value`` can stand where the signature's ``default`` stands (None fits anything;
    an int fits a float)."""
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) == isinstance(default, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    if isinstance(default, str):
        return isinstance(value, str)
    return True  # a default of another type says too little


def extra_problems(card: ModelCard) -> list[str]:
    """``generation.extra`` keys whose value's type differs from the type of the pipeline's own
    default for that argument; the names are only checked when ``__call__`` takes no ``**kwargs``."""
    extra = card.generation.extra or {}
    if not extra or not (card.pipeline.cls and card.pipeline.source):
        return []
    try:
        params = inspect.signature(import_class(card.resolve_source(card.pipeline.source), card.pipeline.cls).__call__).parameters
    except (ImportError, TypeError, ValueError):
        return []  # the gate check names an import problem; a signature that cannot be read says nothing
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = []
    for key, value in extra.items():
        p = params.get(key)
        if p is None:
            if not takes_any:
                out.append(f"generation.extra.{key}: {card.pipeline.cls}.__call__ has no argument {key!r}")
            continue
        default = None if p.default is inspect.Parameter.empty else p.default
        if not _same_kind(value, default):
            out.append(f"generation.extra.{key}: {value!r} ({type(value).__name__}) where {card.pipeline.cls}.__call__ "
                       f"expects a {type(default).__name__} like its default {default!r}")
    return out


def start_problems(path: str | Path, overrides: dict | None = None) -> tuple[ModelCard | None, list[str]]:
    """Every problem that stops a run at its start: the card's gate, then the name, the device,
    the cache strategies and the pipeline's extra arguments."""
    card, problems = gate_problems(path, overrides)
    if card is None:
        return card, problems
    problems += [p for p in (name_problem(card), device_problem(card), strategy_problem(card)) if p]
    problems += technique_problems(card)
    if not any(p.startswith("pipeline.") for p in problems):
        problems += extra_problems(card)
    return card, problems


def start_check(path: str | Path, overrides: dict | None = None) -> ModelCard:
    """``start_problems`` as ``GateError`` (listing each), or the card."""
    card, problems = start_problems(path, overrides)
    if problems or card is None:
        raise GateError(path, problems)
    return card


__all__ = ["start_problems", "start_check", "name_problem", "device_problem", "strategy_problem", "extra_problems",
           "technique_problems"]
