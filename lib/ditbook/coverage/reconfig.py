"""Constructor settings the forward's errors ask for (``config_repair``): when an error comes from
the instance's own configuration, the class is built again with that setting changed. One rule
per error kind, registered with ``@config_rule``: an optional dependency missing under ``if
self.config.FLAG:`` (built with FLAG=False); a list setting left None that the forward iterates
(one entry per block); rotary axes indexed past their end (one more even entry). ``Reconfigure``
carries the change from the input search to the build; it is recorded in the row's setup note."""

from __future__ import annotations

import ast
import inspect
import re

from .build import Refused, _head_dim, _is_layer_count
from .repairs import _code_tree, _model_frames, _own_none, missing_dependency, statement_text

CONFIG_RULES: list = []
RECONFIGURES = 3  # constructor changes per class at most


class Reconfigure(Refused):
    """The forward needs the instance built with ``changes`` (constructor keywords)."""

    def __init__(self, changes: dict, note: str):
        super().__init__(note)
        self.changes, self.note = changes, note


def config_rule(fn):
    CONFIG_RULES.append(fn)
    return fn


def config_repair(exc: BaseException, model) -> tuple[dict, str] | None:
    """({constructor keyword: value}, note) that addresses ``exc``, or None."""
    for fix in CONFIG_RULES:
        found = fix(exc, model)
        if found is not None:
            return found
    return None


def _ctor_defaults(cls: type) -> dict:
    try:
        sig = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v.default for k, v in sig.items() if v.default is not inspect.Parameter.empty}


def _config_flag(test) -> str | None:
    """``X`` of an ``if`` test ``self.config.X`` or ``self.X``."""
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Attribute) \
            and isinstance(test.value.value, ast.Name) and test.value.value.id == "self" and test.value.attr == "config":
        return test.attr
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self":
        return test.attr
    return None


def _guarding_flags(frame) -> list[str]:
    """The config flags of the ``if`` statements around the line ``frame`` is executing."""
    tree, start = _code_tree(frame.f_code)
    if tree is None:
        return []
    line = frame.f_lineno - max(start, 1) + 1
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in n.body):
            flag = _config_flag(n.test)
            if flag:
                out.append(flag)
    return out


@config_rule
def _flag_off_for_missing_dependency(exc, model):
    """A name an optional dependency provides, used under ``if self.config.FLAG:`` where FLAG is a
    constructor flag that defaults to True: the class's other mode, FLAG=False, runs without it."""
    why = missing_dependency(exc)
    if not why:
        return None
    owner_cls = type(model)
    defaults = _ctor_defaults(owner_cls)
    for frame in reversed(_model_frames(exc)):
        if frame.f_locals.get("self") is not model:
            continue
        for flag in _guarding_flags(frame):
            if defaults.get(flag) is True and getattr(model.config, flag, None) is True:
                return {flag: False}, (f"built with {flag}=False: {why.split(', and it is not')[0]}, under "
                                       f"`if self.config.{flag}`, and it is not installed")
    return None


@config_rule
def _list_setting_left_none(exc, model):
    """``self.config.X`` None where the forward iterates or measures it, X a constructor keyword
    that defaults to None: one index per block the constructor builds (the sum of its layer
    counts), ``[0, ..., n-1]``."""
    if not isinstance(exc, TypeError) or not any(w in str(exc) for w in ("not iterable", "has no len()",
                                                                          "not subscriptable")):
        return None
    own = _own_none(exc)
    if not own or not own.startswith("self.config."):
        return None
    name = own.split(".")[-1]
    defaults = _ctor_defaults(type(model))
    if name not in defaults or defaults[name] is not None:
        return None
    cfg = dict(model.config)
    n = sum(v for k, v in cfg.items() if _is_layer_count(k) and isinstance(v, int) and not isinstance(v, bool)
            and v > 0) or 2
    return {name: list(range(n))}, (f"built with {name}={list(range(n))}: the forward iterates "
                                    f"self.config.{name}, which the defaults leave None (one entry per block)")


def _indexed_setting(exc, model):
    """(constructor keyword, its value) of a tuple setting that a submodule stores and that the
    failing statement subscripts as ``self.A[i]`` (or as a local holding it: the submodule passed
    ``self.A`` to a helper), or None."""
    cfg = dict(model.config)
    for frame in reversed(_model_frames(exc)):
        owner = frame.f_locals.get("self")
        if owner is None:
            continue
        text = statement_text(frame)
        # ``self.axes[i]``, or a local the caller passed it as (``axes[i]``, ``axes=self.axes``)
        attrs = [(a, getattr(owner, a, None)) for a in re.findall(r"self\.(\w+)\[", text)]
        attrs += [(a, frame.f_locals.get(a)) for a in re.findall(r"(?<![\w.])(\w+)\[", text) if a != "self"]
        for attr, val in attrs:
            if not isinstance(val, (tuple, list)):
                continue
            for k, v in cfg.items():
                if isinstance(v, (tuple, list)) and list(v) == list(val):
                    return k, list(v)
    return None


@config_rule
def _one_more_axis(exc, model):
    """``tuple index out of range`` on ``self.axes[i]``, the tuple a constructor setting (rotary
    axes: one per position axis the forward's ids carry): one more entry, all entries even and
    summing to the head dim (the old sum without one), the first the largest."""
    if not isinstance(exc, IndexError) or not re.search(r"(tuple|list) index out of range", str(exc)):
        return None
    found = _indexed_setting(exc, model)
    if not found:
        return None
    name, old = found
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in old) or len(old) >= 8:
        return None
    total = _head_dim(dict(model.config)) or sum(old)
    pairs, k = total // 2, len(old) + 1
    if total % 2 or pairs < k:
        return None
    parts = [pairs // k] * k
    parts[0] += pairs - sum(parts)
    new = tuple(2 * p for p in parts)
    return {name: new}, (f"built with {name}={new}: the forward indexes one more axis of {name} than the "
                         f"defaults {tuple(old)} give (entries even, summing to the head dim {total})")
