"""Acceleration techniques, one module each, found by the registry itself: every module of this
package whose name does not start with ``_`` is imported on first use and registers its technique
class with :func:`register` (``ditbook.accel.technique``). Adding a technique is adding a module
here: no list to edit, no stage to touch; stages ask ``techniques(kind)``.
"""

from __future__ import annotations

import importlib
import pkgutil

from .technique import (KINDS, CacheRecord, CacheTechnique, Feasibility, Handle, NothingDone, ParallelTechnique,
                        PipelineTechnique, Record, Technique)

_REGISTRY: dict[str, type[Technique]] = {}
_SKIP = {"technique"}  # the base module itself


def register(cls: type[Technique]) -> type[Technique]:
    """Class decorator of a technique module: the technique under its ``name``."""
    if getattr(cls, "kind", None) not in KINDS:
        raise ValueError(f"technique {cls.__name__}: kind {getattr(cls, 'kind', None)!r} is not one of {KINDS}")
    other = _REGISTRY.get(cls.name)
    if other is not None and other.__module__ != cls.__module__:
        raise ValueError(f"technique name {cls.name!r} is taken by {other.__module__}")
    _REGISTRY[cls.name] = cls
    return cls


def discover() -> dict[str, type[Technique]]:
    """Import every technique module on this package's path (modules added to ``__path__`` too)."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name not in _SKIP:
            importlib.import_module(f"{__name__}.{info.name}")
    return _REGISTRY


def techniques(kind: str | None = None) -> list[type[Technique]]:
    """The registered techniques (of one kind), by name."""
    discover()
    return [t for n, t in sorted(_REGISTRY.items()) if kind is None or t.kind == kind]


def names(kind: str | None = None) -> list[str]:
    return [t.name for t in techniques(kind)]


def parallel_kinds() -> list[type[ParallelTechnique]]:
    """The parallel techniques in their order (plan names, feasibility rows, application on a rank)."""
    return sorted(techniques("parallel"), key=lambda t: (t.order, t.name))


def plan_name(cache: bool = False, compile: bool = False, graph: bool = False, **degrees: int) -> str:
    """The plan name of these degrees (``plan_name(cfg=2, ulysses=2, cache=True)`` ->
    ``cfg2_ulysses2+cache``), parts in the techniques' order."""
    left = {k: v for k, v in degrees.items() if v > 1}
    parts = [p for t in parallel_kinds() if (p := t.name_part(left))]
    if left:
        raise KeyError(f"no parallel technique names {sorted(left)}")
    name = "_".join(parts) or "single"
    return name + "".join(f"+{o}" for o, on in (("cache", cache), ("compile", compile), ("graph", graph)) if on)


def by_token(token: str) -> type[ParallelTechnique]:
    for t in techniques("parallel"):
        if t.token == token:
            return t
    raise KeyError(f"no parallel technique has the plan token {token!r}; known: {[t.token for t in techniques('parallel')]}")


def get(name: str) -> type[Technique]:
    discover()
    if name not in _REGISTRY:
        raise KeyError(f"unknown technique {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


__all__ = ["KINDS", "CacheRecord", "CacheTechnique", "Feasibility", "Handle", "NothingDone", "ParallelTechnique",
           "PipelineTechnique", "Record", "Technique", "by_token", "discover", "parallel_kinds", "plan_name",
           "get", "names", "register", "techniques"]


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split()).replace("``", "`")
    return text.split(". ")[0].rstrip(".").removeprefix("Fails when ")


def _evidence(t: type[Technique]) -> tuple[str, str]:
    """What ``t`` records and when its check fails, from its code (the record type ``check`` takes,
    the check's docstring)."""
    import inspect
    import typing

    if issubclass(t, ParallelTechnique):
        if t.check.__func__ is not ParallelTechnique.check.__func__:
            return f"each rank's `{t.token}` record (`records.Sharding.kinds`)", _first_sentence(inspect.getdoc(t.check))
        return ("every rank's block inputs (`records.Sharding.ranks`)",
                "the blocks did not get their share (`cp.sharding`, judged by the launch)")
    hint = typing.get_type_hints(t.check).get("record")
    rec = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    return f"`{getattr(rec, '__name__', rec)}`", _first_sentence(inspect.getdoc(t.check))


def table_markdown() -> str:
    """The technique table of ``docs/CONTRACTS.md``: technique -> module -> record -> check; the
    techniques that share a record and a check share a row (module ``accel/<name>.py`` each)."""
    groups: dict[tuple, list[type[Technique]]] = {}
    for t in sorted(techniques(), key=lambda t: (KINDS.index(t.kind), t.name)):
        groups.setdefault((t.kind, *_evidence(t)), []).append(t)
    rows = ["| technique | kind | module | record | check fails when |", "| --- | --- | --- | --- | --- |"]
    for (kind, record, check), ts in groups.items():
        modules = {t.__module__.rsplit(".", 1)[-1] for t in ts}
        where = f"`accel/{modules.pop()}.py`" if len(modules) == 1 else "`accel/<name>.py`"
        rows.append(f"| {', '.join(t.name for t in ts)} | {kind} | {where} | {record} | {check} |")
    return "\n".join(rows)
