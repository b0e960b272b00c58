"""The attention path: GQA timing (SDPA ``enable_gqa`` against K/V repeated to the query heads, and other backends), and
a per-instance run-time patch routing a model's own ``scaled_dot_product_attention`` calls through diffusers'
``dispatch_attention_fn`` so context parallelism reaches attention written outside diffusers: each calling module's
``forward`` is wrapped (``ditbook.hooks``) to enter a ``TorchFunctionMode`` for that forward and thread only; no
torch function is rebound."""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..hooks import WrapGroup
from ..settings import GQA_PATH_ATOL

_SDPA = F.scaled_dot_product_attention  # the real one (nothing here rebinds it)


@dataclass
class GqaTiming:
    device: str
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    batch: int
    seconds: dict[str, float] = field(default_factory=dict)  # path -> median seconds per call
    spread: dict[str, float] = field(default_factory=dict)  # path -> (max - min) seconds
    faster: str | None = None
    ratio: float | None = None  # slower / faster
    errors: dict[str, str] = field(default_factory=dict)
    torch_version: str = torch.__version__

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_gqa(heads: int, kv_heads: int, head_dim: int, seq_len: int, *, batch: int = 1,
             device: str = "cpu", dtype: str = "float32", repeats: int = 5, warmup: int = 2,
             backends: tuple[str, ...] = ()) -> GqaTiming:
    """Median time of one attention call on these shapes, per path, on this device."""
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=g, device="cpu").to(device=device, dtype=dt)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, device="cpu").to(device=device, dtype=dt)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g, device="cpu").to(device=device, dtype=dt)
    rep = heads // kv_heads
    paths = {
        "enable_gqa": lambda: _SDPA(q, k, v, enable_gqa=True),
        "repeat_interleave": lambda: _SDPA(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)),
    }
    for b in backends:
        def run(b=b):
            from diffusers.models.attention_dispatch import dispatch_attention_fn
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            return dispatch_attention_fn(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), backend=b)
        paths[f"dispatch:{b}"] = run
    out = GqaTiming(device=device, dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                    seq_len=seq_len, batch=batch)
    ref = None
    for name, fn in paths.items():
        try:
            with torch.no_grad():
                for _ in range(warmup):
                    r = fn()
                _sync(device)
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    r = fn()
                    _sync(device)
                    ts.append(time.perf_counter() - t0)
            if name.startswith("dispatch:"):
                r = r.transpose(1, 2)
            if ref is None:
                ref = r
            elif not torch.allclose(r.float(), ref.float(), atol=GQA_PATH_ATOL[dt != torch.float32]):
                out.errors[name] = "result differs from enable_gqa"
                continue
            out.seconds[name] = statistics.median(ts)
            out.spread[name] = max(ts) - min(ts)
        except Exception as exc:  # noqa: BLE001 - a backend missing here is a finding, not a failure
            out.errors[name] = f"{type(exc).__name__}: {exc}"
    ok = {k: s for k, s in out.seconds.items() if k in ("enable_gqa", "repeat_interleave")}
    if ok:
        out.faster = min(ok, key=ok.get)
        out.ratio = max(ok.values()) / max(min(ok.values()), 1e-12)
    return out


@dataclass
class AttentionRoute:
    gqa_path: str = "enable_gqa"  # or "repeat_interleave"
    calls: int = 0
    gqa_calls: int = 0
    cp_calls: int = 0
    modules: list[str] = field(default_factory=list)
    # module-name prefixes whose SDPA calls go through CP attention (None: all; set by ``cp.scope``)
    cp_scope: list[str] | None = None
    wraps: WrapGroup = field(default_factory=lambda: WrapGroup(ROUTE_WRAP), repr=False, compare=False)

    def remove(self) -> None:
        """Every routed module's forward back to what it was (``ditbook.hooks``: exact undo)."""
        self.wraps.remove()


ROUTE_WRAP = "ditbook.attention-route"


def _calls_sdpa(obj) -> bool:
    """The class's own code calls SDPA, directly or through a plain function of its module."""
    try:
        src = inspect.getsource(type(obj))
    except (OSError, TypeError):
        return False
    if "scaled_dot_product_attention" in src:
        return True
    import sys

    namespace = vars(sys.modules.get(type(obj).__module__) or object())
    return any(_function_calls_sdpa(namespace.get(name), 2) for name in _called_names(src))


def _called_names(src: str) -> set[str]:
    """Names called as plain functions (``f(...)``) in ``src``."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return set()
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _function_calls_sdpa(fn, depth: int) -> bool:
    """A plain function whose code (or its module's functions it calls, ``depth`` levels down) calls SDPA."""
    import sys

    if not inspect.isfunction(fn) or depth < 0:
        return False
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if "scaled_dot_product_attention" in src:
        return True
    namespace = vars(sys.modules.get(fn.__module__) or object())
    return any(_function_calls_sdpa(namespace.get(n), depth - 1) for n in _called_names(src) if n != fn.__name__)


def _dispatch_aware(module) -> bool:
    proc = getattr(module, "processor", None)
    return proc is not None and hasattr(proc, "_attention_backend")


_PROC_SOURCE: dict = {}  # processor __call__ function -> its source ("" where it has none)
_PROC_CALLS_SDPA: dict = {}  # processor __call__ function -> whether its own code calls SDPA (asked per call)


def _processor_call(module):
    proc = getattr(module, "processor", None)
    return getattr(type(proc), "__call__", None) if proc is not None else None


def _processor_source(fn) -> str:
    """The source of a processor's ``__call__`` ("" where it has none)."""
    if fn not in _PROC_SOURCE:
        try:
            # the code object: getsource of a functools.wraps patch would show the original it wraps
            _PROC_SOURCE[fn] = inspect.getsource(getattr(fn, "__code__", fn))
        except (OSError, TypeError):
            _PROC_SOURCE[fn] = ""
    return _PROC_SOURCE[fn]


def _processor_calls_sdpa(module) -> bool:
    """A processor whose ``__call__`` calls SDPA itself, never a dispatch function: to be routed."""
    fn = _processor_call(module)
    if fn is None:
        return False
    if fn not in _PROC_CALLS_SDPA:
        src = _processor_source(fn)
        _PROC_CALLS_SDPA[fn] = "scaled_dot_product_attention" in src and "dispatch_attention_fn" not in src
    return _PROC_CALLS_SDPA[fn]


class SdpaRedirect(TorchFunctionMode):
    """Within its extent (this thread only) SDPA calls go to ``fn``, which itself reaches the real SDPA."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.fn(*args, **kwargs)
        return func(*args, **kwargs)


def _in_scope(name: str, scope: list[str] | None) -> bool:
    """A routed module's SDPA calls belong to the CP region ``scope`` (or contain it)."""
    if scope is None:
        return True
    return any(name == p or name.startswith(p + ".") or p.startswith(name + ".") or name == "" for p in scope)


def _redirect(route: AttentionRoute, transformer, query, key, value, attn_mask=None, dropout_p=0.0,
              is_causal=False, scale=None, enable_gqa=False, _module: str = "", **extra):
    """One routed SDPA call: GQA by ``route.gqa_path``; under CP through ``dispatch_attention_fn``."""
    route.calls += 1
    hq, hk = query.shape[-3], key.shape[-3]
    cfg = getattr(transformer, "_parallel_config", None)
    cp = getattr(cfg, "context_parallel_config", cfg) if cfg is not None else None
    if cp is not None and not _in_scope(_module, route.cp_scope):
        cp = None  # outside the split region: the whole sequence is on every rank
    if hk != hq:
        route.gqa_calls += 1
        # cache-dit's templated CP attention takes no GQA: repeat K/V first
        if route.gqa_path == "repeat_interleave" or cp is not None:
            key = key.repeat_interleave(hq // hk, dim=-3)
            value = value.repeat_interleave(hq // hk, dim=-3)
            enable_gqa = False
        else:
            enable_gqa = True
    if cp is None:
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, enable_gqa=enable_gqa)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    route.cp_calls += 1
    out = dispatch_attention_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                enable_gqa=enable_gqa, backend="native", parallel_config=cfg)
    return out.transpose(1, 2)


def sdpa_callers(transformer) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules whose own code calls SDPA, outside diffusers' dispatch-aware processors."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in transformer.named_modules():
        if not (_processor_calls_sdpa(module) or (not _dispatch_aware(module) and _calls_sdpa(module))):
            continue
        if any(outer == "" or name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def route_attention(transformer, gqa_path: str = "enable_gqa") -> AttentionRoute:
    """Wrap every module calling SDPA itself so the call takes ``dispatch_attention_fn`` under CP."""
    route = AttentionRoute(gqa_path=gqa_path)

    def routed_as(name, module):
        # chosen for its processor alone: re-checked per call (a CP planner may replace its __call__)
        by_processor = _dispatch_aware(module) or not _calls_sdpa(module)

        def redirect(*args, **kwargs):
            return _redirect(route, transformer, *args, _module=name, **kwargs)

        def routed(original, *args, **kwargs):
            if by_processor and not _processor_calls_sdpa(module):
                return original(*args, **kwargs)
            with SdpaRedirect(redirect):
                return original(*args, **kwargs)
        return routed

    with route.wraps.applying():
        for name, module in sdpa_callers(transformer):
            route.wraps.wrap(module, routed_as(name, module))
            route.modules.append(name)
    return route


def model_gqa_shapes(transformer, report=None, seq_len: int | None = None) -> dict | None:
    """(heads, kv_heads, head_dim, seq_len) of a GQA model, from the report or the config."""
    heads = kv = hd = None
    if report is not None:
        a = report.attention
        heads, kv, hd = a.heads, a.kv_heads, a.head_dim
        if seq_len is None and a.image_seq_len:
            seq_len = a.image_seq_len + (a.text_seq_len or 0 if a.kind == "joint" else 0)
    cfg = getattr(transformer, "config", {}) if transformer is not None else {}
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    heads = heads or get("num_attention_heads") or get("num_heads")
    kv = kv or get("num_key_value_heads") or get("num_kv_heads") or heads
    hd = hd or get("attention_head_dim") or get("head_dim")
    if not (heads and kv and hd) or heads == kv:
        return None
    return {"heads": int(heads), "kv_heads": int(kv), "head_dim": int(hd), "seq_len": int(seq_len or 256)}


_TEMPLATED_REFUSES = ("enable_gqa", "is_causal")  # what diffusers' templated CP attention raises on


def _asks_templated_refusal(module) -> bool:
    """A dispatch-aware processor whose ``__call__`` code names an argument templated CP attention refuses."""
    fn = _processor_call(module)
    return fn is not None and any(k in _processor_source(fn) for k in _TEMPLATED_REFUSES)


class _RefusedArgs(TorchFunctionMode):
    """Notes SDPA calls made with ``enable_gqa`` or ``is_causal`` set while a watched module runs."""

    def __init__(self):
        super().__init__()
        self.inside: list[str] = []
        self.found: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and self.inside:
            q = args[0] if args else kwargs.get("query")
            k = args[1] if len(args) > 1 else kwargs.get("key")
            if kwargs.get("enable_gqa") and q is not None and k is not None and q.shape[-3] != k.shape[-3]:
                self.found.setdefault("GQA", self.inside[-1])
            if kwargs.get("is_causal") or (len(args) > 5 and args[5]):
                self.found.setdefault("causal attention", self.inside[-1])
        return func(*args, **kwargs)


def templated_attention_refusal(transformer, args, kwargs) -> str | None:
    """Why context parallelism cannot run this model's attention: diffusers' templated CP attention (what
    ``dispatch_attention_fn`` takes under a parallel config) raises on GQA and on causal attention, so a
    dispatch-aware processor that asks for either would crash every rank. One forward, SDPA calls watched
    inside those processors' modules; None when no such call happens."""
    watched = [(n, m) for n, m in transformer.named_modules()
               if _dispatch_aware(m) and not _processor_calls_sdpa(m) and _asks_templated_refusal(m)]
    if not watched:
        return None
    mode, handles = _RefusedArgs(), []
    for name, module in watched:
        handles.append(module.register_forward_pre_hook(lambda *_a, n=name: mode.inside.append(n) and None))
        handles.append(module.register_forward_hook(lambda *_a: mode.inside.pop() and None))  # None: output kept
    try:
        with torch.no_grad(), mode:
            transformer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if not mode.found:
        return None
    what = ", ".join(f"{k} (in '{m}')" for k, m in mode.found.items())
    said = " / ".join(f"'{'GQA' if k == 'GQA' else 'Causal attention'} is not yet supported for templated attention'"
                      for k in mode.found)
    return (f"the attention processors ask dispatch_attention_fn for {what}, which diffusers' templated "
            f"context-parallel attention refuses ({said}): context parallelism would crash every rank")
