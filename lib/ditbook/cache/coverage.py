"""Coverage: every transformer class the installed diffusers exports, integrated the way the
stages integrate a new model, on a tiny random instance.

Per class (``check_class``):

1. **build** a tiny instance from its ``__init__`` defaults shrunk by generic rules
   (``shrink_config``): int parameters that count layers/blocks/depth become 2, every other int
   (and int tuple) of 32 or more is divided by one common factor (8, then 4, then 2), so the
   ratios between widths, head dims and RoPE axes stay what the class expects; layer-index
   lists keep their places among 2 layers; rotary axes that sum to the head dim keep doing so
   under a head cap, and axes left None become two halves of it. A constructor that fails on a
   parameter left None (``ctor_repair``, from the traceback's ``__init__`` frame) gets a value
   derived from the code: a tuple where it is subscripted by an int, else the value of the most
   similarly named parameter. A submodule the forward always calls but the defaults leave None
   gets the constructor flag that builds it; rotary axes stay even and keep their share of the
   head dim; when no rung runs, a model width the defaults leave unequal to heads x head dim is
   tied to it. A class that no factor builds is ``refused`` with the error.
2. **inputs** from the forward signature (``make_inputs``): the parameters are matched by name
   to tensors whose shapes come from the config (image latents as 4-D, 5-D or packed 3-D,
   text states with the width of a text/caption/joint/cross config entry, pooled vectors,
   timesteps, position ids); the first combination whose forward runs is kept. When none runs,
   ``find_inputs`` rebuilds each from the forward's data flow (``coverage_inputs.forward_needs``:
   the first submodule each parameter reaches, how its shape is unpacked, its documented shape,
   its annotation) and repairs it from the errors the forward raises (a None parameter the code
   reads, a matrix product's width, index/mask dtypes, a rank, a text length or frame count a
   positional table fixes, a token grid too small; see ``coverage_inputs`` for the full list, with
   inputs built as diffusers' own pipeline builds them), a bounded number of times. None runs:
   ``refused`` with the errors (the data-flow attempts' first), or with the optional dependency
   the forward lacks, or with the kv cache every diffusers pipeline passes this class.
3. **inspection** (``ditbook.inspect``): static report plus a traced call.
4. **cache adapter** (``build_cache_adapter``) and the dbcache strategy with caching off: every
   step's output equal to the plain forward (max abs diff <= 1e-5, fp32); then with caching on,
   several steps with slowly changing inputs: finite outputs and block evaluations really
   skipped (counted on the original blocks).
5. **cp**: ``ditbook.parallel.coverage_cp(transformer, args, kwargs)`` when the parallel stage
   provides it, else "not run".

Outcomes: ``correct``; ``refused`` (a named reason: ditbook declined to integrate); ``crash``
(an exception that is not a named refusal: a bug in ditbook, cache-dit or the probe);
``wrong`` (caching off differs from the plain forward, non-finite output, or nothing skipped).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import math
import pkgutil
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from . import coverage_inputs as ci

LAYER_WORDS = ("layers", "layer", "depth", "num_blocks", "blocks")
# (width divisor, head count cap): few heads first (fast), then the class's own head counts
# for classes whose widths are tied to heads x head dim
LADDER = ((8, 2), (4, 2), (8, None), (4, None), (2, None))
STEPS = 6
TOLERANCE = 1e-5


# optional int knobs that some classes leave None by default (one of several input modes): set
# to what a small latent-image model uses, so the class builds in its continuous-latent mode
OPTIONAL_SHAPE_DEFAULTS = {"in_channels": 4, "patch_size": 2, "sample_size": 8}


class Refused(Exception):
    """ditbook (or the probe) declines this class, with a named reason."""


@dataclass
class ClassOutcome:
    name: str
    outcome: str  # correct / refused / crash / wrong
    reason: str = ""
    stage: str = ""  # where it stopped: build / inputs / inspect / adapter / cache-off / cache-on
    factor: int | None = None
    block_lists: list[str] = field(default_factory=list)
    folded: bool = False
    used: str = ""
    off_max_abs: float | None = None
    skipped: str = ""  # "k of n block evaluations"
    cp: str = "not run"
    cp_reason: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# --- discovery ---------------------------------------------------------------------------------

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
    heads0 = next((v.default for k, v in params.items() if _is_head_count(k) and "kv" not in k.lower()
                   and isinstance(v.default, int) and v.default > 0), None)
    heads1 = next((out.get(k) for k, v in params.items() if _is_head_count(k) and "kv" not in k.lower()
                   and isinstance(v.default, int) and v.default > 0), None)
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
    """Rotary axes that sum to the head dim by default, each even (a rotary axis rotates pairs),
    but that the shrink left odd or no longer summing to the new head dim: the default's
    proportions rescaled to the new head dim, each rounded to an even size. Axes that define the
    head dim (no head dim in the config) keep the sum the shrink gave them, each made even."""
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
    """Per attention of its own (``audio_num_attention_heads`` with ``audio_attention_head_dim``: one
    name prefix), widths of that prefix that equal its heads x head dim by default (``audio_cross_
    attention_dim``) keep doing so after shrinking."""
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
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.__init__))))
    except (OSError, TypeError, SyntaxError):
        return {}
    out: dict[str, set] = {}
    for n in ast.walk(tree):
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
    """Constructor keywords that address ``exc``: a parameter whose default is None but which the
    constructor's failing line uses gets a value derived from how the code uses it (subscripted by
    an int: a tuple; otherwise an int: the value of the most similarly named parameter, else the
    latent-image default). None when the error names no such parameter."""
    sig = inspect.signature(cls.__init__).parameters
    defaults = {k: v.default for k, v in sig.items() if v.default is not inspect.Parameter.empty}
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    own = [f for f in frames if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), cls)]
    if not own:
        return None
    frame = own[-1]
    line = ci.statement_text(frame)
    usage = _init_usage(cls)
    new = dict(kwargs)
    for name, val in frame.f_locals.items():
        if val is not None or name not in defaults or defaults[name] is not None or name in kwargs:
            continue
        if not __import__("re").search(rf"\b{name}\b", line):
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
    import ast

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
    import ast

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
    """The instance, rebuilt with a constructor flag turned on when the forward calls
    ``self.X(...)`` unconditionally but the defaults leave ``X`` None and a flag off by default
    (False/0) is what the constructor tests before it builds ``X``: the defaults describe no
    runnable model; the flag makes the one the forward expects. The instance as built when no
    such flag is found or the rebuilt one fails to construct."""
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
    """String-constant keys that the constructor's frame ``own`` or a frame it called subscripts
    its None local ``name`` with, anywhere in that frame's function (``rope_scaling["short_factor"]``
    and ``rope_scaling["long_factor"]`` in a submodule's ``__init__``), in source order."""
    import ast

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


def tiny_instances(cls: type, ladder=LADDER):
    """Instances for each rung (width divisor, head cap) the constructor accepts, smallest
    first; Refused when none."""
    errors = []
    built = False
    for f, heads in ladder:
        try:
            kwargs = shrink_config(cls, f, heads)
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


def tiny_with_inputs(cls: type, ladder=LADDER):
    """(instance, factor, keyword inputs): the first rung whose instance runs."""
    last = None
    for model, f in tiny_instances(cls, ladder):
        try:
            kwargs, _ = find_inputs(model)
            return model, f, kwargs
        except Refused as exc:
            last = exc
    tied = _tied_width_instance(cls, ladder)
    if tied is not None:
        model, f = tied
        try:
            kwargs, _ = find_inputs(model)
            return model, f, kwargs
        except Refused:
            pass
    raise Refused(f"{last}")


_WIDTH_NAMES = ("hidden_size", "inner_dim", "hidden_dim", "dim", "width", "model_dim")


def _tied_width_instance(cls: type, ladder=LADDER):
    """(instance, factor) of the first rung with the model width set to heads x head dim, when
    the class's defaults disagree (a width of 1152 next to 16 heads of 88): tried only after no
    rung ran as the defaults say; None when the defaults agree or it does not build."""
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


# --- inputs ------------------------------------------------------------------------------------

def _config(model) -> dict:
    cfg = getattr(model, "config", None)
    return dict(cfg) if cfg is not None else {}


def _ints(cfg: dict, *words: str, exclude: tuple = ()) -> list[int]:
    out = []
    for k, v in cfg.items():
        low = k.lower()
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and any(w in low for w in words) \
                and not any(x in low for x in exclude):
            if v not in out:
                out.append(v)
    return out


def _patch(cfg: dict) -> tuple[int, int]:
    """(spatial, temporal) patch sizes from the config (1 when absent)."""
    p = cfg.get("patch_size") or 1
    if isinstance(p, (tuple, list)):
        t, s = (p[0], p[-1]) if len(p) == 3 else (1, p[-1])
    else:
        t, s = cfg.get("patch_size_t") or 1, p
    return int(s or 1), int(t or 1)


def input_candidates(model) -> list[dict]:
    """Combinations of shapes to try, most likely first."""
    cfg = _config(model)
    s, t = _patch(cfg)
    side = 4 * s
    frames = max(2, t) if t > 1 else 2
    chans = _ints(cfg, "in_channels", "in_dim", "in_chans", "latent_channels", "input_dim")[:1] or [4]
    c = chans[0]
    text_dims = _ints(cfg, "text", "caption", "joint", "cross", "context", "encoder", "prompt",
                      exclude=("layer", "len", "head", "num_", "seq", "max", "vocab"))
    hs = [("4d", (1, c, side, side)), ("5d", (1, c, frames, side, side)), ("5d-fc", (1, frames, c, side, side)),
          ("3d", (1, 16, c))]
    return [{"hidden": h, "text_dim": td} for h in hs for td in (text_dims or [None])[:3]]


def _tokens(hidden: tuple, cfg: dict) -> int:
    s, t = _patch(cfg)
    if len(hidden) == 3:
        return hidden[1]
    if len(hidden) == 4:
        return (hidden[2] // s) * (hidden[3] // s)
    f = hidden[2] if hidden[1] not in (2,) or hidden[2] == hidden[3] else hidden[1]
    return max(1, f // t) * (hidden[-2] // s) * (hidden[-1] // s)


_NO_INPUT = object()  # a parameter left out of the keyword inputs (distinct from a None value)


def make_inputs(model, cand: dict, text_len: int = 8, seed: int = 0) -> dict:
    """Keyword inputs for ``model.forward`` by parameter name (generic rules, no class names)."""
    cfg = _config(model)
    g = torch.Generator().manual_seed(seed)
    hidden = cand["hidden"][1]
    td = cand["text_dim"]
    kwargs: dict = {}
    params = [p for p in inspect.signature(model.forward).parameters.values() if p.name != "self"]
    first = True
    axes = next((v for k, v in cfg.items() if "axes" in k.lower() and isinstance(v, (tuple, list))), None)
    n_axes = len(axes) if axes else 3
    for p in params:
        n = p.name.lower()
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if first or n in ("hidden_states", "x", "sample", "latents", "img"):
            kwargs[p.name] = torch.randn(hidden, generator=g)
            first = False
            continue
        if "mask" in n and p.default is inspect.Parameter.empty:
            kwargs[p.name] = torch.ones(1, text_len if ("encoder" in n or "text" in n) else _tokens(hidden, cfg))
            continue
        if "mask" in n or "rotary" in n or "rope" in n or n.startswith("return") or "kwargs" in n \
                or "controlnet" in n or "cache" in n:
            continue
        value = _conditioning_input(p, cfg, g, hidden, td, text_len, n_axes)
        if value is not _NO_INPUT:
            kwargs[p.name] = value
    if "return_dict" in {p.name for p in params}:
        kwargs["return_dict"] = False
    return kwargs


def _conditioning_input(p, cfg: dict, g, hidden: tuple, td, text_len: int, n_axes: int):
    """The input for one conditioning parameter by its name, or ``_NO_INPUT`` to leave it out."""
    n = p.name.lower()
    required = p.default is inspect.Parameter.empty
    if (n in ("encoder_hidden_states", "context", "txt", "text_states", "prompt_embeds", "y")
            or (required and ("encoder_hidden" in n or ("text" in n and "emb" in n)))) and td:
        return torch.randn((1, text_len, td), generator=g)
    elif n in ("timestep", "timesteps", "t", "time", "sigma", "sigmas") or (required and "timestep" in n):
        return torch.full((1,), 500.0)
    elif required and ("text" in n or "context" in n or "encoder" in n) and "len" not in n and td:
        return torch.randn((1, text_len, td), generator=g)
    elif "label" in n or n in ("class_labels", "classes"):
        return torch.zeros(1, dtype=torch.long)
    elif required and ("len" in n):
        return torch.full((1,), text_len, dtype=torch.long)
    elif required and ("size" in n or "coord" in n):
        # image-size conditioning (original/target size, crop corner): pixels of the latent grid
        full = 8 * hidden[-1] if len(hidden) >= 4 else 64
        return torch.zeros(1, 2) if "coord" in n else torch.full((1, 2), float(full))
    elif "pooled" in n:
        dims = _ints(cfg, "pooled") or ([td] if td else [])
        if dims:
            return torch.randn((1, dims[0]), generator=g)
    elif n == "guidance":
        if any("guidance" in k.lower() and v is True for k, v in cfg.items()):
            return torch.full((1,), 3.5)
    elif n in ("num_frames", "frames", "height", "width") and len(hidden) == 3:
        # packed latents: the grid they came from (frames x height x width == tokens)
        side = int(math.isqrt(hidden[1]))
        return 1 if "frame" in n else side
    elif n.endswith("_ids") and ("img" in n or "image" in n):
        return torch.zeros(_tokens(hidden, cfg), n_axes)
    elif n.endswith("_ids") and ("txt" in n or "text" in n):
        return torch.zeros(text_len, n_axes)
    elif required:
        return None  # required with no rule: the probe's error names it
    return _NO_INPUT


def first_tensor(out):
    """The main output: the first tensor of a tuple/list/ModelOutput, or the tensor itself."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            t = first_tensor(o)
            if t is not None:
                return t
    return None


def _grid(model, cand: dict) -> "ci.Grid":
    cfg = _config(model)
    s, t = _patch(cfg)
    hidden = cand["hidden"][1]
    side = hidden[-1] if len(hidden) >= 4 else 4 * s
    chans = _ints(cfg, "in_channels", "in_dim", "in_chans", "latent_channels", "input_dim")[:1] or [4]
    # a text length the config fixes (a positional table sized for it)
    text = [v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 512
            and any(w in k.lower() for w in ("text", "caption", "prompt"))
            and any(w in k.lower() for w in ("len", "seq"))]
    axes = next((v for k, v in cfg.items() if "axes" in k.lower() and isinstance(v, (tuple, list))), None)
    return ci.Grid(frames=max(2, t), height=side, width=side, channels=chans[0], patch=s, patch_t=t,
                   n_axes=len(axes) if axes else 3,
                   text=text[0] if text else ci.TEXT_LEN)


def _default_roles(rank: int) -> list:
    return {1: ["batch"], 2: ["batch", "dim"], 3: ["batch", "tokens", "dim"],
            4: ["batch", "channels", "height", "width"],
            5: ["batch", "channels", "frames", "height", "width"]}.get(rank, ["batch"] + [None] * (rank - 1))


class _Maker:
    """Builds a value for one forward parameter on demand (the repair loop asks it): what the
    code asks of it (``forward_needs``), else a rule by the parameter's name."""

    def __init__(self, model, cand: dict, needs: dict, seed: int = 0):
        self.model, self.cand, self.needs = model, cand, needs
        self.grid = _grid(model, cand)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.params = [p.name for p in inspect.signature(model.forward).parameters.values()
                       if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self.first = self.params[0] if self.params else None
        self.annotations = {p.name: p.annotation for p in inspect.signature(model.forward).parameters.values()
                            if p.annotation is not inspect.Parameter.empty}

    def __call__(self, name: str, kwargs: dict, rank: int | None = None, roles: list | None = None):
        import copy

        ann = self.annotations.get(name)
        if rank is None and name != self.first:
            val = ci.pipeline_value(self.model, name, self.fill)  # as diffusers' own pipeline builds it
            if val is not None:
                return val
        if ann is not None and rank is None:
            val = ci.structured(ann, self.grid, lambda: self(name, kwargs, rank=4 if name == self.first else 3))
            if val is not None:
                return val
        listed = ci.per_module_list(self.model, name) if rank is None else None
        if listed is not None:  # one tensor per module of the list the forward feeds them to
            count, each = listed
            items = [ci.tensor_for(name, each, self.grid, self.gen) for _ in range(count)]
            if all(isinstance(t, torch.Tensor) for t in items):
                return items
        need = copy.copy(self.needs.get(name) or ci.Need())
        hidden = name == self.first
        if rank is not None:
            need.roles = need.roles if need.roles and len(need.roles) == rank else _default_roles(rank)
            if roles and len(roles) == rank:  # the roles the code's own unpack names
                need.roles = list(roles)
        if not need.empty():
            val = ci.tensor_for(name, need, self.grid, self.gen, hidden=hidden)
            if val is not None:
                return ci.suffix_sizes_fit(name, val, _config(self.model), self.gen)
        return ci.suffix_sizes_fit(name, self.by_name(name, kwargs), _config(self.model), self.gen)

    def fill(self, name: str, annotation):
        """A plain argument of a pipeline helper (``pipeline_value``): the device, a size of the token
        grid by its name, positions of the frames, 1.0 for a float; None otherwise."""
        low, text = name.lower(), str(annotation)
        g = self.grid
        grid_t = (max(1, g.frames // g.patch_t), g.height // g.patch, g.width // g.patch)
        if "device" in low:
            return torch.device("cpu")
        if "dtype" in low:
            return torch.float32
        if text.startswith("list[int]"):
            return list(range(grid_t[0]))
        if "int" in text:
            return {"batch": 1, "frames": grid_t[0], "height": grid_t[1], "width": grid_t[2]}.get(ci.axis_role(name))
        if "float" in text:
            return 1.0
        return None

    def by_name(self, name: str, kwargs: dict):
        g, low = self.grid, name.lower()
        hidden = kwargs.get(self.first)
        tokens = hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.ndim == 3 else g.tokens(
            hidden.ndim if isinstance(hidden, torch.Tensor) else 4)
        texty = any(w in low for w in ("encoder", "text", "txt", "caption", "prompt", "context", "cond"))
        length = g.text if texty else tokens
        ann = str(self.annotations.get(name, ""))
        if ann and "int" in ann and "Tensor" not in ann and "list" not in ann.lower() and "tuple" not in ann.lower():
            # a size the forward takes as a plain int: the token grid's (frames, height, width)
            role = ci.axis_role(name)
            grid_t = (max(1, g.frames // g.patch_t), g.height // g.patch, g.width // g.patch)
            return {"frames": grid_t[0], "height": grid_t[1], "width": grid_t[2],
                    "tokens": length}.get(role, 1)
        if "mask" in low:
            return torch.ones(1, g.text if _doc_texty(self.model, name) else length, dtype=torch.long)
        if "index" in low or "indices" in low:
            return torch.arange(length)  # a 1-D list of positions
        if low.endswith("ids") or "position" in low or "pos" in low.split("_"):
            return torch.zeros(1, length, dtype=torch.long)
        if "len" in low or "length" in low:
            return torch.full((1,), length, dtype=torch.long)
        if "time" in low or "sigma" in low:
            return torch.full((1,), 0.5 if "sigma" in low else 500.0)
        if "size" in low or "shape" in low:
            return torch.tensor([[g.height, g.width]], dtype=torch.long)
        if "scale" in low:
            return torch.ones(1)
        return torch.randn((1, length, g.channels), generator=self.gen)


def _doc_texty(model, name: str) -> bool:
    """The forward's docstring says ``name`` is about the text (``mask: the text padding mask``,
    ``Alias for encoder_attention_mask``): its first two lines name the text/encoder/prompt."""
    import re

    doc = inspect.getdoc(type(model).forward) or ""
    m = re.search(rf"^[ \t]*{re.escape(name)}\b[^\n]*(\n[^\n]*)?", doc, re.M)
    return bool(m) and any(w in m.group(0).lower() for w in ("text", "encoder", "prompt", "caption"))


def _run(model, kwargs):
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        out = first_tensor(model(**kwargs))
    if out is None or not torch.isfinite(out).all():
        raise Refused("the forward gave no finite tensor")
    return out


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + (str(exc).splitlines()[0][:120] if str(exc) else "")


REPAIRS = 12


def _flow_inputs(model, cand: dict, needs: dict, maker: "_Maker") -> dict:
    """The candidate's name-rule inputs with every tensor the code's data flow says more about
    rebuilt to meet it."""
    kwargs = make_inputs(model, cand, text_len=maker.grid.text)
    for name, val in list(kwargs.items()):
        if val is None or _list_annotated(maker, name):  # no name rule, or a list the annotation asks for
            kwargs[name] = maker(name, kwargs)
            continue
        need = needs.get(name)
        if need is None or need.empty() or not (val is None or isinstance(val, torch.Tensor)):
            continue
        if isinstance(val, torch.Tensor) and val.ndim == 1 and not need.vocab \
                and not (need.roles and len(need.roles) > 1 and "docstring" in need.where):
            continue  # a scalar per batch (timestep, guidance): name rules know best, unless documented wider
        new = ci.tensor_for(name, need, maker.grid, maker.gen, hidden=name == maker.first)
        if new is not None:
            kwargs[name] = new
    for name, val in kwargs.items():  # masks as integers: they are summed, compared and indexed with
        if "mask" in name.lower() and isinstance(val, torch.Tensor) and val.is_floating_point():
            kwargs[name] = torch.ones(val.shape, dtype=torch.long)
    return kwargs


def _tagged(kwargs: dict, needs: dict) -> dict:
    """Inputs the code compares with module constants (token role tags) hold those constants, in
    the shape the name rules gave them: random values would tag no token at all."""
    out = dict(kwargs)
    for name, val in kwargs.items():
        need = needs.get(name)
        if need is not None and need.values and isinstance(val, torch.Tensor) and val.ndim >= 1 and val.numel():
            n = val.shape[-1]
            row = torch.tensor([need.values[min(i * len(need.values) // n, len(need.values) - 1)] for i in range(n)])
            out[name] = row.expand(tuple(val.shape)).clone()
    return out


def _list_annotated(maker, name: str) -> bool:
    """The forward annotates ``name`` as a list (of tensors per sample, of grids): a tensor made by
    the name rules is not what it takes."""
    ann = maker.annotations.get(name)
    text = (ann if isinstance(ann, str) else str(ann)).replace("typing.", "").replace("List[", "list[")
    return ann is not None and text.startswith("list[") and "Tensor" in text


def _regrid(exc, kwargs, model, cand, needs, maker, forbid):
    found = ci.int_input_size(exc, kwargs)
    if found and (found[0], "int", found[1]) not in forbid:
        return None  # an int input gives that size: the input repairs set it
    fixed = _regrid_inputs(exc, model, cand, needs, maker, forbid)
    if fixed is None:
        return None
    new, why = fixed
    for k, v in kwargs.items():  # what the repairs supplied so far, made again on the new grid
        if new.get(k) is None and v is not None:
            new[k] = maker(k, new)
    return new, why


def _regrid_inputs(exc, model, cand, needs, maker, forbid):
    """A size mismatch whose one side is the grid's text length or frame count (a positional table
    sized by the config): the whole input set rebuilt on a grid with the other size."""
    if ci.last_axis_mismatch(exc):
        return None  # a feature width, not a length: the input repairs fix it
    if "divisible" in str(exc) and maker.grid.height < 8 * maker.grid.patch * 4 \
            and ("grow", maker.grid.height) not in forbid:
        # a token grid too small for the model's windows/tiles: twice as large on each side
        forbid.add(("grow", maker.grid.height))
        maker.grid.height *= 2
        maker.grid.width *= 2
        return _flow_inputs(model, cand, needs, maker), f"grid {maker.grid.height}x{maker.grid.width}"
    m = ci._SIZE.search(str(exc))
    if not m:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    for attr in ("text", "frames"):
        for old, new in ((a, b), (b, a)):
            if getattr(maker.grid, attr) == old and 1 <= new <= 512 and (attr, new) not in forbid:
                forbid.add((attr, new))
                setattr(maker.grid, attr, new)
                return _flow_inputs(model, cand, needs, maker), f"grid {attr} {old} -> {new}"
    # a sequence of text plus a fixed number of other tokens against a table sized for a longer
    # text: the text longer by the difference
    if int(m.group(3)) == 1 and b > a and maker.grid.text + (b - a) <= 512 and ("text+", b - a) not in forbid:
        forbid.add(("text+", b - a))
        old = maker.grid.text
        maker.grid.text += b - a
        return _flow_inputs(model, cand, needs, maker), f"grid text {old} -> {maker.grid.text}"
    return None


def find_inputs(model, log=None) -> tuple[dict, dict]:
    """(keyword inputs, the candidate) of the first combination whose forward runs: the name
    rules' candidates as they are, then each with the code's data flow applied and repaired from
    the errors the forward raises (``coverage_inputs``)."""
    errors: dict[str, str] = {}
    cands = input_candidates(model)
    needs = ci.forward_needs(model)
    for cand in cands:
        kwargs = _tagged(make_inputs(model, cand), needs)
        try:
            _run(model, kwargs)
        except Exception as exc:
            errors.setdefault(cand["hidden"][0], _first_line(exc))
            continue
        return kwargs, cand
    required = [p.name for p in inspect.signature(model.forward).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    state = [n for n in required if ci.never_supplied(n)]
    if state:
        raise Refused(f"the forward requires {state}: state/cache objects of a running pipeline that the probe "
                      f"does not make up")
    seen = []
    for cand in cands:
        maker = _Maker(model, cand, needs)
        for start in (_flow_inputs(model, cand, needs, maker), make_inputs(model, cand)):
            sig = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for k, v in start.items()}
            if sig in seen:
                continue
            seen.append(sig)
            kwargs, forbid = start, set()
            for _ in range(REPAIRS):
                try:
                    _run(model, kwargs)
                except Exception as exc:
                    if ci.missing_dependency(exc):
                        raise Refused(ci.missing_dependency(exc)) from None
                    fixed = (_regrid(exc, kwargs, model, cand, needs, maker, forbid)
                             or ci.repair(exc, kwargs, maker, forbid))
                    if log:
                        log(cand["hidden"][0], _summary(exc), fixed[1] if fixed else None)
                    if fixed is None:
                        own = ci._own_none(exc)  # the model's own setting left None by its defaults
                        errors[f"{cand['hidden'][0]}+flow"] = _first_line(exc) + (
                            f" ({own} is None: a setting the class's defaults leave unset)" if own
                            else ci.explain(exc, model))
                        break
                    kwargs = fixed[0]
                    continue
                return kwargs, cand
    # the data-flow attempts' last errors first: they went furthest
    order = sorted(errors, key=lambda k: not k.endswith("+flow"))
    state = ci.pipeline_state_inputs(type(model))
    if state:
        raise Refused(f"every call of this transformer in diffusers' pipelines passes {state}: state of a running "
                      f"pipeline (a kv cache filled by earlier calls) that the probe does not make up; without it "
                      f"no input runs the forward: " + "; ".join(f"{k}: {errors[k]}" for k in order[:2]))
    raise Refused("no inputs from the forward signature run it: " + "; ".join(f"{k}: {errors[k]}" for k in order))


# --- the stages' checks ------------------------------------------------------------------------

def _perturbed(kwargs: dict, step: int, hidden_name: str) -> dict:
    """Step ``step`` of a slowly changing sequence: the image stream drifts by 0.1% a step and
    the timestep decreases."""
    out = dict(kwargs)
    h = kwargs[hidden_name]
    out[hidden_name] = [x * (1.0 - 0.001 * step) for x in h] if isinstance(h, list) else h * (1.0 - 0.001 * step)
    for k, v in kwargs.items():
        if "timestep" in k.lower() and isinstance(v, torch.Tensor) and v.is_floating_point():
            out[k] = v - 5.0 * step
    return out


def _steps_pipeline(transformer, kwargs: dict, hidden_name: str):
    """A minimal pipeline object for cache-dit: ``pipe(num_inference_steps=n)`` calls the
    transformer ``n`` times with slowly changing inputs and returns every step's main output."""

    class CoveragePipeline:  # a class per call: cache-dit patches the pipeline class's __call__
        def __init__(self, transformer):
            self.transformer = transformer

        def __call__(self, num_inference_steps: int = STEPS, **_):
            outs = []
            with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
                for i in range(num_inference_steps):
                    outs.append(first_tensor(self.transformer(**_perturbed(kwargs, i, hidden_name))).clone())
            return outs

    return CoveragePipeline(transformer)


def _summary(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f"{f.filename.split('site-packages/')[-1].split('lib/')[-1]}:{f.lineno}" for f in reversed(tb)), "")
    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {msg} ({where})"


def _refusal_types() -> tuple:
    from .adapter import CacheRefused, run_time_refusals
    from .loopfold import FoldError

    return (Refused, CacheRefused, FoldError, *run_time_refusals())


def check_class(cls: type, steps: int = STEPS, cp: bool = True) -> ClassOutcome:
    """Run the stages' checks on a tiny instance of ``cls`` (see the module docstring)."""
    row = ClassOutcome(cls.__name__, "crash")
    start = time.perf_counter()
    try:
        model, kwargs = _check_cache(cls, steps, row)
    except _refusal_types() as exc:
        row.outcome, row.reason = "refused", str(exc).splitlines()[0][:300]
        return row
    except Exception as exc:
        row.outcome, row.reason = "crash", _summary(exc)
        return row
    finally:
        row.seconds = round(time.perf_counter() - start, 2)
    if row.outcome != "correct":
        return row
    if cp:
        row.cp, row.cp_reason = run_cp(model, kwargs)
    row.seconds = round(time.perf_counter() - start, 2)
    return row


def _check_cache(cls: type, steps: int, row: ClassOutcome):
    """Build, inspect, adapt and run caching off and on, filling ``row``; returns (model, inputs).

    While it runs ``row.stage`` names the stage (a refusal or crash is reported there); it ends
    with ``row.outcome`` "correct" (stage cleared) or "wrong" (stage kept)."""
    from . import strategies
    from .adapter import build_cache_adapter
    from .counting import EvalCounter

    model, kwargs, report, pipe = _inspected_pipeline(cls, row)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        plain = pipe(steps)
    row.stage = "adapter"
    adapter = build_cache_adapter(pipe, report, f"coverage_{cls.__name__}")
    row.folded = bool(adapter.info.patch_functor)
    row.used = adapter.info.used
    strat = strategies.get("dbcache")
    row.stage = "cache-off"
    off = _run_cached(pipe, adapter, strat, strat.disabled(adapter, steps), steps, EvalCounter)
    diff = max(float((a - b).abs().max()) for a, b in zip(off[0], plain))
    row.off_max_abs = diff
    if not diff <= TOLERANCE:
        row.outcome = "wrong"
        row.reason = f"caching off differs from the plain forward: max abs {diff:.3g} > {TOLERANCE:g}"
        return model, kwargs
    row.stage = "cache-on"
    on_cfg = strat.Config(Fn=1, Bn=0, threshold=1.0, max_warmup_steps=1)
    outs, counts = _run_cached(pipe, adapter, strat, on_cfg, steps, EvalCounter)
    total = off[1]["block_evals"]
    ran = counts["block_evals"]
    row.skipped = f"{total - ran} of {total}"
    if not all(torch.isfinite(o).all() for o in outs):
        row.outcome, row.reason = "wrong", "caching on gave non-finite outputs"
    elif ran >= total:
        row.outcome, row.reason = "wrong", f"caching on skipped no block evaluation ({ran} of {total} ran)"
    else:
        row.outcome, row.stage = "correct", ""
    return model, kwargs


def _inspected_pipeline(cls: type, row: ClassOutcome):
    """The build+inputs and inspect stages: (model, inputs, traced report, steps pipeline)."""
    from ..inspect.static import inspect_transformer
    from ..inspect.trace import trace_calls

    row.stage = "build+inputs"
    model, row.factor, kwargs = tiny_with_inputs(cls)
    # the image stream: the first floating tensor input (a first parameter may be a list of conditioning pairs)
    hidden_name = next((k for k, v in kwargs.items() if _float_tensors(v)), next(iter(kwargs)))
    row.stage = "inspect"
    report = inspect_transformer(model, None, support=False)
    with contextlib.redirect_stdout(io.StringIO()):
        report = trace_calls(model, lambda: model(**kwargs), report=report)
    row.block_lists = [f"{b.path} x{b.length}" for b in report.block_lists]
    if report.block_lists and max(b.length for b in report.block_lists) < 2:
        raise Refused("every block list has a single block: a block cache always computes it, nothing to skip")
    return model, kwargs, report, _steps_pipeline(model, kwargs, hidden_name)


def _float_tensors(v) -> bool:
    """A float tensor, or a list of them (one per sample)."""
    if isinstance(v, list):
        return bool(v) and all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _run_cached(pipe, adapter, strat, cfg, steps: int, counter_cls):
    counter = counter_cls(pipe.transformer, adapter.original_blocks())
    undo = None
    try:
        undo = strat.apply(pipe, adapter, cfg, steps=steps)
        outs = pipe(steps)
        return outs, counter.snapshot()
    finally:
        try:
            if undo is not None:
                undo()
        finally:
            counter.remove()


def run_cp(model, kwargs) -> tuple[str, str]:
    """The parallel stage's coverage check when it provides one (``coverage_cp``)."""
    try:
        from .. import parallel
    except Exception as exc:
        return "not run", f"ditbook.parallel does not import: {exc}"
    fn = getattr(parallel, "coverage_cp", None)
    if fn is None:
        return "not run", "ditbook.parallel.coverage_cp does not exist"
    try:
        res = fn(model, (), dict(kwargs))
        return str(res.get("outcome", "?")), str(res.get("reason", ""))
    except Exception as exc:
        return "crash", _summary(exc)


def run_coverage(classes: list[type] | None = None, progress=None, cp: bool = True) -> list[ClassOutcome]:
    rows = []
    for cls in classes if classes is not None else transformer_classes():
        row = check_class(cls, cp=cp)
        rows.append(row)
        if progress:
            progress(row)
    return rows


def totals(rows: list[ClassOutcome]) -> dict:
    out = {k: 0 for k in ("correct", "refused", "crash", "wrong")}
    for r in rows:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def _versions() -> dict:
    import cache_dit
    import diffusers

    from .. import __version__

    return {"ditbook": __version__, "diffusers": diffusers.__version__,
            "cache-dit": getattr(cache_dit, "__version__", "?"), "torch": torch.__version__}


def markdown(rows: list[ClassOutcome], seconds: float | None = None, command: str = "") -> str:
    t = totals(rows)
    n = len(rows) or 1
    v = _versions()
    lines = ["# Coverage: diffusers transformer classes through ditbook", "",
             "Generated by `python benchmarks/coverage.py`" + (f" ({command})" if command else "") + "; "
             "do not edit by hand. Every transformer class the installed diffusers exports, built tiny "
             "and random (fp32, CPU), run through traced inspection, the automatic cache adapter with caching "
             f"off (max abs diff <= {TOLERANCE:g} against the plain forward, {STEPS} steps) and on (same "
             "steps with slowly changing inputs: finite, block evaluations skipped). See "
             "`lib/ditbook/cache/coverage.py` for the rules.", "",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
             f"Totals ({len(rows)} classes): " + ", ".join(f"**{k}** {c} ({c / n:.0%})" for k, c in t.items()) + "."]
    probe = sum(1 for r in rows if r.outcome == "refused" and r.stage == "build+inputs")
    if t["refused"]:
        lines.append(f"Of the refused, {probe} are refusals of this probe (it could not build the class small or "
                     f"make inputs that run its forward: stage `build+inputs`), {t['refused'] - probe} are "
                     f"refusals by ditbook's integration (inspection/adapter found no safe way to cache).")
    if seconds is not None:
        lines.append(f"Wall time of this run: {seconds:.0f} s.")
    lines += ["", "| class | outcome | stage | reason | block lists | folded | caching off max abs | skipped | cp | s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        cp = r.cp + (f": {r.cp_reason}" if r.cp_reason and r.cp != "not run" else "")
        off = "" if r.off_max_abs is None else f"{r.off_max_abs:.1e}"
        lines.append(f"| {r.name} | {r.outcome} | {r.stage} | {reason} | {', '.join(r.block_lists)} | "
                     f"{'yes' if r.folded else ''} | {off} | {r.skipped} | {cp.replace('|', '/')} | {r.seconds} |")
    return "\n".join(lines) + "\n"


__all__ = ["ClassOutcome", "Refused", "build_tiny", "check_class", "find_inputs", "make_inputs", "markdown",
           "run_coverage", "shrink_config", "totals", "transformer_classes"]
