"""Error-directed repair of the probe's inputs: when the forward raises, the traceback says
what to change. Each error kind is one small function registered with ``@rule`` (tried in the
order they are registered, ``REPAIRS``); ``repair`` returns the first fix, ``explain`` names an
error no rule addresses. Each rule is ``(exc, msg, kwargs, make, forbid, params) -> (new, note) | None``;
``forbid`` holds the fixes already tried, so none is repeated."""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap
import traceback

import torch

from .dataflow import TEXT_LEN, _source_tree, axis_role, doc_shapes

REPAIRS: list = []  # the rules ``repair`` tries, in order


def rule(fn):
    """Register ``fn`` as the next repair ``repair`` tries."""
    REPAIRS.append(fn)
    return fn

# --- helpers shared by the rules ---------------------------------------------------------------

_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")
_MISSING = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)")
_SIZE = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton "
                   r"dimension (\d+)")
_UNPACK = re.compile(r"(?:not enough|too many) values to unpack \(expected (\d+)")


def _with(kwargs: dict, name: str, value) -> dict:
    """A copy of ``kwargs`` with input ``name`` set to ``value``."""
    new = dict(kwargs)
    new[name] = value
    return new


def _remade(val: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of ``shape`` and ``val``'s dtype: random when floating, else zeros."""
    return torch.randn(shape).to(val.dtype) if val.is_floating_point() else torch.zeros(shape, dtype=val.dtype)


def _ints(text: str) -> list[int]:
    """``[1, 8, 8]`` of ``"1, 8, 8"``."""
    return [int(x) for x in text.split(",") if x.strip()]


def _code_tree(code):
    """(the AST of the function ``code`` runs, its first line), or (None, 0) without its source."""
    try:
        lines, start = inspect.getsourcelines(code)
        return ast.parse(textwrap.dedent("".join(lines))), start
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, 0


def _line_text(frame) -> str:
    """The source line a frame is executing ("" when unknown)."""
    try:
        return (inspect.getframeinfo(frame).code_context or [""])[0]
    except Exception:
        return ""


def statement_text(frame) -> str:
    """The whole statement a frame is executing (a call spread over several lines included)."""
    tree, start = _code_tree(frame.f_code)
    if tree is None:
        return _line_text(frame)
    line = frame.f_lineno - max(start, 1) + 1
    best = None
    for n in ast.walk(tree):
        if isinstance(n, ast.stmt) and not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                             ast.If, ast.For, ast.While, ast.With, ast.Try)) \
                and n.lineno <= line <= (n.end_lineno or n.lineno):
            if best is None or (n.end_lineno - n.lineno) < (best.end_lineno - best.lineno):
                best = n
    return ast.unparse(best) if best is not None else ""


def _model_frames(exc: BaseException):
    return [f for f, _ in traceback.walk_tb(exc.__traceback__)]


def _none_params(exc: BaseException, params: set[str], kwargs: dict) -> list[str]:
    """Forward parameters that are None in a frame of the failing call and that the failing line
    reads, innermost first."""
    out = []
    for frame in reversed(_model_frames(exc)):
        text = statement_text(frame)
        for name, val in frame.f_locals.items():
            if val is None and name in params and kwargs.get(name) is None and name not in out \
                    and re.search(rf"\b{re.escape(name)}\b", text):
                out.append(name)
    if not out and not _own_none(exc):
        # the None reached a helper: any parameter the model frames hold as None and we gave none
        for frame in _model_frames(exc):
            for name, val in frame.f_locals.items():
                if val is None and name in params and kwargs.get(name) is None and name not in out:
                    out.append(name)
    return out


def _own_none(exc: BaseException) -> str | None:
    """The text of a ``self.`` attribute (``self.config.x``) the failing statement reads that is
    None: the model's own unset setting, not a missing input; else None."""
    for frame in reversed(_model_frames(exc)):
        owner = frame.f_locals.get("self")
        if owner is None:
            continue
        try:
            tree = ast.parse(statement_text(frame))
        except SyntaxError:
            return None
        for n in ast.walk(tree):
            chain, x = [], n
            while isinstance(x, ast.Attribute):
                chain.append(x.attr)
                x = x.value
            if not (chain and isinstance(x, ast.Name) and x.id == "self"):
                continue
            obj = owner
            try:
                for part in reversed(chain):
                    obj = getattr(obj, part)
            except Exception:
                continue
            if obj is None:
                return ast.unparse(n)
        return None
    return None


def _failing_locals(exc: BaseException) -> list[tuple[str, object]]:
    out = []
    for frame in reversed(_model_frames(exc)):
        out += list(frame.f_locals.items())
    return out


def never_supplied(name: str) -> bool:
    """Parameters the probe never makes up: option dicts, caches, control residuals, flags."""
    low = name.lower()
    return any(w in low for w in ("kwargs", "cache", "controlnet", "return_dict", "block_samples")) \
        or low.startswith(("return", "use_", "enable_", "is_"))


def _may_supply(n: str, params, kwargs: dict, forbid: set) -> bool:
    """A forward parameter left None that the probe may make up and has not tried to yet."""
    return n in params and kwargs.get(n) is None and ("supply", n) not in forbid and not never_supplied(n)


def repair(exc: BaseException, kwargs: dict, make, forbid: set) -> tuple[dict, str] | None:
    """New keyword inputs that address ``exc`` (or None): the first fix of the rules in ``REPAIRS``;
    ``make(name, kwargs)`` builds a value for a parameter."""
    msg = str(exc)
    params = set(kwargs) | set(getattr(make, "params", ()))
    for fix in REPAIRS:
        fixed = fix(exc, msg, kwargs, make, forbid, params)
        if fixed is not None:
            return fixed
    return None

# --- the rules, in the order they are tried ----------------------------------------------------


@rule
def _supply_missing(exc, msg, kwargs, make, forbid, params):
    """``missing required argument(s) 'a', 'b'``: supply them."""
    m = _MISSING.search(msg)
    if m:
        names = re.findall(r"'(\w+)'", m.group(1))
        new = dict(kwargs)
        for n in names:
            if ("supply", n) not in forbid:
                forbid.add(("supply", n))
                new[n] = make(n, new)
        if new != kwargs:
            return new, f"supplied {names}"
    return None


@rule
def _matmul_last_dim(exc, msg, kwargs, make, forbid, params):
    """A matrix product ``(AxB and CxD)`` whose left side is an input with last dim B: make it C."""
    m = _MATMUL.search(msg)
    if m:
        a, b, c, _ = (int(x) for x in m.groups())
        for name, val in list(kwargs.items()):
            if isinstance(val, torch.Tensor) and val.is_floating_point() and val.ndim >= 2 and val.shape[-1] == b \
                    and val.numel() // b == a and (name, "last", c) not in forbid:
                forbid.add((name, "last", c))
                return _with(kwargs, name, torch.randn(tuple(val.shape[:-1]) + (c,))), f"{name}: last dim {b} -> {c}"
    return None


@rule
def _supply_none(exc, msg, kwargs, make, forbid, params):
    """A forward parameter that is None where the failing code uses it: supply it."""
    if ("NoneType" in msg or "None" in msg) and "not callable" not in msg and "must be a mapping" not in msg:
        for n in _none_params(exc, params, kwargs):
            if not _may_supply(n, params, kwargs, forbid):
                continue
            forbid.add(("supply", n))
            val = make(n, kwargs)
            if val is not None:
                return _with(kwargs, n, val), f"supplied {n}"
    return None


@rule
def _boolean_mask(exc, msg, kwargs, make, forbid, params):
    """``where`` wants a boolean condition: the mask input the failing frame holds becomes one."""
    if "where expected condition to be a boolean" in msg:
        for name, val in kwargs.items():
            if isinstance(val, torch.Tensor) and val.dtype != torch.bool and "mask" in name.lower() \
                    and (name, "bool") not in forbid \
                    and any(v is val for _, v in _failing_locals(exc)):
                forbid.add((name, "bool"))
                return _with(kwargs, name, val != 0), f"{name}: a boolean mask"
    return None


@rule
def _supply_named(exc, msg, kwargs, make, forbid, params):
    """The error message names a forward parameter: supply it when missing."""
    for n in re.findall(r"[`'\"](\w+)[`'\"]", msg):
        if _may_supply(n, params, kwargs, forbid):
            forbid.add(("supply", n))
            val = make(n, kwargs)
            if val is not None:
                return _with(kwargs, n, val), f"supplied {n} (named by the error)"
    return None


def dict_inputs(model) -> list[str]:
    """The forward's dict/Mapping-annotated parameters the probe may fill (not ``never_supplied``)."""
    try:
        sig = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.items() if any(w in str(p.annotation).lower() for w in ("dict", "mapping"))
            and not never_supplied(n)]


_SAFE_KEY_NODES = (ast.Expression, ast.Name, ast.Constant, ast.Subscript, ast.Attribute, ast.Load, ast.Index)


def missing_key(exc: BaseException) -> str | None:
    """The string key a ``KeyError`` is about: one a failing statement subscripts with, else that of a
    failing frame's ``x = d.get(KEY)`` that gave None (``KEY`` evaluated in that frame)."""
    if not isinstance(exc, KeyError) or not exc.args or not isinstance(exc.args[0], str):
        return None
    key = exc.args[0]
    frames = _model_frames(exc)
    for frame in reversed(frames):
        if re.search(rf"""\[\s*['"]{re.escape(key)}['"]\s*\]""", statement_text(frame)):
            return key
    for frame in reversed(frames[-2:]):
        _, node = _source_tree(frame.f_code)
        for n in ast.walk(node) if node is not None else ():
            if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                    and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
                    and n.value.func.attr == "get" and n.value.args
                    and n.targets[0].id in frame.f_locals and frame.f_locals[n.targets[0].id] is None):
                continue
            expr = ast.Expression(n.value.args[0])
            if not all(isinstance(x, _SAFE_KEY_NODES) for x in ast.walk(expr)):
                continue
            try:
                found = eval(compile(expr, "<key>", "eval"), dict(frame.f_globals), dict(frame.f_locals))  # noqa: S307
            except Exception:  # noqa: BLE001 - not evaluable here: no key
                continue
            if isinstance(found, str):
                return found
    return None


def _per_token_like(exc, kwargs: dict) -> torch.Tensor | None:
    """What a missing named feature is shaped like: the first other tensor the failing statement
    reads, else the forward's first 2-D tensor input (a ``(batch, tokens)`` mask)."""
    for frame in reversed(_model_frames(exc)):
        text = statement_text(frame)
        for name, val in frame.f_locals.items():
            if isinstance(val, torch.Tensor) and val.ndim >= 1 and re.search(rf"\b{re.escape(name)}\b", text):
                return val
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.ndim == 2), None)


@rule
def _missing_dict_key(exc, msg, kwargs, make, forbid, params):
    """A ``KeyError`` for a named feature (``missing_key``, not a forward parameter) the forward reads
    from its one dict input: that input gets the key, zeros like ``_per_token_like``."""
    model = getattr(make, "model", None)
    key = missing_key(exc)
    if model is None or key is None or key in params:
        return None
    dicts = dict_inputs(model)
    like = _per_token_like(exc, kwargs)
    if len(dicts) != 1 or like is None or (dicts[0], "key", key) in forbid:
        return None
    forbid.add((dicts[0], "key", key))
    value = {**(kwargs.get(dicts[0]) or {}), key: torch.zeros_like(like)}
    return _with(kwargs, dicts[0], value), f"{dicts[0]}[{key!r}]: zeros {list(like.shape)} (a key the forward reads)"


def _leaves(kwargs: dict):
    """(input name, key or None, tensor): the tensor inputs and the tensors of dict inputs."""
    for name, val in kwargs.items():
        if isinstance(val, torch.Tensor):
            yield name, None, val
        elif isinstance(val, dict):
            for k, v in val.items():
                if isinstance(v, torch.Tensor):
                    yield name, k, v


@rule
def _embedding_range(exc, msg, kwargs, make, forbid, params):
    """``index out of range in self`` from an embedding lookup whose indices are an input (or a
    dict input's tensor; by identity, else equal values): it becomes zeros (in every table)."""
    if "index out of range in self" not in msg:
        return None
    frames = _model_frames(exc)
    idx = frames[-1].f_locals.get("input") if frames else None
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point():
        return None
    for name, key, val in _leaves(kwargs):
        if (val is idx or (val.shape == idx.shape and torch.equal(val.long(), idx))) \
                and (name, "range", key) not in forbid:
            forbid.add((name, "range", key))
            zeros = torch.zeros(val.shape, dtype=torch.long)
            new = _with(kwargs, name, zeros if key is None else {**kwargs[name], key: zeros})
            return new, f"{name}{'' if key is None else f'[{key!r}]'}: zeros (indices into an embedding table)"
    return None


@rule
def _integer_indices(exc, msg, kwargs, make, forbid, params):
    """Indices must be integers: the float input the failing frame holds becomes long zeros."""
    low_msg = msg.lower()
    if "indices" in low_msg and ("long" in low_msg or "int" in low_msg):
        for name, val in kwargs.items():
            if isinstance(val, torch.Tensor) and val.is_floating_point() and (name, "long") not in forbid:
                if any(v is val for _, v in _failing_locals(exc)):
                    return _as_long_zeros(kwargs, name, forbid, f"{name}: integer indices")
    return None


def _as_long_zeros(kwargs: dict, name: str, forbid: set, note: str) -> tuple[dict, str]:
    """``kwargs`` with input ``name`` made long zeros of its shape (once per input: ``forbid``)."""
    forbid.add((name, "long"))
    return _with(kwargs, name, torch.zeros(kwargs[name].shape, dtype=torch.long)), note


def _held(v, named: list) -> bool:
    """``v`` (a tensor, or a list of tensors: one per sample) is, or holds, one of ``named``."""
    if isinstance(v, torch.Tensor):  # itself, or one of its rows (a loop or zip over its first axis)
        return any(v is x or (isinstance(x, torch.Tensor) and v.ndim >= 2 and x.shape == v.shape[1:]
                              and x.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()) for x in named)
    return isinstance(v, list) and bool(v) and all(isinstance(x, torch.Tensor) for x in v) \
        and any(x is y for x in v for y in named)


@rule
def _like_concatenated(exc, msg, kwargs, make, forbid, params):
    """A concatenation of an input with another: make the one we made up like the other."""
    if "Sizes of tensors must match" in msg or "same number of dimensions" in msg:
        for frame in reversed(_model_frames(exc)):
            text = _line_text(frame)
            if "cat(" not in text and "stack(" not in text:
                continue
            named = [lv for ln, lv in frame.f_locals.items() if re.search(rf"\b{re.escape(ln)}\b", text)]
            present = [(n, v) for n, v in kwargs.items() if _held(v, named)]
            first = getattr(make, "first", None)
            for name, val in sorted(present, key=lambda nv: nv[0] == first):
                others = [v for n, v in present if n != name]
                if name != first and others and (name, "like") not in forbid:
                    forbid.add((name, "like"))
                    if isinstance(val, list):  # per-sample lists zipped together: each item like the other's
                        value = [torch.randn(o.shape).to(x.dtype) for x, o in zip(val, list(others[0]))]
                    else:
                        value = torch.randn(others[0].shape).to(val.dtype)
                    return _with(kwargs, name, value), f"{name}: shaped like the tensor it is concatenated with"
            break
    return None


@rule
def _size_mismatch(exc, msg, kwargs, make, forbid, params):
    """Sizes ``a`` and ``b`` differ at dim ``d``: the input the failing frame holds takes the other (a
    lower-rank input right-aligned: a ``(B, S)`` mask against ``(B, H, S, S)`` scores)."""
    m = _SIZE.search(msg)
    if m:
        a, b, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
        held = [lv for _, lv in _failing_locals(exc) if isinstance(lv, torch.Tensor)]
        rank = max([t.ndim for t in held], default=0)
        seen_ids = set()
        for lv in held:
            if id(lv) in seen_ids:
                continue
            seen_ids.add(id(lv))
            for name, val in kwargs.items():
                k = d if val is lv and val.ndim > d else d - (rank - val.ndim) if val is lv and rank > d else -1
                if k >= 0 and val.shape[k] in (a, b) and (name, "dim", d) not in forbid:
                    forbid.add((name, "dim", d))
                    shape = list(val.shape)
                    shape[k] = b if shape[k] == a else a
                    return _with(kwargs, name, _remade(val, shape)), f"{name}: dim {k} {val.shape[k]} -> {shape[k]}"
    return None


_MASKED = re.compile(r"value tensor of shape \[([\d, ]*)\] cannot be broadcast to indexing result of shape "
                     r"\[([\d, ]+)\]")


@rule
def _masked_count(exc, msg, kwargs, make, forbid, params):
    """``x[:, mask] = v`` selecting another number of rows than ``v`` has: the boolean input the mask
    expands from (``k`` positions per True) is True at its last ``rows / k`` positions."""
    m = _MASKED.search(msg)
    if not m:
        return None
    value, result = _ints(m.group(1)), _ints(m.group(2))
    masks = [lv for _, lv in _failing_locals(exc) if isinstance(lv, torch.Tensor) and lv.dtype == torch.bool]
    for name, val in kwargs.items():
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or not val.any() or (name, "count") in forbid:
            continue
        have = int(val.reshape(-1, val.shape[-1])[0].sum())
        for sel in {int(mk.sum()) for mk in masks}:
            d, off = (result.index(sel) if sel in result else -1), len(result) - len(value)
            rows = value[d - off] if d >= off >= 0 and d >= 0 else 0
            k = sel // have if sel % have == 0 else 0
            if not k or not rows or rows % k or rows // k > val.shape[-1]:
                continue
            forbid.add((name, "count"))
            mask = torch.zeros_like(val)
            mask[..., val.shape[-1] - rows // k:] = True
            return _with(kwargs, name, mask), f"{name}: True at its last {rows // k} of {val.shape[-1]} positions"
    return None


def _grid_rows(val) -> list | None:
    """The per-sample lists of ``(frames, height, width)`` tuples of a ``list[list[tuple]]`` (or one
    ``list[tuple]``) input, else None."""
    def is_grid(t):
        return isinstance(t, tuple) and t and all(isinstance(x, int) and not isinstance(x, bool) for x in t)

    if isinstance(val, list) and val and all(is_grid(t) for t in val):
        return [val]
    if isinstance(val, list) and val and all(isinstance(r, list) and r and all(is_grid(t) for t in r) for r in val):
        return val
    return None


@rule
def _grid_token_count(exc, msg, kwargs, make, forbid, params):
    """A grid-list input the error names whose token count (the sum of its grids' products) differs
    from another number of the message: the last grid's frames axis takes the difference."""
    nums = [int(x) for x in re.findall(r"\b\d+\b", msg)]
    for name, val in kwargs.items():
        rows = _grid_rows(val)
        if rows is None or not re.search(rf"\b{name}\b", msg) or (name, "tokens") in forbid:
            continue
        total = sum(math.prod(t) for t in rows[0])
        rest, last = total - math.prod(rows[0][-1]), rows[0][-1]
        for want in (n for n in nums if n != total and total in nums):
            per = math.prod(last[1:])
            if want > rest and (want - rest) % per == 0:
                forbid.add((name, "tokens"))
                grid = ((want - rest) // per,) + tuple(last[1:])
                value = [r[:-1] + [grid] for r in rows] if rows is val else rows[0][:-1] + [grid]
                return _with(kwargs, name, value), f"{name}: last grid {last} -> {grid} ({want} tokens)"
    return None


_REPEATS = re.compile(r"repeats must have the same size as input along dim, but got repeats\.size\(0\) = (\d+) "
                      r"and input\.size\(\d+\) = (\d+)")


def _computed_from(frame, size: int, kwargs: dict) -> list[str]:
    """Inputs that a 1-D tensor of ``size`` the frame's failing statement reads is computed from
    (the names on the right of the statement in the frame's function that assigns it)."""
    try:
        used = {n.id for n in ast.walk(ast.parse(statement_text(frame).strip())) if isinstance(n, ast.Name)}
    except SyntaxError:
        return []
    _, node = _source_tree(frame.f_code)
    out = []
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in used for t in n.targets):
            lv = frame.f_locals.get(next(t.id for t in n.targets if isinstance(t, ast.Name) and t.id in used))
            if isinstance(lv, torch.Tensor) and lv.ndim == 1 and lv.shape[0] == size:
                out += [m.id for m in ast.walk(n.value) if isinstance(m, ast.Name) and m.id in kwargs
                        and m.id not in out]
    return out


@rule
def _repeats_length(exc, msg, kwargs, make, forbid, params):
    """``repeat_interleave`` counts for an input of another length: the input the counts are computed
    from takes that length, keeping its last positions (a mask True at its end stays so)."""
    m = _REPEATS.search(msg)
    if not m:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    for name in (n for f in reversed(_model_frames(exc)) for n in _computed_from(f, a, kwargs)):
        val = kwargs[name]
        if not isinstance(val, torch.Tensor) or val.shape[-1] != a or (name, "repeats") in forbid:
            continue
        forbid.add((name, "repeats"))
        if b <= a:
            value = val[..., a - b:].clone()
        else:
            value = torch.cat([torch.zeros(*val.shape[:-1], b - a, dtype=val.dtype), val], dim=-1)
        return _with(kwargs, name, value), f"{name}: last dim {a} -> {b} (one repeat count per position)"
    return None


@rule
def _unpack_rank(exc, msg, kwargs, make, forbid, params):
    """A tensor unpacked into more or fewer names than its rank: remake it with that rank."""
    m = _UNPACK.search(msg)
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    want, frame = int(m.group(1)), frames[-1]
    sm = re.search(r"=\s*(\w+)\.(?:shape|size\(\))", _line_text(frame))
    if not sm:
        return None
    local = frame.f_locals.get(sm.group(1))
    for name, val in kwargs.items():
        if val is local and isinstance(val, torch.Tensor) and (name, "rank", want) not in forbid:
            forbid.add((name, "rank", want))
            value = make(name, kwargs, rank=want, **_unpacked_roles(make, frame, want))
            if value is not None:
                return _with(kwargs, name, value), f"{name}: rank {want}"
    return None


def _unpacked_roles(make, frame, want: int) -> dict:
    """``{"roles": [...]}``: the axis roles the failing unpack's target names tell
    (``batch_size, num_frames = t.shape``: batch, frames), when ``make`` takes them."""
    try:
        if "roles" not in inspect.signature(make).parameters:
            return {}
        stmt = ast.parse(statement_text(frame)).body[0]
    except (TypeError, ValueError, SyntaxError, IndexError):
        return {}
    if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple) and len(stmt.targets[0].elts) == want:
        roles = [axis_role(e.id) if isinstance(e, ast.Name) else None for e in stmt.targets[0].elts]
        if any(r not in (None, "batch") for r in roles):
            return {"roles": roles}
    return {}


@rule
def _supply_guarded(exc, msg, kwargs, make, forbid, params):
    """``UnboundLocalError``: the code sets the local only under a condition on optional inputs
    (``if latents is not None: x = ...``): supply the None forward parameters the condition tests."""
    if not isinstance(exc, UnboundLocalError):
        return None
    m = re.search(r"local variable '(\w+)'", msg)
    frames = _model_frames(exc)
    tree = _code_tree(frames[-1].f_code)[0] if m and frames else None
    if tree is None:
        return None
    local = m.group(1)
    tested: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and any(isinstance(t, ast.Name) and t.id == local
                                         for b in n.body for a in ast.walk(b) if isinstance(a, ast.Assign)
                                         for t in a.targets for t in ast.walk(t)):
            tested += [x.id for x in ast.walk(n.test) if isinstance(x, ast.Name) and x.id not in tested]
    new = dict(kwargs)
    supplied = []
    for n in tested:
        if _may_supply(n, params, kwargs, forbid):
            forbid.add(("supply", n))
            val = make(n, new)
            if val is not None:
                new[n] = val
                supplied.append(n)
    return (new, f"supplied {supplied}: the condition that sets {local!r} tests them") if supplied else None


@rule
def _grid_as_positions(exc, msg, kwargs, make, forbid, params):
    """An int grid we made up (``tuple[int, int, int]``) whose elements the failing function uses
    as indices (``table[pos[0]]``): one range of positions per axis instead, once per made-up value."""
    frames = _model_frames(exc)
    tree = _code_tree(frames[-1].f_code)[0] if frames else None
    if tree is None:
        return None
    # names whose elements index something in the failing function: ``table[pos[0]]``
    indexing = {n.slice.value.id for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                and isinstance(n.slice, ast.Subscript) and isinstance(n.slice.value, ast.Name)}
    held = {id(v) for k, v in frames[-1].f_locals.items() if k in indexing}
    for name, val in kwargs.items():
        if isinstance(val, (tuple, list)) and val and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                          for x in val) \
                and id(val) in held and (name, "positions", id(val)) not in forbid:
            forbid.add((name, "positions", id(val)))  # once per made-up value (a regrid makes it again)
            return _with(kwargs, name, [torch.arange(x) for x in val]), f"{name}: one range of positions per axis"
    return None


def missing_dependency(exc: BaseException) -> str | None:
    """The reason, when a ``NameError``'s name is imported by the failing module only under a
    condition (``if is_x_available():``): the optional dependency is missing; else None."""
    if not isinstance(exc, NameError) or not getattr(exc, "name", None):
        return None
    frames = _model_frames(exc)
    if not frames:
        return None
    mod = inspect.getmodule(frames[-1].f_code)
    try:
        tree = ast.parse(inspect.getsource(mod)) if mod is not None else None
    except (OSError, TypeError, SyntaxError):
        return None
    for n in ast.walk(tree) if tree is not None else ():
        if isinstance(n, (ast.If, ast.Try)):
            for imp in (x for b in n.body for x in ast.walk(b) if isinstance(x, (ast.Import, ast.ImportFrom))):
                for alias in imp.names:
                    if (alias.asname or alias.name).split(".")[0] == exc.name:
                        src = imp.module if isinstance(imp, ast.ImportFrom) else alias.name
                        return (f"the forward uses {exc.name!r}, which {mod.__name__} imports from {src!r} only when "
                                f"that optional dependency is installed, and it is not")
    return None


_VIEW = re.compile(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)")


@rule
def _view_multiple(exc, msg, kwargs, make, forbid, params):
    """``x.view(-1, K)`` of an input the failing statement names whose elements do not fill rows
    of K: the input with as many values per sample as fill one row (``image_meta_size`` as 6)."""
    m = _VIEW.search(msg)
    if not m:
        return None
    dims = _ints(m.group(1))
    total = int(m.group(2))
    if dims.count(-1) != 1:
        return None
    row = -math.prod(dims)
    frames = _model_frames(exc)
    named = set(re.findall(r"\w+", statement_text(frames[-1]))) if frames else set()
    for name, val in kwargs.items():
        if name not in named or not isinstance(val, torch.Tensor) or val.ndim not in (1, 2) or not val.numel() \
                or total % val.numel() or (name, "view") in forbid:
            continue
        each = total // val.numel()  # what the code made of one value
        per = (row * each // math.gcd(row, each)) // each  # values that fill one row
        forbid.add((name, "view"))
        fill = val.flatten()[0].item()
        value = torch.full((1, per) if val.ndim == 2 else (per,), fill, dtype=val.dtype)
        return _with(kwargs, name, value), f"{name}: {per} values per sample (a row of {row})"
    return None


_CAT_SIZES = re.compile(r"Sizes of tensors must match except in dimension (-?\d+)\. Expected size (\d+) but got "
                        r"size (\d+) for tensor number (\d+)")


@rule
def _cat_operand_size(exc, msg, kwargs, make, forbid, params):
    """``torch.cat([ours, theirs], dim=D)`` with ``theirs`` computed by the code: the input among
    the operands takes the other operand's size on the axis that differs."""
    m = _CAT_SIZES.search(msg)
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    cat_dim, x, y, k = (int(g) for g in m.groups())
    frame = frames[-1]
    try:
        stmt = ast.parse(statement_text(frame))
    except SyntaxError:
        return None
    lists = [c.args[0] for c in ast.walk(stmt) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and c.func.attr in ("cat", "concat", "concatenate") and c.args and isinstance(c.args[0], (ast.List, ast.Tuple))]
    if not lists:
        return None
    names = [e.id if isinstance(e, ast.Name) else None for e in lists[0].elts]
    for pos, want_from, want_to in ((0, x, y), (k, y, x)):
        if pos >= len(names) or names[pos] is None:
            continue
        local = frame.f_locals.get(names[pos])
        for name, val in kwargs.items():
            if val is not local or not isinstance(val, torch.Tensor) or (name, "cat", want_to) in forbid:
                continue
            axes = [d for d in range(val.ndim) if val.shape[d] == want_from and d != cat_dim % val.ndim]
            if not axes:
                continue
            forbid.add((name, "cat", want_to))
            shape = list(val.shape)
            shape[axes[-1]] = want_to
            return _with(kwargs, name, _remade(val, shape)), \
                f"{name}: dim {axes[-1]} {want_from} -> {want_to} (like the tensor it is concatenated with)"
    return None


_CHANNELS = re.compile(r"expected input\[([\d, ]+)\] to have (\d+) channels, but got (\d+) channels")


def _output_width(model) -> int | None:
    """The width of the model's last layer (its output's channels)."""
    last = None
    for m in model.modules():
        w = getattr(m, "out_channels", None) or getattr(m, "out_features", None)
        if isinstance(w, int) and not list(m.children()):
            last = w
    return last


@rule
def _split_concat_channels(exc, msg, kwargs, make, forbid, params):
    """An embedding expecting C channels gets the noisy input (the forward's first) concatenated with
    one other input: the noisy input keeps the model's output width, the other takes the rest of C."""
    m = _CHANNELS.search(msg)
    model = getattr(make, "model", None)
    first = getattr(make, "first", None)
    if not m or model is None or first not in kwargs:
        return None
    want = int(m.group(2))
    out_w = _output_width(model)
    if not out_w or out_w >= want:  # the last layer writes patches: the config's output channels
        cfg = dict(getattr(model, "config", {}) or {})
        out_w = next((v for k in ("out_channels", "out_dim") for v in [cfg.get(k)]
                      if isinstance(v, int) and not isinstance(v, bool)), None)
    if not out_w or out_w >= want:
        return None
    for frame in reversed(_model_frames(exc)):
        tree, _ = _code_tree(frame.f_code)
        for c in ast.walk(tree) if tree is not None else ():
            if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in ("cat", "concat")
                    and c.args and isinstance(c.args[0], (ast.List, ast.Tuple))):
                continue
            aliases = _loop_aliases(tree)
            locs = [e.id for e in c.args[0].elts if isinstance(e, ast.Name)]
            names = [n for n in (_input_of(x, frame, kwargs, aliases) for x in locs) if n is not None]
            dim = next((k.value.value if isinstance(k.value, ast.Constant) else
                        -k.value.operand.value if isinstance(k.value, ast.UnaryOp) else None
                        for k in c.keywords if k.arg == "dim"), None)
            others = [n for n in names if n != first and _tensors(kwargs.get(n))]
            if first not in names or len(others) != 1 or not isinstance(dim, int) \
                    or (others[0], "split", want) in forbid:
                continue
            other = others[0]
            forbid.add((other, "split", want))
            new = dict(kwargs)
            for n, w in ((first, out_w), (other, want - out_w)):
                new[n] = _with_width(kwargs[n], dim, w, per_item=n not in locs)
            return new, f"{first}: width {out_w} (the output's), {other}: the other {want - out_w} of {want}"


def _tensors(v) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, list) and bool(v) and all(isinstance(x, torch.Tensor) for x in v))


def _loop_aliases(tree) -> dict:
    """{loop variable: the name it iterates}: ``for u in xs`` and ``for u, v in zip(xs, ys)``, in
    statements and comprehensions."""
    out = {}
    for n in ast.walk(tree):
        if not isinstance(n, (ast.For, ast.comprehension)):
            continue
        targets = n.target.elts if isinstance(n.target, ast.Tuple) else [n.target]
        it = n.iter
        iters = it.args if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" else [it]
        if len(iters) == len(targets):
            for t, i in zip(targets, iters):
                if isinstance(t, ast.Name) and isinstance(i, ast.Name):
                    out.setdefault(t.id, i.id)
    return out


def _input_of(local: str, frame, kwargs: dict, aliases: dict) -> str | None:
    """The forward input a local of ``frame`` is (by name), or is an item or row of (a loop over
    a per-sample list or over a tensor's first axis)."""
    if local in kwargs:
        return local
    if aliases.get(local) in kwargs:
        return aliases[local]
    val = frame.f_locals.get(local)
    if not isinstance(val, torch.Tensor):
        return None
    return next((n for n, v in kwargs.items() if _tensors(v) and _held(v, [val])), None)


def _with_width(val, dim: int, width: int, per_item: bool):
    """``val`` made again with ``width`` along ``dim`` of each item (a list's items, a tensor's
    rows when ``per_item``) or of the tensor itself."""
    if isinstance(val, list):
        return [_with_width(x, dim, width, False) for x in val]
    shape = list(val.shape)
    shape[dim + 1 if per_item and dim >= 0 else dim] = width
    return torch.randn(shape)


_NORM_SHAPE = re.compile(r"normalized_shape=\[(\d+)\], expected input with shape \[\*,? ?\d+\], but got input of "
                         r"size\s?\[([\d, ]+)\]")


def _input_held(exc, kwargs) -> list[tuple[str, torch.Tensor]]:
    """The tensor inputs some frame of the failing call holds (by identity), innermost first."""
    out, seen = [], set()
    for _, lv in _failing_locals(exc):
        for name, val in kwargs.items():
            if val is lv and isinstance(val, torch.Tensor) and name not in seen:
                seen.add(name)
                out.append((name, val))
    return out


@rule
def _reshaped_last_dim(exc, msg, kwargs, make, forbid, params):
    """A Linear or a norm rejects a reshape of an input (its last dim L folded ``B / L`` times into a
    row of B, e.g. a patchify view) wanting width C: the input's last dim becomes ``L * C / B``."""
    m, n = _MATMUL.search(msg), _NORM_SHAPE.search(msg)
    if m:
        rows, b, c = int(m.group(1)), int(m.group(2)), int(m.group(3))
    elif n:
        size = _ints(n.group(2))
        c, b, rows = int(n.group(1)), size[-1], math.prod(size[:-1])
    else:
        return None
    for name, val in _input_held(exc, kwargs):
        last = val.shape[-1] if val.ndim else 0
        if not val.is_floating_point() or val.ndim < 2 or val.numel() != rows * b or not last or b % last \
                or (c * last) % b or (name, "last", c * last // b) in forbid:
            continue
        want = c * last // b
        forbid.add((name, "last", want))
        new = _with(kwargs, name, torch.randn(tuple(val.shape[:-1]) + (want,)))
        return new, f"{name}: last dim {last} -> {want} (a reshape of it meets a width {c})"
    return None


_TUPLE_DOC = re.compile(r"`?\(([\w ,]+)\)`? tuples")


@rule
def _iterated_tuples(exc, msg, kwargs, make, forbid, params):
    """``for a, b in <input>``: the input becomes a list of one N-tuple; items named like a mask (by
    the loop or the docstring's ``(encoding, mask) tuples``) are (batch, text) ones, others states."""
    m = _UNPACK.search(msg)
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    want = int(m.group(1))
    for frame, n in _unpacking_loops(frames[-2:], want):
        local = frame.f_locals.get(n.iter.id)
        name = next((k for k, v in kwargs.items() if v is local and isinstance(v, torch.Tensor)), None)
        if name is None or (name, "tuples", want) in forbid:
            continue
        forbid.add((name, "tuples", want))
        names = [e.id if isinstance(e, ast.Name) else "" for e in n.target.elts]
        doc = _TUPLE_DOC.search(_param_doc(frame, name))
        if doc and len(doc.group(1).split(",")) == want:
            names = [x.strip() for x in doc.group(1).split(",")]
        text = getattr(getattr(make, "grid", None), "text", TEXT_LEN)
        width = getattr(getattr(make, "grid", None), "channels", 4)
        item = tuple(torch.ones(1, text) if "mask" in x.lower() else torch.randn(1, text, width) for x in names)
        return _with(kwargs, name, [item]), f"{name}: a list of {want}-tuples {tuple(names)}"
    return None


def _unpacking_loops(frames, want: int):
    """(frame, loop node) of each ``for a, b, ... in <name>`` with ``want`` names in the statements
    the frames run (a comprehension runs in a frame of its own: its caller's statement holds it)."""
    for frame in reversed(frames):
        try:
            tree = ast.parse(statement_text(frame))
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.comprehension, ast.For)) and isinstance(n.target, ast.Tuple) \
                    and len(n.target.elts) == want and isinstance(n.iter, ast.Name):
                yield frame, n


def _param_doc(frame, name: str) -> str:
    """The docstring paragraph of parameter ``name`` of the function a frame runs."""
    doc = frame.f_code.co_consts[0] if frame.f_code.co_consts and isinstance(frame.f_code.co_consts[0], str) else ""
    m = re.search(rf"^\s*{re.escape(name)} \(.*?(?=^\s*\w+ \(|\Z)", doc, re.M | re.S)
    return m.group(0) if m else ""


def _flat_leaves(kwargs: dict) -> dict:
    """``{"x[0]": t, "pairs[0][1]": u}``: the tensors inside list/tuple inputs, by their path."""
    out = {}

    def walk(key, val):
        if isinstance(val, torch.Tensor):
            out[key] = val
        elif isinstance(val, (list, tuple)):
            for i, v in enumerate(val):
                walk(f"{key}[{i}]", v)

    for name, val in kwargs.items():
        if isinstance(val, (list, tuple)):
            walk(name, val)
    return out


def _path(key: str) -> tuple[str, list[int]]:
    name = key.split("[", 1)[0]
    return name, [int(i) for i in re.findall(r"\[(\d+)\]", key)]


def _put(val, idx: list, new):
    if not idx:
        return new
    items = list(val)
    items[idx[0]] = _put(items[idx[0]], idx[1:], new)
    return type(val)(items) if isinstance(val, tuple) else items


@rule
def _nested_inputs(exc, msg, kwargs, make, forbid, params):
    """Tensors inside list/tuple inputs (one per sample, ``(encoding, mask)`` pairs) get the shape
    repairs top-level tensors get; a per-sample element is made like one sample of a batch."""
    flat = _flat_leaves(kwargs)
    if not flat:
        return None

    def make_leaf(key, kw, rank=None):
        name, idx = _path(key)
        if rank is None:
            return None
        val = make(name, kwargs, rank=rank + 1 if len(idx) == 1 else rank)
        if isinstance(val, torch.Tensor) and len(idx) == 1 and val.ndim == rank + 1 and val.shape[0] == 1:
            val = val[0]
        return val if isinstance(val, torch.Tensor) and val.ndim == rank else None

    for rule in (_matmul_last_dim, _integer_indices, _boolean_mask, _size_mismatch, _unpack_rank,
                 _reshaped_last_dim, _last_axis_width):
        fixed = rule(exc, msg, flat, make_leaf, forbid, set(flat))
        if fixed is None:
            continue
        new_flat, note = fixed
        new, changed = dict(kwargs), False
        for key, val in new_flat.items():
            if val is not flat.get(key):
                name, idx = _path(key)
                new[name], changed = _put(new[name], idx, val), True
        if changed:
            return new, note
    return None


def last_axis_mismatch(exc) -> tuple | None:
    """(a, b, d) when a size mismatch is on the last axis of the tensors the innermost frame holds
    (a feature width, e.g. a norm's weight against its input), not on a sequence axis."""
    m = _SIZE.search(str(exc))
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    a, b, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    tensors = [v for v in frames[-1].f_locals.values() if isinstance(v, torch.Tensor)]
    on_last = any(t.ndim - 1 == d and t.shape[d] in (a, b) for t in tensors)
    elsewhere = any(t.ndim - 1 > d and t.shape[d] in (a, b) for t in tensors)
    return (a, b, d) if on_last and not elsewhere else None


@rule
def _last_axis_width(exc, msg, kwargs, make, forbid, params):
    """A width mismatch on the last axis (``last_axis_mismatch``) of a tensor that is an input or
    holds an input's elements (a concatenation, a view): the input's last dim takes the other width."""
    found = last_axis_mismatch(exc)
    if not found:
        return None
    a, b, _ = found
    frames = _model_frames(exc)
    locals_ = [v for v in frames[-1].f_locals.values() if isinstance(v, torch.Tensor)]
    same = [(n, v, loc) for n, v in kwargs.items() for loc in locals_ if isinstance(v, torch.Tensor)
            and v.is_floating_point() and v.ndim >= 2 and loc.shape[-1] == v.shape[-1] and v.shape[-1] in (a, b)
            and v.numel() <= loc.numel()]
    # the same elements first, then a padded concatenation of them (more rows, same width)
    for name, val, loc in sorted(same, key=lambda x: x[1].numel() != x[2].numel()):
        want = b if val.shape[-1] == a else a
        if (name, "last", want) in forbid:
            continue
        forbid.add((name, "last", want))
        new = _with(kwargs, name, torch.randn(tuple(val.shape[:-1]) + (want,)))
        return new, f"{name}: last dim {val.shape[-1]} -> {want} (a width its consumer fixes)"
    return None


_NAME_NOISE = {"num", "hidden", "states", "n", "size", "len", "length", "of", "input", "inputs"}


def int_input_size(exc, kwargs: dict) -> tuple[str, int] | None:
    """(name, size) when a size mismatch sets an int input (``audio_num_frames``) against a tensor
    input sharing a word of its name (``audio_hidden_states``): the int takes the tensor's size."""
    m = _SIZE.search(str(exc))
    if not m:
        return None
    a, b, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    best, score = None, 0
    for iname, ival in kwargs.items():
        if isinstance(ival, bool) or not isinstance(ival, int) or ival not in (a, b):
            continue
        other = b if ival == a else a
        words = set(iname.lower().split("_")) - _NAME_NOISE
        for tname, t in kwargs.items():
            if isinstance(t, torch.Tensor) and t.ndim > d and t.shape[d] == other:
                sc = len(words & (set(tname.lower().split("_")) - _NAME_NOISE))
                if sc > score:
                    best, score = (iname, other), sc
    return best


@rule
def _int_input_size(exc, msg, kwargs, make, forbid, params):
    """See ``int_input_size``."""
    found = int_input_size(exc, kwargs)
    if not found or (found[0], "int", found[1]) in forbid:
        return None
    forbid.add((found[0], "int", found[1]))
    note = f"{found[0]}: {kwargs[found[0]]} -> {found[1]} (the size of the tensor it describes)"
    return _with(kwargs, found[0], found[1]), note


_EXPECTED_TUPLE = re.compile(r"has (?:shape|resolution|size) \(([\d, ]+)\),? but (?:is |was )?expected (?:to have )?"
                             r"(?:shape |resolution |size )?\(([\d, ]+)\)")


@rule
def _expected_tuple(exc, msg, kwargs, make, forbid, params):
    """``... has resolution (8, 8) but is expected to have resolution (64, 64)``: the input the failing
    frames hold whose axes read (8, 8) (the last such run of axes) gets (64, 64) there."""
    m = _EXPECTED_TUPLE.search(msg)
    if not m:
        return None
    have, want = _ints(m.group(1)), _ints(m.group(2))
    if len(have) != len(want) or not have or any(w > 4096 for w in want):
        return None
    low = msg.lower().replace("_", " ")
    named = [(n, v) for n, v in kwargs.items() if isinstance(v, torch.Tensor) and n.replace("_", " ") in low]
    for name, val in _input_held(exc, kwargs) + named:  # held by the failing frames, or named by the message
        shape = list(val.shape)
        for start in range(len(shape) - len(have), -1, -1):
            if shape[start:start + len(have)] == have and (name, "axes", tuple(want)) not in forbid:
                forbid.add((name, "axes", tuple(want)))
                shape[start:start + len(have)] = want
                return _with(kwargs, name, _remade(val, shape)), \
                    f"{name}: axes {tuple(have)} -> {tuple(want)} (the error's expected shape)"
    return None


@rule
def _conv_channels(exc, msg, kwargs, make, forbid, params):
    """A convolution wants C channels and gets G from an input or a reshape of it (same element
    count; frames folded into the batch): the input's axis of size G (axis 1 first) becomes C."""
    m = _CHANNELS.search(msg)
    if not m:
        return None
    seen = _ints(m.group(1))
    want, got = int(m.group(2)), int(m.group(3))
    held = _input_held(exc, kwargs)
    others = [(n, v) for n, v in kwargs.items() if isinstance(v, torch.Tensor) and all(n != h for h, _ in held)]
    for name, val in held + others:
        if val.numel() != math.prod(seen) or val.ndim < 2 or (name, "channels", want) in forbid:
            continue
        axes = [i for i in range(1, val.ndim) if val.shape[i] == got]
        if not axes:
            continue
        forbid.add((name, "channels", want))
        shape = list(val.shape)
        shape[axes[0]] = want
        return _with(kwargs, name, _remade(val, shape)), \
            f"{name}: axis {axes[0]} {got} -> {want} (a convolution's channels)"
    return None


@rule
def _documented_symbol(exc, msg, kwargs, make, forbid, params):
    """The message gives a documented size symbol's value (``... for seq_len=8``) and names inputs
    (in backticks) documented with that symbol (``of shape `(seq_len,)```): each gets that size there."""
    model = getattr(make, "model", None)
    values = {k: int(v) for k, v in re.findall(r"\b(\w+)\s*=\s*(\d+)\b", msg)}
    if model is None or not values:
        return None
    dims = {n: [p.strip() for p in d.split(",") if p.strip()] for n, d in doc_shapes(type(model).forward)}
    named = set(re.findall(r"`(\w+)`", msg))
    new, notes = dict(kwargs), []
    for name in sorted(named):
        val = kwargs.get(name)
        if not isinstance(val, torch.Tensor) or name not in dims:
            continue
        shape = list(val.shape) if val.ndim == len(dims[name]) else [1] * len(dims[name])
        for i, sym in enumerate(dims[name]):
            if sym in values:
                shape[i] = values[sym]
        if shape != list(val.shape) and (name, "symbol", tuple(shape)) not in forbid:
            forbid.add((name, "symbol", tuple(shape)))
            whole = val.is_floating_point() and not name.lower().endswith(("ids", "indices"))
            new[name] = torch.randn(shape) if whole else torch.zeros(shape, dtype=torch.long)
            notes.append(f"{name}: {tuple(shape)}")
    return (new, "documented sizes the message gives: " + ", ".join(notes)) if notes else None


@rule
def _index_dtype(exc, msg, kwargs, make, forbid, params):
    """``Expected dtype int32 or int64 for index``: the float input shaped like the float index the
    innermost frame holds (computed from inputs, e.g. ``row * k + tags``) becomes integers."""
    if "for index" not in msg or "int" not in msg:
        return None
    frames = _model_frames(exc)
    given = {id(v) for v in kwargs.values()}
    shapes = {tuple(v.shape) for v in (frames[-1].f_locals.values() if frames else ())
              if isinstance(v, torch.Tensor) and v.is_floating_point() and id(v) not in given}
    for name, val in kwargs.items():
        if isinstance(val, torch.Tensor) and val.is_floating_point() and tuple(val.shape) in shapes \
                and (name, "long") not in forbid:
            return _as_long_zeros(kwargs, name, forbid, f"{name}: integer indices (an index computed from it)")
    return None


@rule
def _empty_mapping(exc, msg, kwargs, make, forbid, params):
    """``argument after ** must be a mapping, not NoneType``: the forward parameter the failing
    statement spreads with ``**`` (an options dict left None) becomes an empty dict."""
    if "must be a mapping, not NoneType" not in msg:
        return None
    for frame in reversed(_model_frames(exc)):
        for name in re.findall(r"\*\*(\w+)", statement_text(frame)):
            if name in params and frame.f_locals.get(name, 0) is None and kwargs.get(name) is None \
                    and (name, "mapping") not in forbid:
                forbid.add((name, "mapping"))
                return _with(kwargs, name, {}), f"{name}: an empty options dict (spread with **)"
    return None


_OUT_OF_BOUNDS = re.compile(r"index (\d+) is out of bounds for dimension (\d+) with size (\d+)")
STACK_MAX = 64  # entries a stacked input grows to at most


def _subscripted_inputs(exc, kwargs: dict, d: int) -> list:
    """(input name, tensor, axis) of each tensor input a failing statement subscripts (``x[k]``), by
    name or through a local that is it or a row of it (then one axis further in)."""
    out = []
    for frame in reversed(_model_frames(exc)):
        for local in re.findall(r"(\w+)\s*\[", statement_text(frame)):
            if isinstance(kwargs.get(local), torch.Tensor):
                out.append((local, kwargs[local], d))
                continue
            lv = frame.f_locals.get(local)
            for name, val in kwargs.items():
                if isinstance(lv, torch.Tensor) and isinstance(val, torch.Tensor):
                    if lv is val:
                        out.append((name, val, d))
                    elif _held(val, [lv]):
                        out.append((name, val, d + 1))
    return out


@rule
def _stacked_entries(exc, msg, kwargs, make, forbid, params):
    """``index i is out of bounds for dimension d`` on an input the failing statement subscripts: it
    gets ``i + 1`` entries along ``d`` (a new axis before a size-1 batch axis), up to STACK_MAX."""
    m = _OUT_OF_BOUNDS.search(msg)
    if not m:
        return None
    i, d, size = (int(x) for x in m.groups())
    if i + 1 > STACK_MAX:
        return None
    for name, val, d in _subscripted_inputs(exc, kwargs, d):
        # ``x[0][k]``: the axis the failing subscript reaches may lie further in
        d = next((a for a in range(d, val.ndim) if val.shape[a] == size), None)
        if d is None or (name, "stack", i) in forbid:
            continue
        forbid.add((name, "stack", i))
        gen = getattr(make, "gen", None)
        if d == 0 and size == 1 and (name, "stacked") not in forbid:  # the batch axis: stack before it
            forbid.add((name, "stacked"))
            shape = (i + 1, *val.shape)
        else:
            shape = tuple(i + 1 if k == d else n for k, n in enumerate(val.shape))
        value = torch.randn(shape, generator=gen) if val.is_floating_point() else torch.zeros(shape, dtype=val.dtype)
        return _with(kwargs, name, value), \
            f"{name}: {i + 1} entries along axis {d} (indexed by the code) -> {list(shape)}"
    return None

_NAMED_COUNT = re.compile(r"`(\w+)` \(([^)]*)\)[^`]*?\bgot \[?(\d+)")


@rule
def _stated_count(exc, msg, kwargs, make, forbid, params):
    """A check naming an input, its value and the count it got (``exactly `seq_len` (8) tokens, got
    [32]``): the input becomes that count (an int where the forward annotates one)."""
    m = _NAMED_COUNT.search(msg)
    if not m or m.group(1) not in params or (m.group(1), "count", m.group(3)) in forbid:
        return None
    name, count = m.group(1), int(m.group(3))
    forbid.add((name, "count", m.group(3)))
    ann = str(getattr(make, "annotations", {}).get(name, ""))
    old = kwargs.get(name)
    if isinstance(old, torch.Tensor) and "int" not in ann.replace("Tensor", ""):
        value = torch.full(old.shape, count, dtype=old.dtype)
    else:
        value = count
    return _with(kwargs, name, value), f"{name}: {count} (the count the forward's check got)"

_TOO_MANY = re.compile(r"too many indices for tensor of dimension (\d+)")


def _index_count(text: str, name: str) -> int:
    """The most indices the statement ``text`` gives ``name[...]`` at once."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return 0
    best = 0
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == name:
            best = max(best, len(n.slice.elts) if isinstance(n.slice, ast.Tuple) else 1)
    return best


@rule
def _per_frame_values(exc, msg, kwargs, make, forbid, params):
    """An input indexed with more axes than it has (``timestep[:, -n:]``): each missing axis added
    with the grid's frame count, the values repeated along it."""
    m = _TOO_MANY.search(msg)
    if not m:
        return None
    rank = int(m.group(1))
    frames = max(1, getattr(getattr(make, "grid", None), "frames", 1) or 1)
    for frame in reversed(_model_frames(exc)):
        text = statement_text(frame)
        for local in re.findall(r"(\w+)\s*\[", text):
            lv = frame.f_locals.get(local)
            name = next((n for n, v in kwargs.items() if isinstance(v, torch.Tensor) and v is lv), None)
            want = _index_count(text, local)
            if name is None or lv.ndim != rank or want <= rank or (name, "rank", want) in forbid:
                continue
            forbid.add((name, "rank", want))
            val = lv
            while val.ndim < want:
                val = val.unsqueeze(-1).expand(*val.shape, frames)
            return _with(kwargs, name, val.clone()), \
                f"{name}: {list(val.shape)} (indexed with {want} axes: a value per frame)"
        break
    return None


def explain(exc: BaseException, model, kwargs: dict | None = None) -> str:
    """A named reason for an error no repair addresses: a ``KeyError`` on features built from a dict
    input, or any error after the probe filled such an input's keys (their real shapes unknown)."""
    dicts = dict_inputs(model)
    filled = {n: list(v) for n, v in (kwargs or {}).items() if n in dicts and isinstance(v, dict) and v}
    if filled and not isinstance(exc, KeyError):
        return "".join(f" (after {len(keys)} named features the forward reads from the dict input {n!r} were made "
                       f"up as zeros per token, {keys[:3]}...: their real shapes are not in the code's signature)"
                       for n, keys in filled.items())
    if not isinstance(exc, KeyError) or not exc.args or not dicts:
        return ""
    return (f" (the forward reads key {exc.args[0]!r} of the features it builds from the dict input "
            f"{', '.join(repr(d) for d in dicts)}: named features the probe does not make up)")
