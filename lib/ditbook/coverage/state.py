"""State inputs of a running pipeline that a forward requires (``state_options``), made only where
the code says how: a parameter annotated with a class whose constructor takes only ints
(``KVCache(num_layers)``) gets an empty instance (each int the config's value of that name, else the
longest block list's length); a ``str`` parameter the forward compares with string constants gets
each constant in turn, in source order (a mode that fills the cache runs on an empty one). Anything
else is not made up: ``state_options`` returns None and the probe refuses with the names."""

from __future__ import annotations

import ast
import inspect
import itertools

from torch import nn

from .dataflow import _source_tree

MAX_OPTIONS = 8


def _mode_constants(forward, name: str) -> list[str]:
    """String constants the forward compares ``name`` with, in source order."""
    _, node = _source_tree(forward)
    out: list[str] = []
    for n in ast.walk(node) if node is not None else ():
        if not (isinstance(n, ast.Compare) and isinstance(n.left, ast.Name) and n.left.id == name):
            continue
        for c in n.comparators:
            items = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
            for x in items:
                if isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value not in out:
                    out.append(x.value)
    return sorted(out, key=lambda v: _first_position(node, v))


def _first_position(node, value: str) -> tuple:
    pos = [(x.lineno, x.col_offset) for x in ast.walk(node) if isinstance(x, ast.Constant) and x.value == value]
    return min(pos) if pos else (0, 0)


def _longest_block_list(model) -> int:
    return max((len(m) for m in model.modules() if isinstance(m, nn.ModuleList)), default=1)


def _empty_state(model, cls: type):
    """An instance of ``cls`` built from ints only, or None when its constructor takes anything else."""
    try:
        params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return None
    cfg = dict(getattr(model, "config", {}) or {})
    kwargs = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is not inspect.Parameter.empty:
            continue
        if p.annotation not in (int, "int"):  # only counts: a cache sized by the layers
            return None
        v = cfg.get(p.name)
        kwargs[p.name] = v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else _longest_block_list(model)
    try:
        return cls(**kwargs)
    except Exception:
        return None


def _choices(model, name: str, annotation) -> list | None:
    forward = type(model).forward
    if isinstance(annotation, str):  # a postponed annotation: a bare name of the forward's module
        annotation = {"str": str, "int": int}.get(annotation) or getattr(inspect.unwrap(forward), "__globals__",
                                                                        {}).get(annotation, annotation)
    if annotation in (str, "str"):
        modes = _mode_constants(forward, name)
        return [(m, f"{name}={m!r} (a mode the forward compares it with)") for m in modes] or None
    if inspect.isclass(annotation) and annotation is not inspect.Parameter.empty \
            and annotation.__module__ not in ("builtins", "typing", "torch", "inspect"):
        obj = _empty_state(model, annotation)
        if obj is not None:
            return [(obj, f"{name}: an empty {annotation.__name__}")]
    return None


def state_options(model, names: list[str]) -> list[tuple[dict, list[str]]] | None:
    """[(values for ``names``, notes)] to try in turn, or None when one of them cannot be made."""
    try:
        sig = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return None
    per = []
    for name in names:
        choices = _choices(model, name, sig[name].annotation if name in sig else None)
        if not choices:
            return None
        per.append([(name, v, note) for v, note in choices])
    out = []
    for combo in itertools.islice(itertools.product(*per), MAX_OPTIONS):
        out.append(({n: v for n, v, _ in combo}, [note for _, _, note in combo]))
    return out
