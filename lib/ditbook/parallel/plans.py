"""Parallel plans by name: what a plan asks for, parsed from names like ``ulysses2`` or
``cfg2_ulysses2+cache``.

A plan is a point in the mesh ``cfg x ring x ulysses`` (the world size is their product), plus
whether a cache strategy rides on top. ``single`` is the one-process baseline.

Grammar (parts joined by ``_``, options after ``+``)::

    single | cfg2 | ulysses<N> | ring<N> | usp<R>x<U> (ring R x ulysses U)
                    (a plain ring<N> runs ditbook's own ring attention, ``parallel.ring``; rings
                     in USP, CFG or +cache plans run cache-dit's, CUDA only)
    cfg2_ulysses<N> | cfg2_ring<N> | cfg2_usp<R>x<U>
    ...+cache       (cache-dit DBCache on top, skip decision agreed across ranks; through cache-dit's
                     adapter where it registers the pipeline, else ditbook's generated one)
    ...+compile     (regional torch.compile of the repeated blocks, after the parallel hooks)
    ...+graph       (each transformer call replayed as a CUDA graph, ``parallel.graphs``; GPU only;
                     with +cache: graphs of the computed steps only, and only for a static cache
                     schedule, ``parallel.cache`` with a ``steps_computation_mask`` and
                     ``steps_computation_policy: static`` — a dynamic cache is refused before launch
                     by ``graphs.cache_graph_refusal``, naming why)
    tp<N>           (tensor parallel of the transformer's linear layers, ``parallel.tensor``)
    vae<N>          (patch-parallel VAE decode: latent rows split over the ranks, ``parallel.vae``)
    te<N>           (text-encoder calls spread over the ranks, ``parallel.text_encoder``)
    vae<N>/te<N> ride on any plan of the same world size (``ulysses2_vae2_te2``); ``refusal`` names
    the kinds ditbook does not run yet, before any process starts.

Compositions: the options combine, e.g. ``ulysses2+cache+compile``, ``ulysses2+cache+compile+graph``,
``cfg2+cache+compile``; each is judged like every plan, against the one-process run of the same
cache (``single+cache``) with ``parallel.gates`` and against the uncached baseline with ``cache.gates``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

_PART = re.compile(r"^(cfg|ulysses|ring|usp|tp|vae|te)(\d+)(?:x(\d+))?$")
_NOT_RUN: dict[str, str] = {}  # kind name -> why ditbook's grammar refuses it (none at present)
TP_COMPOSED = ("tensor parallel is run alone (tp<N>, optionally with vae<N>/te<N>): its composition with CFG or "
               "context parallel (a 2-D mesh) is not wired")


def refusal(spec: "PlanSpec") -> str | None:
    """Why ditbook will not launch this plan (None when it can): checked before any process starts."""
    if spec.tp > 1 and (spec.cfg > 1 or spec.uses_cp):
        return TP_COMPOSED
    if spec.tp > 1 and (spec.cache or spec.compile or spec.graph):
        return "tensor parallel runs without +cache, +compile or +graph (their order with the sharding is not wired)"
    return None


def own_ring(spec: "PlanSpec") -> bool:
    """Whether the plan's ring attention is ditbook's own (``parallel.ring``: any device): a plain
    ``ring<N>``. Rings inside USP, CFG x ring or +cache plans go through cache-dit's (CUDA only)."""
    return spec.ring > 1 and spec.ulysses == 1 and spec.cfg == 1 and spec.tp == 1 and not spec.cache


class PlanNameError(ValueError):
    pass


@dataclass(frozen=True)
class PlanSpec:
    name: str
    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    vae: int = 1  # ranks sharing one VAE decode (patch parallel)
    te: int = 1  # ranks sharing the text-encoder calls
    cache: bool = False
    compile: bool = False
    graph: bool = False
    options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def cp(self) -> int:
        """Context-parallel degree (ranks that share one sequence)."""
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        # the VAE and the text encoders run on the same ranks as the transformer's plan
        return max(self.cfg * self.cp * self.tp, self.vae, self.te)

    @property
    def uses_cp(self) -> bool:
        return self.cp > 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["world_size"] = self.world_size
        return d


def parse_plan(name: str) -> PlanSpec:
    """``cfg2_ulysses2+cache`` -> PlanSpec(cfg=2, ulysses=2, cache=True)."""
    raw = name.strip()
    if not raw:
        raise PlanNameError("empty plan name")
    base, *opts = raw.split("+")
    flags = {"cache": False, "compile": False, "graph": False}
    for o in opts:
        if o not in flags:
            raise PlanNameError(f"plan {name!r}: unknown option '+{o}' (known: {', '.join('+' + f for f in flags)})")
        if flags[o]:
            raise PlanNameError(f"plan {name!r}: +{o} given twice")
        flags[o] = True
    if base == "single":
        return PlanSpec(name=raw, **flags)
    kw: dict = {}
    for part in base.split("_"):
        m = _PART.match(part)
        kind_name = re.sub(r"\d+$", "", part)
        if not m and kind_name in _NOT_RUN:
            raise PlanNameError(f"plan {name!r}: {_NOT_RUN[kind_name]}")
        if not m:
            raise PlanNameError(f"plan {name!r}: cannot read {part!r}; expected one of "
                                f"cfg2, ulysses<N>, ring<N>, usp<R>x<U>, tp<N>, vae<N>, te<N>, single")
        kind, a, b = m.group(1), int(m.group(2)), m.group(3)
        if kind in kw or (kind == "usp" and ("ulysses" in kw or "ring" in kw)):
            raise PlanNameError(f"plan {name!r}: {kind} given twice")
        if kind == "usp":
            if b is None:
                raise PlanNameError(f"plan {name!r}: usp needs RxU, e.g. usp2x2")
            kw["ring"], kw["ulysses"] = a, int(b)
        elif b is not None:
            raise PlanNameError(f"plan {name!r}: only usp takes RxU")
        else:
            kw[kind] = a
    core = kw.get("cfg", 1) * kw.get("ulysses", 1) * kw.get("ring", 1) * kw.get("tp", 1)
    for part in ("vae", "te"):
        if kw.get(part, 1) > 1 and core > 1 and kw[part] != core:
            raise PlanNameError(f"plan {name!r}: {part}{kw[part]} runs on the plan's {core} ranks, so it is {part}{core}")
    if kw.get("cfg", 1) not in (1, 2):
        raise PlanNameError(f"plan {name!r}: CFG parallel splits two branches, so cfg is 2")
    for k, v in kw.items():
        if v < 1:
            raise PlanNameError(f"plan {name!r}: {k} must be >= 1")
    return PlanSpec(name=raw, **flags, **kw)


def plan_name(cfg: int = 1, ulysses: int = 1, ring: int = 1, tp: int = 1, cache: bool = False,
              compile: bool = False, graph: bool = False, vae: int = 1, te: int = 1) -> str:
    parts = []
    if cfg > 1:
        parts.append(f"cfg{cfg}")
    if ring > 1 and ulysses > 1:
        parts.append(f"usp{ring}x{ulysses}")
    elif ulysses > 1:
        parts.append(f"ulysses{ulysses}")
    elif ring > 1:
        parts.append(f"ring{ring}")
    if tp > 1:
        parts.append(f"tp{tp}")
    if vae > 1:
        parts.append(f"vae{vae}")
    if te > 1:
        parts.append(f"te{te}")
    name = "_".join(parts) or "single"
    return name + "".join(f"+{o}" for o, on in (("cache", cache), ("compile", compile), ("graph", graph)) if on)
