"""The attention path: GQA timing (SDPA ``enable_gqa=True`` against K/V repeated to the query
heads, and other dispatch backends present) and a run-time patch that routes a model's own
``scaled_dot_product_attention`` calls through ``diffusers.models.attention_dispatch.dispatch_attention_fn``
so that context parallelism (Ulysses all-to-all, Ring) reaches attention written outside diffusers.

The patch is per instance: each attention module whose code calls SDPA gets its ``forward``
wrapped (``ditbook.hooks``); only while that forward runs, and only in that thread, a
``TorchFunctionMode`` sends its SDPA calls to the redirect. No torch function is rebound;
nothing is changed on disk or on classes.
"""

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
    """Median time of one attention call on these shapes, by path, on this device.

    Paths: ``enable_gqa`` (SDPA's native grouped-query), ``repeat_interleave`` (K/V repeated to
    the query heads, then plain SDPA), and ``dispatch:<backend>`` for each named diffusers backend.
    """
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


# ---------------------------------------------------------------------------------------------
# routing a model's own SDPA calls through diffusers' dispatcher


@dataclass
class AttentionRoute:
    gqa_path: str = "enable_gqa"  # or "repeat_interleave"
    calls: int = 0
    gqa_calls: int = 0
    cp_calls: int = 0
    modules: list[str] = field(default_factory=list)
    # module-name prefixes (the block lists whose tokens a CP plan splits) whose SDPA calls go
    # through the CP attention; None: every routed module. A module outside them (a text
    # refiner, a pooling attention over the text) runs on whole sequences on every rank: an
    # all-to-all there would mix unsplit sequences (set by ``cp.scope``)
    cp_scope: list[str] | None = None
    wraps: WrapGroup = field(default_factory=lambda: WrapGroup(ROUTE_WRAP), repr=False, compare=False)

    def remove(self) -> None:
        """Every routed module's forward back to what it was (``ditbook.hooks``: exact undo)."""
        self.wraps.remove()


ROUTE_WRAP = "ditbook.attention-route"


def _calls_sdpa(obj) -> bool:
    """The class's own code calls SDPA: directly, or through a plain function of its module
    (a reference implementation's ``attention(q, k, v, pe)``, no attention module around it)."""
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
    """A plain Python function whose code (or that of the module functions it calls, ``depth``
    levels down) calls ``scaled_dot_product_attention``."""
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


_PROC_CALLS_SDPA: dict = {}  # processor __call__ function -> whether its own code calls SDPA


def _processor_calls_sdpa(module) -> bool:
    """A processor whose ``__call__`` (as it is now: a planner may have replaced it) calls SDPA
    itself and never a dispatch function (a model's custom processor, Mochi's): its calls must be
    routed, even when it carries diffusers' ``_attention_backend`` attribute."""
    proc = getattr(module, "processor", None)
    fn = getattr(type(proc), "__call__", None) if proc is not None else None
    if fn is None:
        return False
    if fn not in _PROC_CALLS_SDPA:
        try:
            # the code object: getsource of a functools.wraps patch would show the original it wraps
            src = inspect.getsource(getattr(fn, "__code__", fn))
            _PROC_CALLS_SDPA[fn] = "scaled_dot_product_attention" in src and "dispatch_attention_fn" not in src
        except (OSError, TypeError):
            _PROC_CALLS_SDPA[fn] = False
    return _PROC_CALLS_SDPA[fn]


class SdpaRedirect(TorchFunctionMode):
    """Within its dynamic extent (this thread only), calls of ``scaled_dot_product_attention``
    under any name (``F.``, ``torch.nn.functional.``, a name imported from it) go to ``fn``.

    Nothing is rebound: it is a ``torch.overrides.TorchFunctionMode``, which torch consults on
    every torch function call while it is entered. While ``fn`` runs the mode is off (torch pops
    a mode during its own handler), so ``fn`` and what it calls reach the real SDPA."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.fn(*args, **kwargs)
        return func(*args, **kwargs)


def _in_scope(name: str, scope: list[str] | None) -> bool:
    """Whether a routed module's SDPA calls belong to the CP region ``scope`` (an outer caller that
    contains the region cannot be told apart: it keeps the CP path)."""
    if scope is None:
        return True
    return any(name == p or name.startswith(p + ".") or p.startswith(name + ".") or name == "" for p in scope)


def _redirect(route: AttentionRoute, transformer, query, key, value, attn_mask=None, dropout_p=0.0,
              is_causal=False, scale=None, enable_gqa=False, _module: str = "", **extra):
    """One routed SDPA call: GQA by ``route.gqa_path``; with a context-parallel config on the
    transformer, through ``dispatch_attention_fn`` (the CP backend's own SDPA call is the real
    one: the redirect mode is off while this runs)."""
    route.calls += 1
    hq, hk = query.shape[-3], key.shape[-3]
    cfg = getattr(transformer, "_parallel_config", None)
    cp = getattr(cfg, "context_parallel_config", cfg) if cfg is not None else None
    if cp is not None and not _in_scope(_module, route.cp_scope):
        cp = None  # outside the split region: the whole sequence is on every rank
    if hk != hq:
        route.gqa_calls += 1
        # under CP, cache-dit's templated Ulysses/Ring attention takes no GQA: K/V are
        # repeated to the query heads before the all-to-all
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
    """The modules whose own code calls SDPA, outside diffusers' dispatch-aware processors; the
    outermost only — a caller inside another caller is already inside its redirect's extent."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in transformer.named_modules():
        if not (_processor_calls_sdpa(module) or (not _dispatch_aware(module) and _calls_sdpa(module))):
            continue
        if any(outer == "" or name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def route_attention(transformer, gqa_path: str = "enable_gqa") -> AttentionRoute:
    """Wrap the forward of every attention module (outside diffusers' dispatch-aware processors)
    that calls ``scaled_dot_product_attention`` so the call goes through ``dispatch_attention_fn``
    with the model's context-parallel config (``transformer._parallel_config``, set when CP is
    enabled), and GQA takes ``gqa_path``. Under CP, K/V are repeated to the query heads before the
    all-to-all (the templated CP attention takes no GQA).

    Per module: each wrap (``ditbook.hooks``) enters an ``SdpaRedirect`` for that forward only;
    ``torch.nn.functional`` is never changed. All or nothing: a wrap that fails half-way takes the
    earlier ones off. ``route.remove()`` undoes it."""
    route = AttentionRoute(gqa_path=gqa_path)

    def routed_as(name, module):
        # chosen for its processor alone: re-checked per call, since a CP planner may replace the
        # processor's __call__ by one that dispatches itself (routing it too would split twice)
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
