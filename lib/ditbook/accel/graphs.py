"""Replay each transformer call as a CUDA graph (``+graph`` plans): a step split over GPUs can
become host-bound (the host still launches every kernel, hook and collective); a graph of the whole
call (parallel hooks, compiled blocks, all-to-alls) takes the host out of the step.

The forward is wrapped on the instance (``ditbook.hooks``, undone exactly), so hooks already
installed are captured too. Calls are keyed by their signature (tensor shapes, dtypes, devices,
non-tensor values, inference mode): the first ``warmup`` calls of a signature run eagerly, the next
is captured on static copies of its tensors, later ones copy their tensors in and replay. Outputs
are cloned out of the static buffers (true CFG's two calls share a signature). A call that cannot
be keyed, or more than ``max_graphs`` signatures, falls back to eager for good (``stats`` says why).
The replayed call must not change its work outside its tensor inputs, and every rank must capture
the same collectives in the same order.

With a cache (``+cache+graph``) only the work of a *computed* step inside each of cache-dit's cached
units (``call_Mn_blocks``) is replayed (``install_cached_step_graphs``), and only for a schedule
fixed before the run (``static_cache_mask``), else the plan is refused (``cache_graph_refusal``).
The capture itself is a ``Capturer`` (``CudaCapturer`` on GPUs; tests hand in a recording one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..hooks import wrap_method
from . import register
from .technique import Handle, NothingDone, PipelineTechnique, Record


class GraphUnavailable(RuntimeError):
    """The module cannot be replayed as a CUDA graph here (for example: it is not on a GPU)."""


_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def signature(args: tuple, kwargs: dict) -> tuple | None:
    """A hashable key of one call, or None when a non-tensor input cannot be compared."""
    leaves, spec = tree_flatten((args, kwargs))
    key: list = [str(spec), torch.is_inference_mode_enabled(), torch.is_grad_enabled()]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(("T", tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad))
        elif type(leaf) in _SCALARS:  # exact types: a subclass may compare or hash differently
            key.append(("V", type(leaf).__name__, leaf))
        else:
            return None
    return tuple(key)


class Capturer:
    """Turns ``fn`` and its static inputs into a replay callable (returns the static outputs)."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        raise NotImplementedError


class CudaCapturer(Capturer):
    """``torch.cuda.CUDAGraph`` capture sharing one memory pool across a module's graphs."""

    def __init__(self):
        self.pool = None

    def capture(self, fn):
        # one more eager run on a side stream, as the CUDA-graphs notes ask before capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


@dataclass
class _Entry:
    static_leaves: list
    spec: Any
    replay: Callable[[], None]
    out: Any


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    eager_calls: int = 0
    capture_seconds: float = 0.0
    disabled: str | None = None

    def to_dict(self) -> dict:
        return {"captured": self.captured, "replays": self.replays, "eager_calls": self.eager_calls,
                "capture_seconds": round(self.capture_seconds, 3), "disabled": self.disabled}


class StepGraphs:
    """Wraps ``module.forward`` (through ``ditbook.hooks``); ``remove()`` puts it back exactly."""

    WRAP = "ditbook.step-graphs"

    def __init__(self, module: torch.nn.Module, *, warmup: int = 2, max_graphs: int = 4,
                 capturer: Capturer | None = None, attr: str = "forward"):
        self.module = module
        self.attr = attr
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.capturer = capturer or CudaCapturer()
        self.stats = GraphStats()
        self._graphs: dict[tuple, _Entry] = {}
        self._seen: dict[tuple, int] = {}
        self._handle = wrap_method(module, self.WRAP, self._call, attr=attr)

    def _eager(self, original, args, kwargs):
        self.stats.eager_calls += 1
        return original(*args, **kwargs)

    def _call(self, original, *args, **kwargs):
        if self.stats.disabled:
            return self._eager(original, args, kwargs)
        key = signature(args, kwargs)
        if key is None:
            self.stats.disabled = "a call has a non-tensor input that cannot be compared"
            return self._eager(original, args, kwargs)
        entry = self._graphs.get(key)
        if entry is None:
            seen = self._seen.get(key, 0)
            if len(self._seen) > 4 * self.max_graphs:
                self.stats.disabled = f"calls change signature every time ({len(self._seen)} seen)"
                return self._eager(original, args, kwargs)
            if seen < self.warmup:
                self._seen[key] = seen + 1
                return self._eager(original, args, kwargs)
            if len(self._graphs) >= self.max_graphs:
                self.stats.disabled = f"more than {self.max_graphs} call signatures"
                return self._eager(original, args, kwargs)
            entry = self._capture(original, key, args, kwargs)
        else:
            leaves, _ = tree_flatten((args, kwargs))
            for static, new in zip(entry.static_leaves, leaves):
                if isinstance(static, torch.Tensor) and (static.data_ptr() != new.data_ptr()
                                                         or static.stride() != new.stride()):
                    static.copy_(new)
        entry.replay()
        self.stats.replays += 1
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.out)

    def _capture(self, original, key, args, kwargs) -> _Entry:
        t0 = time.perf_counter()
        leaves, spec = tree_flatten((args, kwargs))
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def fn():
            a, kw = tree_unflatten(static, spec)
            return original(*a, **kw)

        replay, out = self.capturer.capture(fn)
        entry = _Entry(static, spec, replay, out)
        self._graphs[key] = entry
        self.stats.captured += 1
        self.stats.capture_seconds += time.perf_counter() - t0
        return entry

    def to_dict(self) -> dict:
        return self.stats.to_dict()

    def remove(self) -> None:
        self._handle.remove()
        self._graphs.clear()


def _module_device(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _require_gpu(module: torch.nn.Module, capturer: Capturer | None) -> None:
    dev = _module_device(module)
    if capturer is None and (dev.type != "cuda" or not torch.cuda.is_available()):
        raise GraphUnavailable(f"+graph replays CUDA work, and the transformer is on {dev.type}; "
                               "run the plan on a GPU or drop +graph")


def install_step_graphs(module: torch.nn.Module, *, warmup: int = 2, max_graphs: int = 4,
                        capturer: Capturer | None = None) -> StepGraphs:
    """Replay ``module``'s calls as CUDA graphs; raises ``GraphUnavailable`` off the GPU."""
    _require_gpu(module, capturer)
    return StepGraphs(module, warmup=warmup, max_graphs=max_graphs, capturer=capturer)


# -- graphs of the computed steps of a static cache schedule ------------------------------------
GRAPHED_CACHE_METHOD = "call_Mn_blocks"  # cache-dit's cached unit: the blocks of a computed step


def static_cache_mask(options: dict | None) -> list[int] | None:
    """The step mask of a cache-dit DBCache configuration whose computed steps are fixed before the
    run (``steps_computation_mask`` with ``steps_computation_policy: static``), else None."""
    o = options or {}
    mask = o.get("steps_computation_mask")
    if mask and str(o.get("steps_computation_policy", "dynamic")) == "static":
        return [int(m) for m in mask]
    return None


def cache_graph_refusal(options: dict | None, steps: int | None = None) -> str | None:
    """Why ``+cache+graph`` cannot run with these cache options (None when it can)."""
    mask = static_cache_mask(options)
    if mask is None:
        return ("+graph with +cache needs a static cache schedule (parallel.cache with steps_computation_mask "
                "and steps_computation_policy: static): with a dynamic threshold the cache decides at run time "
                "which steps compute, so no fixed call pattern exists to capture; drop +graph or give a mask")
    if steps is not None and len(mask) != steps:
        return (f"+graph with +cache: the static mask has {len(mask)} entries and the generation {steps} steps; "
                "a mask of another length would not say which steps compute")
    if not any(mask):
        return "+graph with +cache: the static mask computes no step"
    return None


class CachedStepGraphs:
    """``StepGraphs`` on ``call_Mn_blocks`` of every cached unit cache-dit installed on a transformer."""

    def __init__(self, units: dict[str, torch.nn.Module], mask: list[int], **kw):
        self.mask = mask
        self.graphs = {name: StepGraphs(unit, attr=GRAPHED_CACHE_METHOD, **kw) for name, unit in units.items()}

    @property
    def stats(self) -> GraphStats:
        stats = [g.stats for g in self.graphs.values()]
        return GraphStats(sum(s.captured for s in stats), sum(s.replays for s in stats),
                          sum(s.eager_calls for s in stats), sum((s.capture_seconds for s in stats), 0.0),
                          next((s.disabled for s in stats if s.disabled), None))

    def to_dict(self) -> dict:
        return {**self.stats.to_dict(), "scope": f"computed steps: {GRAPHED_CACHE_METHOD} of each cached unit",
                "units": {n: g.to_dict() for n, g in self.graphs.items()},
                "computed_steps": sum(self.mask), "steps": len(self.mask)}

    def remove(self) -> None:
        for g in self.graphs.values():
            g.remove()


def install_cached_step_graphs(transformer: torch.nn.Module, cache_options: dict | None, *, steps: int | None = None,
                               warmup: int = 2, max_graphs: int = 4, capturer: Capturer | None = None
                               ) -> CachedStepGraphs:
    """Replay the computed steps' block work of a static cache schedule (already enabled) as CUDA
    graphs; raises ``GraphUnavailable`` off the GPU, with a dynamic cache, or without cached units."""
    reason = cache_graph_refusal(cache_options, steps)
    if reason:
        raise GraphUnavailable(reason)
    _require_gpu(transformer, capturer)
    from ..cp.cache_sync import CacheSplitError, cached_block_units

    try:
        units = cached_block_units(transformer)
    except CacheSplitError as exc:
        raise GraphUnavailable(f"+cache+graph: {exc}") from None
    missing = [n for n, u in units.items() if not callable(getattr(u, GRAPHED_CACHE_METHOD, None))]
    if missing:
        raise GraphUnavailable(f"+cache+graph: cache-dit's cached units {missing} have no {GRAPHED_CACHE_METHOD}")
    return CachedStepGraphs(units, static_cache_mask(cache_options), warmup=warmup, max_graphs=max_graphs,
                            capturer=capturer)


# -- the technique ------------------------------------------------------------------------------
@dataclass
class GraphsSettings:
    warmup: int = 2  # eager calls per signature before its capture
    max_graphs: int = 4  # signatures captured before falling back to eager for good
    cache: dict | None = None  # the plan's cache options: graphs of the computed steps only (static schedule)
    steps: int | None = None  # the generation's steps (the static mask must have as many)


@dataclass
class GraphsRecord(Record):
    captured: int = 0
    replays: int = 0
    eager_calls: int = 0
    capture_seconds: float = 0.0
    disabled: str | None = None
    details: dict | None = None  # with a cache: the scope, per-unit stats, computed steps


@register
class CudaGraphs(PipelineTechnique):
    """Each transformer call (with a static cache: each computed step's block work) replayed as a
    CUDA graph: the ``+graph`` plans."""

    name = "cuda_graphs"
    kind = "graphs"
    family = "CUDA graphs of each transformer call"
    Settings = GraphsSettings
    order = 40  # after compile: the compiled blocks are inside the captured call

    @classmethod
    def applicable(cls, facts) -> str | None:
        """``facts``: the transformer (its device decides)."""
        dev = _module_device(facts)
        return None if dev.type == "cuda" and torch.cuda.is_available() else \
            f"CUDA graphs replay CUDA work, and the transformer is on {dev.type}"

    @classmethod
    def apply(cls, pipe, settings: GraphsSettings, *, capturer: Capturer | None = None) -> Handle:
        kw = {"warmup": settings.warmup, "max_graphs": settings.max_graphs, "capturer": capturer}
        graphs = (install_cached_step_graphs(pipe.transformer, settings.cache, steps=settings.steps, **kw)
                  if settings.cache is not None else install_step_graphs(pipe.transformer, **kw))

        def record() -> GraphsRecord:
            d = graphs.to_dict()
            base = {k: d.pop(k) for k in ("captured", "replays", "eager_calls", "capture_seconds", "disabled")}
            return GraphsRecord(cls.name, **base, details=d or None)

        return Handle(graphs.remove, record)

    @classmethod
    def check(cls, record: GraphsRecord | None) -> None:
        """Fails when no call was replayed from a graph."""
        if record is None or record.replays == 0:
            raise NothingDone("CUDA graphs: no call was replayed" + (f" ({record.disabled})" if record and
                                                                   record.disabled else ""))
