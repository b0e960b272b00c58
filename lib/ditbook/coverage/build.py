"""Build a tiny random instance of a transformer class from its ``__init__`` defaults
(``shrink_config``, ``ctor_repair``, ``tiny_instances``): step 1 of the coverage probe (see
``ditbook.coverage``). Also ``Refused``, the probe's named refusal."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import pkgutil
import re
import traceback

import torch

from . import dataflow as ci
from . import repairs

LAYER_WORDS = ("layers", "layer", "depth", "num_blocks", "blocks")
# (width divisor, head count cap): few heads first (fast), then the class's own head counts
# for classes whose widths are tied to heads x head dim
LADDER = ((8, 2), (4, 2), (8, None), (4, None), (2, None))


# optional int knobs that some classes leave None by default (one of several input modes): set
# to what a small latent-image model uses, so the class builds in its continuous-latent mode
OPTIONAL_SHAPE_DEFAULTS = {"in_channels": 4, "patch_size": 2, "sample_size": 8}


class Refused(Exception):
    """ditbook (or the probe) declines this class, with a named reason."""


def transformer_classes() -> list[type]:
    """Every ``ModelMixin`` subclass defined under ``diffusers.models.transformers`` and
    exported in diffusers' top-level namespace, sorted by name."""
    import diffusers
    import diffusers.models.transformers as pkg
    from diffusers import ModelMixin

    exported = set(dir(diffusers))
    out: dict[str, type] = {}
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            mod = importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: its classes are not exported either
            continue
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, ModelMixin) and obj.__module__ == mod.__name__ \
                    and name in exported:
                out[name] = obj
    return [out[n] for n in sorted(out)]


# --- a tiny instance ---------------------------------------------------------------------------

def _is_layer_count(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in LAYER_WORDS) and "dim" not in low and "size" not in low


def _is_head_count(name: str) -> bool:
    low = name.lower()
    return "heads" in low and "dim" not in low


def shrink_config(cls: type, factor: int, heads: int | None = None) -> dict:
    """Constructor keywords: layer counts 2, head counts at most ``heads`` (when given), other
    ints/int tuples >= 32 divided by ``factor`` (when they divide exactly; left alone otherwise)."""
    out = {}
    params = inspect.signature(cls.__init__).parameters
    for p in params.values():
        d = p.default
        if p.name == "self" or d is inspect.Parameter.empty:
            continue
        if d is None and "int" in str(p.annotation) and p.name in OPTIONAL_SHAPE_DEFAULTS:
            # an optional size left unset by default: the value a latent image model would use
            out[p.name] = OPTIONAL_SHAPE_DEFAULTS[p.name]
            continue
        if isinstance(d, bool):
            continue
        if isinstance(d, int):
            if _is_layer_count(p.name):
                out[p.name] = 2 if d > 0 else d  # two blocks: the least a block cache can skip in
            elif heads and _is_head_count(p.name) and d > heads:
                out[p.name] = heads
            elif d >= 32 and d % factor == 0:
                out[p.name] = d // factor
        elif isinstance(d, (tuple, list)) and d and all(isinstance(x, int) and not isinstance(x, bool) for x in d):
            counts = [v.default for v in params.values() if _is_layer_count(v.name) and isinstance(v.default, int)
                      and not isinstance(v.default, bool)]
            if "layer" in p.name.lower() and len(d) > 1 and list(d) == sorted(set(d)) and counts \
                    and max(d) < max(counts):
                # indices into the layers (which layers get an extra input): the same places in 2 layers
                out[p.name] = type(d)(sorted({x * 2 // max(counts) for x in d}))
            elif _is_layer_count(p.name):
                out[p.name] = type(d)(min(x, 2) for x in d)
            elif max(d) >= 16 and all(x % factor == 0 for x in d):
                out[p.name] = type(d)(x // factor for x in d)
    # rotary axes that sum to the head dim by default keep doing so when a head cap changed it
    defaults = {k: v.default for k, v in params.items() if v.default is not inspect.Parameter.empty}
    head0, head1 = _head_dim(defaults), _head_dim({**defaults, **out})
    for p in params.values():
        d = out.get(p.name, p.default)
        if ("axes" in p.name.lower() or "rope" in p.name.lower()) and isinstance(p.default, (tuple, list)) \
                and p.default and all(isinstance(x, int) for x in p.default) and head0 and head1 \
                and sum(p.default) == head0 and sum(d) != head1 and head1 % sum(d) == 0:
            out[p.name] = type(d)(x * (head1 // sum(d)) for x in d)
    # widths that equal heads x head dim by default (an attention width fed from the inner
    # dim) keep doing so when a head cap changed the inner dim
    key = next((k for k, v in params.items() if _is_head_count(k) and "kv" not in k.lower()
                and isinstance(v.default, int) and v.default > 0), None)
    heads0, heads1 = (params[key].default, out.get(key)) if key else (None, None)
    if head0 and head1 and heads0 and heads1 and heads1 != heads0:
        for p in params.values():
            if isinstance(p.default, int) and not isinstance(p.default, bool) and p.default == head0 * heads0 \
                    and "dim" in p.name.lower() and "head" not in p.name.lower():
                out[p.name] = head1 * heads1
    # rotary axes left None by default: two even halves of the head dim (they must sum to it)
    for p in params.values():
        if p.default is None and ("axes" in p.name.lower()) and p.name not in out:
            head = _head_dim({**{k: v.default for k, v in params.items()}, **out})
            if head and head % 4 == 0:
                out[p.name] = (head // 2, head // 2)
    return _even_rotary_axes(params, _kept_ties(params, out), head0, head1)


def _kept_ties(params, out: dict) -> dict:
    """``out`` with the ties of a prefixed attention and of a rotary width to the head dim kept."""
    _tie_prefixed_widths(params, out)
    _scale_rotary_dims(params, out)
    return out


def _even_rotary_axes(params, out: dict, head0, head1) -> dict:
    """Even rotary axes (a rotary axis rotates pairs) the shrink left odd or no longer summing to
    their share of the new head dim: the default's proportions rescaled to it, each rounded to an
    even size; without a head dim in the config, the shrunk sum kept."""
    for p in params.values():
        d0 = p.default
        if not (("axes" in p.name.lower() or "rope" in p.name.lower()) and isinstance(d0, (tuple, list)) and d0
                and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 and x % 2 == 0 for x in d0)):
            continue
        d = out.get(p.name, d0)
        if head0 and head1 and head0 % sum(d0) == 0 and (head1 * sum(d0)) % head0 == 0:
            target = head1 * sum(d0) // head0  # the same share of the head dim (all of it, a half, ...)
        elif not any(isinstance(x, int) and x % 2 for x in d):
            continue
        else:
            target = sum(d)
        if target % 2 or (sum(d) == target and all(x % 2 == 0 for x in d)):
            continue
        pairs = [x * (target // 2) / sum(d0) for x in d0]  # each axis's share of the head's pairs
        whole = [max(1, int(v)) for v in pairs]
        order = sorted(range(len(d0)), key=lambda i: pairs[i] - int(pairs[i]), reverse=True)
        i = 0
        while sum(whole) < target // 2:
            whole[order[i % len(order)]] += 1
            i += 1
        while sum(whole) > target // 2 and max(whole) > 1:
            whole[whole.index(max(whole))] -= 1
        if sum(whole) == target // 2:
            out[p.name] = type(d0)(2 * w for w in whole)
    return out


def _tie_prefixed_widths(params, out: dict) -> None:
    """Widths of an attention's own name prefix (``audio_``) equal to its heads x head dim by
    default keep that tie after shrinking."""
    defaults = {k: v.default for k, v in params.items() if isinstance(v.default, int) and not isinstance(v.default, bool)}
    for hname in defaults:
        if not _is_head_count(hname) or "kv" in hname.lower() or "_" not in hname:
            continue
        prefix = hname[:hname.lower().find("num_")] if "num_" in hname.lower() else ""
        dname = next((k for k in defaults if k.startswith(prefix) and "head_dim" in k.lower()), None) if prefix else None
        if not dname:
            continue
        h0, d0 = defaults[hname], defaults[dname]
        h1, d1 = out.get(hname, h0), out.get(dname, d0)
        if h0 * d0 == h1 * d1:
            continue
        for k, v in defaults.items():
            if k.startswith(prefix) and k not in (hname, dname) and "dim" in k.lower() and "head" not in k.lower() \
                    and v == h0 * d0:
                out[k] = h1 * d1


def _scale_rotary_dims(params, out: dict) -> None:
    """A rotary width given as an int (``rope_freq_dim``, ``rotary_dim``: a part of the head dim) that
    the other rules left alone shrinks with the head dim, so it still fits in it."""
    defaults = {k: v.default for k, v in params.items() if v.default is not inspect.Parameter.empty}
    head0, head1 = _head_dim(defaults), _head_dim({**defaults, **out})
    if not head0 or not head1 or head1 >= head0 or head0 % head1:
        return
    ratio = head0 // head1
    for k, v in defaults.items():
        low = k.lower()
        if k in out or isinstance(v, bool) or not isinstance(v, int) or "dim" not in low \
                or not any(w in low for w in ("rope", "rotary")) or v % ratio:
            continue
        out[k] = v // ratio


def _head_dim(cfg: dict) -> int | None:
    hd = next((v for k, v in cfg.items() if "head_dim" in k.lower() and isinstance(v, int)), None)
    if hd:
        return hd
    width = next((v for k, v in cfg.items() if k.lower() in ("hidden_size", "inner_dim", "dim", "hidden_dim", "width")
                  and isinstance(v, int)), None)
    heads = next((v for k, v in cfg.items() if _is_head_count(k) and "kv" not in k.lower() and isinstance(v, int)
                  and v > 0), None)
    return width // heads if width and heads and width % heads == 0 else None


def build_tiny(cls: type, ladder=LADDER):
    """(instance, factor): the first rung of the ladder the constructor accepts."""
    for model, f in tiny_instances(cls, ladder):
        return model, f
    raise AssertionError("unreachable")


CTOR_REPAIRS = 4
SETTING_NEUTRAL = 1.0  # the value of each key of a settings dict the probe fills: the identity of a scale
_GENERIC_TOKENS = {"num", "dim", "size", "of", "max", "n", "default"}


def _init_usage(cls: type) -> dict[str, set]:
    """How ``cls.__init__``'s code uses each parameter: ``{"int-index", "str-index"}`` when it
    subscripts it with an int/str constant."""
    _, node = ci._source_tree(cls.__init__)
    out: dict[str, set] = {}
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.slice, ast.Constant):
            kind = "str-index" if isinstance(n.slice.value, str) else "int-index"
            out.setdefault(n.value.id, set()).add(kind)
    return out


def _similar_int(name: str, kwargs: dict, defaults: dict):
    """The value of the constructor parameter whose name shares the most words with ``name``
    (``out_channels`` -> ``in_channels``, ``num_kv_heads`` -> ``num_attention_heads``)."""
    words = set(name.lower().split("_")) - _GENERIC_TOKENS
    best, score = None, 0
    for k in list(kwargs) + list(defaults):
        v = kwargs.get(k, defaults.get(k))
        if k == name or isinstance(v, bool) or not isinstance(v, int):
            continue
        sc = len(words & (set(k.lower().split("_")) - _GENERIC_TOKENS))
        if sc > score:
            best, score = v, sc
    return best


def ctor_repair(cls: type, kwargs: dict, exc: BaseException) -> dict | None:
    """Constructor keywords that address ``exc``: a parameter None by default that the failing line of
    ``__init__`` uses gets a value from how the code uses it; None when the error names none."""
    sig = inspect.signature(cls.__init__).parameters
    defaults = {k: v.default for k, v in sig.items() if v.default is not inspect.Parameter.empty}
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    own = [f for f in frames if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), cls)]
    if not own:
        return None
    frame = own[-1]
    line = repairs.statement_text(frame)
    usage = _init_usage(cls)
    new = dict(kwargs)
    for name, val in frame.f_locals.items():
        if val is not None or name not in defaults or defaults[name] is not None or name in kwargs:
            continue
        if not re.search(rf"\b{name}\b", line):
            continue
        uses = usage.get(name, set())
        keys = _settings_keys(exc, frame, name)
        if keys:  # a dict of settings read by key: each key a neutral scale (1.0)
            new[name] = {k: SETTING_NEUTRAL for k in keys}
            continue
        if "str-index" in uses:  # read by key, but no key the probe can name
            raise Refused(f"cannot be built small: '{name}' (None by default) is a settings dict the constructor "
                          f"reads from; the probe does not make one up")
        width = _similar_int(name, kwargs, defaults) or OPTIONAL_SHAPE_DEFAULTS.get(name) or 32
        new[name] = (width, width) if "int-index" in uses else width
    return new if new != kwargs else None


def _unconditional_self_calls(fn) -> set[str]:
    """Attributes ``X`` the forward calls as ``self.X(...)`` in its top-level statements (not
    under a condition, a loop or a ``with``)."""
    _, node = ci._source_tree(fn)
    if node is None:
        return set()
    out = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef)):
            continue
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                    and n.func.value.id == "self":
                out.add(n.func.attr)
    return out


def _init_gates(cls: type) -> dict[str, set]:
    """Per attribute ``X``: the constructor parameters a condition tests before the constructor
    sets ``self.X`` to something (``if flag: self.X = ...``, ``self.X = M(...) if flag else None``)."""
    _, node = ci._source_tree(cls.__init__)
    if node is None:
        return {}
    params = set(ci._param_names(node))
    out: dict[str, set] = {}

    def tested(expr) -> set:
        return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in params}

    for n in ast.walk(node):
        if isinstance(n, ast.If):
            for a in (x for b in n.body for x in ast.walk(b)):
                if isinstance(a, ast.Assign):
                    for t in a.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            out.setdefault(t.attr, set()).update(tested(n.test))
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.IfExp):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.setdefault(t.attr, set()).update(tested(n.value.test))
    return out


def _with_called_submodules(cls: type, model, kwargs: dict):
    """The instance rebuilt with the constructor flags (off by default) that gate building ``X``
    turned on, when the forward always calls ``self.X(...)`` but the defaults leave ``X`` None; else
    (no such flag, or the rebuild fails) the instance as built."""
    called = {a for a in _unconditional_self_calls(type(model).forward) if getattr(model, a, 0) is None}
    if not called:
        return model
    sig = inspect.signature(cls.__init__).parameters
    gates = _init_gates(cls)
    flags = {}
    for attr in sorted(called):
        for p in sorted(gates.get(attr, ())):
            d = sig[p].default if p in sig else None
            if p not in kwargs and (d is False or (isinstance(d, int) and not isinstance(d, bool) and d == 0)):
                flags[p] = True
    if not flags:
        return model
    try:
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()):
            rebuilt = cls(**kwargs, **flags)
    except Exception:
        return model
    return rebuilt.float().eval()


def _settings_keys(exc: BaseException, own, name: str) -> list[str]:
    """String keys that ``own`` or a frame it called subscripts its None local ``name`` with
    (``rope_scaling["short_factor"]``), in source order."""
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    inner = frames[frames.index(own):] if own in frames else []
    keys: list[str] = []
    for f in inner:
        if name not in f.f_locals or f.f_locals[name] is not None:
            continue
        _, node = ci._source_tree(f.f_code)
        for n in ast.walk(node) if node is not None else ():
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == name \
                    and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str) \
                    and n.slice.value not in keys:
                keys.append(n.slice.value)
    return keys


def tiny_instances(cls: type, ladder=LADDER, overrides: dict | None = None):
    """Instances for each rung (width divisor, head cap) the constructor accepts, smallest first,
    with ``overrides`` (from ``coverage.reconfig``) on every rung; Refused when none."""
    errors = []
    built = False
    for f, heads in ladder:
        try:
            kwargs = {**shrink_config(cls, f, heads), **(overrides or {})}
        except Refused as exc:
            errors.append(f"/{f}: {exc}")
            continue
        model = exc = None
        # with the optional latent-image sizes filled in, then (another input mode) without them
        optional = {k for k in kwargs if k in OPTIONAL_SHAPE_DEFAULTS
                    and inspect.signature(cls.__init__).parameters[k].default is None}
        attempts = [kwargs] + [{k: v for k, v in kwargs.items() if k != o} for o in sorted(optional)]
        for attempt in attempts:
            kwargs = attempt
            for _ in range(CTOR_REPAIRS + 1):
                try:
                    torch.manual_seed(0)
                    with contextlib.redirect_stdout(io.StringIO()):
                        model = cls(**kwargs)
                    break
                except Exception as e:
                    exc = e
                    fixed = ctor_repair(cls, kwargs, e)
                    if fixed is None:
                        break
                    kwargs = fixed
            if model is not None:
                break
        if model is None:
            errors.append(f"/{f}{f' heads<={heads}' if heads else ''}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            continue
        model = _with_called_submodules(cls, model, kwargs)
        built = True
        yield model.float().eval(), f
    if not built:
        raise Refused("cannot be built small: " + "; ".join(errors))


_WIDTH_NAMES = ("hidden_size", "inner_dim", "hidden_dim", "dim", "width", "model_dim")


def _tied_width_instance(cls: type, ladder=LADDER):
    """(instance, factor) of the first rung with the model width set to heads x head dim when the
    defaults disagree (tried after no rung ran); None when they agree or it does not build."""
    sig = inspect.signature(cls.__init__).parameters
    for f, heads in ladder[:1]:
        kwargs = shrink_config(cls, f, heads)
        cfg = {**{k: v.default for k, v in sig.items() if v.default is not inspect.Parameter.empty}, **kwargs}
        head = next((v for k, v in cfg.items() if "head_dim" in k.lower() and isinstance(v, int)), None)
        n = next((v for k, v in cfg.items() if _is_head_count(k) and "kv" not in k.lower() and isinstance(v, int)
                  and not isinstance(v, bool) and v > 0), None)
        width = next((k for k in _WIDTH_NAMES if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)), None)
        if not (head and n and width) or cfg[width] == head * n:
            return None
        try:
            torch.manual_seed(0)
            with contextlib.redirect_stdout(io.StringIO()):
                model = cls(**{**kwargs, width: head * n})
        except Exception:
            return None
        return _with_called_submodules(cls, model.float().eval(), {**kwargs, width: head * n}), f
    return None


def _summary(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f"{f.filename.split('site-packages/')[-1].split('lib/')[-1]}:{f.lineno}" for f in reversed(tb)), "")
    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {msg} ({where})"
