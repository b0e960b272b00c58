"""Context-parallel plans in diffusers' ``_cp_plan`` format: registered ones where they exist, else derived from a
traced forward (no model names): 1. ``trace_forward`` records module and block calls and which lists see the image;
2. ``find_streams`` finds the image / text tokens and tables of the main lists; 3. every split lands before the first
block (producer, first block, or transformer input); 4. ``_gather_site`` after the last block; 5.
``check_plan_sites``; 6. ``resolve_cp_plan`` keeps the first variant ``cp.dryrun`` passes."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .sharding import _tensors, bind_inputs, block_lists, shard_sizes

# names of a block's *parameters* (not of models): which token stream is which
_IMAGE_NAMES = re.compile(r"^(hidden_states|x|img|image|latents?|h|tokens)$")
_TEXT_NAMES = re.compile(r"(encoder|context|txt|text|cond|caption|prompt)")
_MASK_NAMES = re.compile(r"mask")


class PlanDerivationError(RuntimeError):
    """The traced forward does not show where to split or gather; the message says what is missing."""


class PlanCheckError(PlanDerivationError):
    """A plan found before launch to crash or compute wrongly (``final``: no plan can help)."""

    final = False


class PlanSiteError(PlanDerivationError):
    """A plan splits after the blocks (or splits nothing): every rank would run the whole sequence."""


@dataclass
class CPPlan:
    plan: dict
    source: str  # "diffusers:<Class>._cp_plan", "cache-dit:<Planner>", "derived", "file:<path>"
    notes: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"source": self.source, "notes": list(self.notes), "facts": dict(self.facts),
                "plan": plan_to_jsonable(self.plan)}


def _is_input(v) -> bool:
    return isinstance(v, ContextParallelInput) or type(v).__name__.endswith("ContextParallelInput")


def _is_output(v) -> bool:
    return isinstance(v, ContextParallelOutput) or type(v).__name__.endswith("ContextParallelOutput")


def plan_to_jsonable(plan: dict) -> dict:
    def one(v):
        if _is_input(v):
            return {"split_dim": v.split_dim, "expected_dims": v.expected_dims, "split_output": v.split_output}
        if _is_output(v):
            return {"gather_dim": v.gather_dim, "expected_dims": v.expected_dims}
        if isinstance(v, dict):
            return {str(k): one(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [one(x) for x in v]
        return repr(v)
    return {k: one(v) for k, v in plan.items()}


class RegisteredPlanError(RuntimeError):
    """A planner is registered for this class but failed on this transformer instance."""


def registered_cp_plan(transformer, degree: int = 2) -> CPPlan | None:
    """diffusers' ``_cp_plan`` or cache-dit's registered planner's plan; None when neither exists."""
    cls = type(transformer)
    plan = getattr(cls, "_cp_plan", None)
    if plan:
        return CPPlan(dict(plan), f"diffusers:{cls.__name__}._cp_plan")
    try:  # cache-dit's planners import optional packages (einops); absent -> no planner
        from cache_dit import ParallelismConfig
        from cache_dit.distributed.transformers.dispatch import _ensure_cp_planners_activated
        from cache_dit.distributed.transformers.register import ContextParallelismPlannerRegister

        _ensure_cp_planners_activated()
        planner = ContextParallelismPlannerRegister.get_planner(transformer)
    except Exception:  # noqa: BLE001 - no planner registered, or planners not importable
        return None
    try:
        # _apply, not apply: apply() also stores the plan on the instance
        plan = planner()._apply(transformer=transformer, parallelism_config=ParallelismConfig(ulysses_size=degree))
    except Exception as exc:  # noqa: BLE001 - reported, the caller decides
        raise RegisteredPlanError(f"cache-dit planner {planner.__name__} failed on {cls.__name__}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    if not plan:
        raise RegisteredPlanError(f"cache-dit planner {planner.__name__} returned no plan for {cls.__name__}")
    return CPPlan(dict(plan), f"cache-dit:{planner.__name__}")


class _Captured(Exception):
    pass


def capture_transformer_call(pipe, card, **render_overrides) -> tuple[tuple, dict]:
    """The (args, kwargs) of the transformer's first call in a real pipeline run (stopped there)."""
    from ..render import call_kwargs, make_generator

    box: dict = {}

    def hook(module, args, kwargs):
        box["args"], box["kwargs"] = args, dict(kwargs)
        raise _Captured

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        kw = call_kwargs(pipe, card, **{"num_inference_steps": 2, **render_overrides})
        pipe(prompt=card.generation.prompts[0], generator=make_generator(card.generation.seeds[0]), **kw)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "kwargs" not in box:
        raise PlanDerivationError("the pipeline run never called the transformer")
    return box["args"], box["kwargs"]


def _shapes(value) -> list[list[int]] | None:
    ts = _tensors(value)
    return None if ts is None else [list(t.shape) for t in ts]


@dataclass
class ModuleCall:
    name: str
    order: int
    inputs: list[list[int]]  # shapes of the tensors it took
    outputs: list[list[int]] | None  # shapes of what it returned (None: not tensors)


@dataclass
class ListTrace:
    name: str
    length: int
    first_order: int  # when its first block was called
    last_order: int  # when its last block call returned
    inputs: dict[str, list[list[int]]]  # parameter -> shapes, first block's first call
    outputs: list[list[int]]
    keywords: list[str]
    input_ids: dict[str, list[int]]  # parameter -> id() of each tensor
    sequences: set[str] = field(default_factory=set)  # parameters given as a tuple/list of tensors
    scalars: dict[str, int] = field(default_factory=dict)  # integer arguments (grid sizes, ...)
    sees_image: bool | None = None  # its input changes with the transformer's image input (None: not probed)
    unchanged: set[str] | None = None  # arguments every block takes as the same tensor (None: one block call)


@dataclass
class ForwardTrace:
    calls: list[ModuleCall]  # modules outside the block lists, in call order
    lists: dict[str, ListTrace]  # the block lists the forward calls, in call order
    producers: dict[int, tuple[str, int]]  # id(tensor) -> (module, output index), before the blocks
    call_counts: dict[str, int]
    roots: dict[str, list[list[int]]] = field(default_factory=dict)  # the transformer's tensor inputs: shapes
    root_ids: dict[str, list[int]] = field(default_factory=dict)
    image_root: str | None = None  # which of them is the image (perturbed to find the lists that see it)
    consumers: dict[int, list[str]] = field(default_factory=dict)  # id(root input) -> modules that took it
    output_shape: list[int] | None = None  # of the transformer's main output
    output: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def first_call(self, name: str) -> int | None:
        return next((c.order for c in self.calls if c.name == name), None)


def _inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass
class _TraceState:
    """What the hooks of ``trace_forward`` record while the forward runs."""

    root_set: set[int]  # ids of the transformer's own tensor inputs
    n: int = 0
    calls: list[ModuleCall] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    firsts: dict[str, dict] = field(default_factory=dict)  # block list -> its first block's first call
    seconds: dict[str, dict] = field(default_factory=dict)  # block list -> its second block's first call: ids
    lasts: dict[str, int] = field(default_factory=dict)  # block list -> when its last block call returned
    producers: dict[int, tuple[str, int]] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)  # keeps ids unique while the trace runs
    consumers: dict[int, list[str]] = field(default_factory=dict)

    def tick(self) -> int:
        self.n += 1
        return self.n


def _hook_block(mod, lname: str, rec: _TraceState, index: int = 0) -> list:
    """Hooks on one block of list ``lname``: its first call's inputs, and when the list ends."""
    def bpre(m, a, kw, _l=lname):
        order = rec.tick()
        if index == 1 and _l in rec.firsts and _l not in rec.seconds:
            named = bind_inputs(m, a, kw)
            rec.seconds[_l] = {k: [id(t) for t in _tensors(v)] for k, v in named.items() if _tensors(v)}
            rec.keep += [t for v in named.values() for t in (_tensors(v) or [])]  # ids stay unique
        if _l not in rec.firsts:
            named = bind_inputs(m, a, kw)
            rec.firsts[_l] = {"order": order, "named": {k: v for k, v in named.items() if _tensors(v) is not None},
                              "keywords": list(kw), "print": _fingerprint(named),
                              "scalars": _int_arguments(named)}

    def bpost(m, a, kw, out, _l=lname):
        rec.lasts[_l] = rec.tick()
        if "outputs" not in rec.firsts[_l]:
            rec.firsts[_l]["outputs"] = _shapes(out) or []
    return [mod.register_forward_pre_hook(bpre, with_kwargs=True),
            mod.register_forward_hook(bpost, with_kwargs=True)]


def _hook_module(mod, name: str, rec: _TraceState) -> list:
    """Hooks on one module outside the blocks: its call, shapes, root inputs taken, tensors made before any block."""
    def pre(m, a, kw, _n=name):
        rec.counts[_n] = rec.counts.get(_n, 0) + 1
        ins = []
        for v in list(a) + list(kw.values()):
            ins += [list(t.shape) for t in (_tensors(v) or [])]
            for t in _tensors(v) or []:  # root inputs stay alive: their ids are unique for the whole call
                if id(t) in rec.root_set:
                    rec.consumers.setdefault(id(t), []).append(_n)
        rec.calls.append(ModuleCall(_n, rec.tick(), ins, None))
        m.__dict__.setdefault("_ditbook_trace_calls", []).append(rec.calls[-1])

    def post(m, a, out, _n=name):
        call = m.__dict__["_ditbook_trace_calls"].pop()
        call.outputs = _shapes(out)
        if not rec.firsts:  # before any block: remember which module made which tensor
            for i, t in enumerate(_tensors(out) or []):
                rec.keep.append(t)
                rec.producers.setdefault(id(t), (_n, i))
    return [mod.register_forward_pre_hook(pre, with_kwargs=True), mod.register_forward_hook(post)]


def _install_trace_hooks(transformer, lists, rec: _TraceState) -> list:
    """Block hooks on the block lists' elements, module hooks on everything else."""
    element_of = {}
    for lname in lists:
        for i, blk in enumerate(transformer.get_submodule(lname)):
            element_of[id(blk)] = (lname, i)
    handles = []
    for name, mod in transformer.named_modules():
        if not name:
            continue
        if id(mod) in element_of:
            handles += _hook_block(mod, element_of[id(mod)][0], rec, element_of[id(mod)][1])
        else:
            handles += _hook_module(mod, name, rec)
    return handles


def _unchanged(first_named: dict, second_ids: dict | None) -> set[str] | None:
    """The arguments the second block call received as the very tensors of the first call."""
    if second_ids is None:
        return None
    return {k for k, v in first_named.items()
            if second_ids.get(k) and second_ids[k] == [id(t) for t in _tensors(v) or []]}


def _list_traces(transformer, lists, rec: _TraceState, sees: dict[str, bool] | None) -> dict[str, ListTrace]:
    """The called block lists (not those inside a block of another called list), in call order."""
    called = [n for n in lists if n in rec.firsts]
    # a list inside a block of another called list belongs to that block
    called = [n for n in called if not any(n != o and n.startswith(o + ".") for o in called)]
    traced: dict[str, ListTrace] = {}
    for n in sorted(called, key=lambda n: rec.firsts[n]["order"]):
        f = rec.firsts[n]
        named = f["named"]
        traced[n] = ListTrace(n, len(transformer.get_submodule(n)), f["order"], rec.lasts[n],
                              {k: _shapes(v) for k, v in named.items()}, f.get("outputs", []), f["keywords"],
                              {k: [id(t) for t in _tensors(v)] for k, v in named.items()},
                              {k for k, v in named.items() if isinstance(v, (tuple, list))},
                              f["scalars"], sees.get(n) if sees is not None else None,
                              _unchanged(f["named"], rec.seconds.get(n)))
    return traced


def trace_forward(transformer, args, kwargs) -> ForwardTrace:
    """Step 1: one forward call with hooks on every module and every block."""
    lists = block_lists(transformer)
    root_named = {k: v for k, v in bind_inputs(transformer, args, kwargs).items() if _tensors(v)}
    rec = _TraceState({id(t) for v in root_named.values() for t in _tensors(v)})
    handles = _install_trace_hooks(transformer, lists, rec)
    try:
        with torch.no_grad():
            output = _main_output(transformer(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
        for m in transformer.modules():
            m.__dict__.pop("_ditbook_trace_calls", None)
    image_root = _image_root(transformer, root_named)
    sees = _lists_that_see(transformer, args, kwargs, image_root, {n: f["print"] for n, f in rec.firsts.items()})
    traced = _list_traces(transformer, lists, rec, sees)
    called = list(traced)
    rec.keep.clear()
    return ForwardTrace([c for c in rec.calls if not _inside(c.name, called)], traced, rec.producers,
                        {k: v for k, v in rec.counts.items() if not _inside(k, called)},
                        {k: _shapes(v) for k, v in root_named.items()},
                        {k: [id(t) for t in _tensors(v)] for k, v in root_named.items()}, image_root,
                        {i: names for i, names in rec.consumers.items()},
                        list(output.shape) if output is not None else None,
                        output.detach() if output is not None else None)


def _main_output(out) -> torch.Tensor | None:
    """The transformer's main output: the tensor, else the first tensor in a tuple / ModelOutput."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return next((t for t in map(_main_output, out) if t is not None), None)
    return None


def _int_arguments(named: dict) -> dict[str, int]:
    """A call's integer arguments; those in a tuple/list of ints as ``name[i]``."""
    out = {}
    for k, v in named.items():
        if isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, (tuple, list)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            out.update({f"{k}[{i}]": x for i, x in enumerate(v)})
    return out


def _fingerprint(named: dict) -> dict[str, tuple]:
    """Per tensor argument: (sum, sum of abs) in float64, to tell whether an input changed."""
    out = {}
    for k, v in named.items():
        ts = _tensors(v)
        if ts:
            out[k] = tuple((float(t.double().sum()), float(t.double().abs().sum())) for t in ts
                           if t.is_floating_point())
    return out


def _image_root(transformer, root_named: dict) -> str | None:
    """The transformer's floating input named like the image, else its first floating input."""
    floats = [k for k, v in root_named.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return next((k for k in floats if _IMAGE_NAMES.match(k) or k == "sample"), floats[0] if floats else None)


def perturbation_like(base: torch.Tensor, seed: int) -> torch.Tensor:
    """Seeded CPU noise of ``base``'s shape and scale, on ``base``'s device and dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(tuple(base.shape), generator=g, device="cpu", dtype=torch.float32)
    scale = float(base.detach().float().std().clamp_min(1.0)) if base.numel() > 1 else 1.0
    return (noise * scale).to(device=base.device, dtype=base.dtype)


def _lists_that_see(transformer, args, kwargs, image_root: str | None, prints: dict) -> dict[str, bool] | None:
    """Which block lists' first block input changes when the image input is perturbed (None: not probed)."""
    if image_root is None:
        return None
    args, kw = list(args), dict(kwargs)
    at = kw if image_root in kw else args
    key = image_root if at is kw else list(bind_inputs(transformer, args, kwargs)).index(image_root)
    at[key] = at[key] + perturbation_like(at[key], seed=1234)
    seen: dict[str, dict] = {}
    handles = []
    for lname in block_lists(transformer):
        first = transformer.get_submodule(lname)[0]

        def bpre(m, a, k, _l=lname):
            if _l not in seen:
                seen[_l] = _fingerprint(bind_inputs(m, a, k))
        handles.append(first.register_forward_pre_hook(bpre, with_kwargs=True))
    try:
        with torch.no_grad():
            transformer(*args, **kw)
    except Exception:  # noqa: BLE001 - a model that cannot take the moved input: unknown
        return None
    finally:
        for h in handles:
            h.remove()

    def differs(a: tuple, b: tuple) -> bool:
        return any(abs(x - y) > 1e-6 * max(1.0, abs(x), abs(y)) for p, q in zip(a, b) for x, y in zip(p, q))
    return {n: any(differs(p, seen.get(n, {}).get(k, p)) for k, p in prints[n].items()) for n in prints}


@dataclass
class Streams:
    """Step 2: what enters the first block of the first main list."""

    lists: list[str]  # main lists, in call order
    image: str
    image_shape: list[int]
    text: str | None
    text_shape: list[int] | None
    joint: bool
    left_whole: list[str]  # lists that never see the image tokens

    @property
    def s_img(self) -> int:
        return self.image_shape[1]

    @property
    def s_txt(self) -> int | None:
        return self.text_shape[1] if self.text_shape else None


def _token_inputs(lt: ListTrace) -> dict[str, list[int]]:
    return {k: v[0] for k, v in lt.inputs.items() if v and len(v) == 1 and len(v[0]) == 3}


def _image_of(lt: ListTrace, tr: ForwardTrace | None = None) -> str | None:
    three = _token_inputs(lt)
    named = next((k for k in three if _IMAGE_NAMES.match(k)), None)
    if named:
        return named
    unnamed = [k for k in three if not _TEXT_NAMES.search(k)]
    if len(unnamed) > 1 and tr is not None:
        # unnamed streams (bound from *args as args[0], args[1]): the image is the one the module after the list takes
        after = next((c for c in tr.calls if c.order > lt.last_order
                      and any(three[k] in c.inputs for k in unnamed)), None)
        taken = [k for k in unnamed if after is not None and three[k] in after.inputs]
        if len(taken) == 1:
            return taken[0]
    return unnamed[0] if unnamed else None


def find_streams(tr: ForwardTrace, attention_kind: str | None = None) -> Streams:
    if not tr.lists:
        raise PlanDerivationError("the forward calls no block list (nn.ModuleList of blocks) to split the "
                                  "sequence for")
    images = {n: _image_of(lt, tr) for n, lt in tr.lists.items()}
    lengths = {n: _token_inputs(tr.lists[n])[p][1] for n, p in images.items() if p}
    if not lengths:
        desc = {n: lt.inputs for n, lt in tr.lists.items()}
        raise PlanDerivationError(f"no block list takes [batch, sequence, width] image tokens: {desc}")
    seeing = [n for n in tr.lists if n in lengths and tr.lists[n].sees_image]
    if seeing:
        main = seeing  # every list whose input follows the image tokens gets a shard
    else:  # not probed (or nothing changed): the lists with the longest image stream
        s_main = max(lengths.values())
        main = [n for n in tr.lists if lengths.get(n) == s_main]
    first = tr.lists[main[0]]
    img = images[main[0]]
    three = _token_inputs(first)
    shape = three[img]
    txt = next((k for k in three if k != img and _TEXT_NAMES.search(k)), None) or next(
        (k for k in three if k != img and three[k][0] == shape[0]), None)
    tshape = three[txt] if txt else None
    if attention_kind is None:
        outs = [o for o in first.outputs if len(o) == 3]
        updated = bool(tshape and any(o[1] == tshape[1] for o in outs)
                       and (tshape[1] != shape[1] or len(outs) >= 2))
        attention_kind = "joint" if updated else ("cross" if txt else "self")
    return Streams(main, img, shape, txt, tshape, attention_kind == "joint",
                   [n for n in tr.lists if n not in main])


def expected_lengths(tr: ForwardTrace, streams: Streams) -> dict[str, dict]:
    """Per main list: its image-token argument and full length (what ``check_sharding`` expects)."""
    out = {}
    for name in streams.lists:
        lt = tr.lists[name]
        param = streams.image if name == streams.lists[0] else _image_of(lt, tr)
        if param is not None:
            out[name] = {"argument": param, "full": _token_inputs(lt)[param][1]}
    return out


def _producer(tr: ForwardTrace, ids: list[int], before: int) -> tuple[str, list[int]] | None:
    """The one module (called once, before ``before``) that returned exactly these tensors."""
    sites = [tr.producers.get(i) for i in ids]
    if not sites or any(s is None for s in sites) or len({s[0] for s in sites}) != 1:
        return None
    name = sites[0][0]
    first = tr.first_call(name)
    if tr.call_counts.get(name) != 1 or first is None or first >= before:
        return None
    return name, [s[1] for s in sites]


def _position_inputs(tr: ForwardTrace, st: Streams, first: ListTrace, before: int) -> dict[str, tuple[int, int]] | None:
    """The transformer's separate image and text position inputs: {input: (axis, dims)}, or None."""
    stream_ids = set(first.input_ids.get(st.image, [])) | set(first.input_ids.get(st.text, []) if st.text else [])
    # modules that make a token stream (their output has a stream's shape): their inputs are streams
    shapes_of = [st.image_shape] + ([st.text_shape] if st.text_shape else [])
    producers = {c.name for c in tr.calls if c.order < before and c.outputs and any(o in shapes_of for o in c.outputs)}
    found: dict[str, tuple[int, int]] = {}
    kinds = set()
    for name, shapes in tr.roots.items():
        ids = tr.root_ids.get(name, [])
        if name == tr.image_root or len(shapes) != 1 or any(i in stream_ids for i in ids) \
                or any(set(tr.consumers.get(i, [])) & producers for i in ids):
            continue
        s = shapes[0]
        for axis, n in enumerate(s[:-1]):
            if n == st.s_img and n != st.s_txt:
                found[name], kind = (axis, len(s)), "image"
            elif n == st.s_txt and n != st.s_img:
                found[name], kind = (axis, len(s)), "text"
            else:
                continue
            kinds.add(kind)
            break
    return found if kinds == {"image", "text"} else None


def _stream_root(tr: ForwardTrace, first: ListTrace, param: str, before: int) -> str | None:
    """The transformer input ``[B, S, C]`` a first-block token stream is made from (None: none)."""
    shape = first.inputs[param][0]
    makers = {c.name for c in tr.calls if c.order < before and c.outputs and shape in c.outputs}
    for name, shapes in tr.roots.items():
        if len(shapes) != 1 or len(shapes[0]) != 3 or shapes[0][0] != shape[0] or shapes[0][1] != shape[1]:
            continue
        ids = tr.root_ids.get(name, [])
        if any(i in first.input_ids[param] for i in ids) or any(set(tr.consumers.get(i, [])) & makers for i in ids):
            return name
    return None


@dataclass
class _Draft:
    """A plan being derived: the trace, its streams, and the plan entries and notes so far."""

    tr: ForwardTrace
    st: Streams
    at_input: bool
    plan: dict[str, Any] = field(default_factory=dict)
    split_text: bool = False  # cross attention with the text split too
    notes: list[str] = field(default_factory=list)
    covered: set[int] = field(default_factory=set)  # ids of block inputs already split at their producer
    at_blocks: dict[int, Any] = field(default_factory=dict)
    whole_masks: list[str] = field(default_factory=list)  # "<list>:<param>": masks over the image kept whole
    at_block: bool = False  # every split where the first block takes it (never a producer or input)

    @property
    def first(self) -> ListTrace:
        return self.tr.lists[self.st.lists[0]]

    @property
    def before(self) -> int:
        return self.first.first_order


def _attention_kind(st: Streams) -> str:
    """"joint", "cross" or "self": how the main blocks' attention treats the text."""
    return "joint" if st.joint else ("cross" if st.text else "self")


def _stream_notes(st: Streams) -> list[str]:
    """The notes that open a derived plan: the main lists, their streams, the attention kind."""
    notes = [f"block lists {st.lists}: image tokens '{st.image}' {st.image_shape}"
             + (f", text '{st.text}' {st.text_shape}" if st.text else "") + f"; attention {_attention_kind(st)}"]
    if st.left_whole:
        notes.append(f"block lists {st.left_whole} never see the image tokens: they run whole on every rank")
    return notes


def _check_shards_divide(st: Streams, degree: int | None, uneven: bool = False) -> list[str]:
    """Refuse a degree that does not divide the tokens (``uneven``: tensor_split shares, noted)."""
    if not degree:
        return []
    s_img, s_txt = st.s_img, st.s_txt
    counts = [("image", s_img)] + ([("text", s_txt)] if st.joint and s_txt else [])
    if uneven and all(n >= degree for _, n in counts):
        return [f"{n} {what} tokens split unevenly into {shard_sizes(n, degree)} over {degree} ranks "
                f"(torch.tensor_split shares: the launch enables cache-dit's ulysses_anything)"
                for what, n in counts if n % degree]
    if s_img % degree:
        layout = (f" (the blocks take '{st.image}' as {st.image_shape}: its dim 1, the token axis of a "
                  f"[batch, sequence, width] input, has {s_img}; a sequence-first or per-frame layout is not "
                  f"split by a derived plan)" if s_img < degree else "")
        raise PlanDerivationError(f"{s_img} image tokens do not divide into {degree} equal shards{layout}")
    if st.joint and s_txt and s_txt % degree:
        raise PlanDerivationError(f"joint attention: {s_txt} text tokens do not divide into {degree} equal "
                                  f"shards, and the text must be split with the image")
    return []


def _split_stream(d: _Draft, param: str, dim: int, what: str) -> None:
    """Split one token stream at the transformer's input (``at_input``), else its producer, else the first block."""
    tr, first, plan = d.tr, d.first, d.plan
    ids, shapes = first.input_ids[param], first.inputs[param]
    root = _stream_root(tr, first, param, d.before) if d.at_input else None
    prod = _producer(tr, ids, d.before) if not d.at_block else None
    if root is not None:
        plan.setdefault("", {})[root] = ContextParallelInput(split_dim=1, expected_dims=len(tr.roots[root][0]))
        d.notes.append(f"split {what} at the transformer's input '{root}' (dim 1): what the forward reads from "
                       f"that input (its token count) is then the shard's")
        return
    if prod is not None:
        entry = plan.setdefault(prod[0], {})
        for i, s in zip(prod[1], shapes):
            entry[i] = ContextParallelInput(split_dim=dim, expected_dims=len(s), split_output=True)
        d.notes.append(f"split {what} at the output of '{prod[0]}' (dim {dim}), before the first block")
    else:
        cpi = ContextParallelInput(split_dim=dim, expected_dims=len(shapes[0]))
        key = _block_key(first, param, unknown_every=False)
        plan.setdefault(key, {})[param] = cpi
        if key.endswith(".*"):  # every block takes this very tensor (not the previous block's output)
            d.notes.append(f"split {what} '{param}' at every block of '{first.name}' (dim {dim}): each block "
                           f"takes the same whole tensor, not the previous block's output")
        else:
            d.notes.append(f"split {what} '{param}' where it enters '{first.name}.0' (dim {dim})")
        d.at_blocks.update({i: cpi for i in ids})


def _split_token_streams(d: _Draft) -> None:
    """Step 3: the image tokens, and the text tokens with them under joint attention."""
    st = d.st
    _split_stream(d, st.image, 1, "image tokens")
    if st.text:
        if st.joint:
            _split_stream(d, st.text, 1, "text tokens (joint attention: each rank holds a matching slice)")
        elif d.split_text:
            _split_stream(d, st.text, 1, "text tokens (cross attention whose keys join the text to the image "
                                         "tokens: each rank holds a slice, the CP attention gathers them all)")
        else:
            d.notes.append("text kept whole: cross attention reads the full text on every rank")


def _split_mask(d: _Draft, lname: str, param: str, shapes: list[list[int]]) -> None:
    """A mask argument of a main list: a text mask follows the text; one over the image is refused."""
    st = d.st
    s_img, s_txt = st.s_img, st.s_txt
    s = shapes[0]
    if len(s) == 2 and s_txt and s[1] == s_txt and s_txt != s_img:
        if st.joint or d.split_text:
            d.plan.setdefault(f"{lname}.*", {})[param] = ContextParallelInput(split_dim=1, expected_dims=2)
            d.notes.append(f"text mask '{param}' {s} split with the text at every block of '{lname}'")
        else:
            d.notes.append(f"text mask '{param}' {s} kept whole (cross attention)")
        return
    if d.at_block and len(shapes) == 1 and len(s) == 2 and s[0] == st.image_shape[0] and s[1] == s_img:
        # one flag per token [B, S]: split with the tokens (the launch gathers a mask's keys: ``cp.mask``)
        d.plan.setdefault(f"{lname}.*", {})[param] = ContextParallelInput(split_dim=1, expected_dims=2)
        d.notes.append(f"token mask '{param}' {s} split with the tokens at every block of '{lname}'")
        return
    if len(s) >= 2 and any(L in (s_img, s_img + (s_txt or 0)) for L in s[1:]):
        # under Ulysses the attention sees the whole sequence: a mask only the attention reads stays whole
        d.notes.append(f"mask '{param}' {s} of '{lname}' covers the image sequence: kept whole (under Ulysses "
                       f"the attention sees the whole sequence; the dry run and the simulated ranks judge "
                       f"whether only the attention reads it)")
        d.whole_masks.append(f"{lname}:{param}")


def _is_concatenated_stream(d: _Draft, lname: str, shapes: list[list[int]]) -> bool:
    """Text and image tokens the model concatenated from the split streams, entering a later main list."""
    st = d.st
    s_txt = st.s_txt
    return bool(s_txt and len(shapes) == 1 and len(shapes[0]) == 3 and shapes[0][0] == st.image_shape[0]
                and shapes[0][1] == st.s_img + s_txt and lname != d.first.name)


def _split_joint_table(d: _Draft, lname: str, param: str, shapes: list[list[int]], ids: list[int]) -> None:
    """A positional table over text and image: split the separate position inputs instead, or refuse."""
    if not d.st.joint:
        raise PlanDerivationError(
            f"positional table '{param}' {shapes} of '{lname}' covers text and image in one axis, "
            f"and the text is kept whole: a derived plan cannot split it consistently")
    pos = _position_inputs(d.tr, d.st, d.first, d.before)
    if pos is None:
        raise PlanDerivationError(
            f"positional table '{param}' {shapes} of '{lname}' covers text and image in one axis; a "
            f"rank holds [text shard, image shard], which one split of the table cannot match, and "
            f"the transformer takes no separate text and image position inputs to split instead")
    root = d.plan.setdefault("", {})
    for name, (dim, nd) in pos.items():
        root[name] = ContextParallelInput(split_dim=dim, expected_dims=nd)
    d.covered.update(ids)
    d.notes.append(f"positional table '{param}' {shapes} covers text and image: split the position "
                   f"inputs {', '.join(f'{k} (dim {dd})' for k, (dd, _) in pos.items())} of the transformer "
                   f"instead, so each rank builds the table of its own [text shard, image shard]")


_WHOLE = "whole"  # a table of a list of tables that no split touches


def _dims_note(dims: list) -> str:
    return "[" + ", ".join("kept whole" if dd is _WHOLE else str(dd) for dd in dims) + "]"


def _split_image_table(d: _Draft, lt: ListTrace, param: str, shapes: list[list[int]], ids: list[int]) -> None:
    """An input with an image-length axis: split on it at its producer, else at the list's blocks."""
    st, plan, lname = d.st, d.plan, lt.name
    s_img = st.s_img
    if len(shapes) == 1 and len(shapes[0]) == 3 and shapes[0][0] == st.image_shape[0] \
            and shapes[0][1] == s_img:
        # a second [B, S_img, .] stream (e.g. a skip input): split like the image
        dims = [1]
    else:
        # the position axis, never the last (feature) axis
        dims = [next((dd for dd, L in enumerate(s[:-1]) if L == s_img), None) for s in shapes]
        if len(shapes) > 1 and any(dd is not None for dd in dims):
            # a list of tables, some over the image: the others follow the text, or stay whole
            text_split = bool(st.s_txt) and (st.joint or d.split_text)
            dims = [dd if dd is not None else next((k for k, L in enumerate(s[:-1]) if text_split and L == st.s_txt),
                                                    _WHOLE) for s, dd in zip(shapes, dims)]
    if any(dd is None for dd in dims):
        return  # no image-length axis: the same on every rank (timestep embedding, ...)
    prod = _producer(d.tr, ids, d.before) if not d.at_block else None
    if prod is not None and prod[0] not in plan:
        entry = plan.setdefault(prod[0], {})
        for i, s, dd in zip(prod[1], shapes, dims):
            if dd is not _WHOLE:
                entry[i] = ContextParallelInput(split_dim=dd, expected_dims=len(s), split_output=True)
        d.covered.update(ids)
        d.notes.append(f"split positional table(s) of '{prod[0]}' {shapes} on dims {_dims_note(dims)} (image "
                       f"positions), before the first block")
    else:
        # a table kept whole: marked split_output, which the input hooks pass through
        cps = [ContextParallelInput(split_dim=0, expected_dims=len(s), split_output=True) if dd is _WHOLE
               else ContextParallelInput(split_dim=dd, expected_dims=len(s)) for s, dd in zip(shapes, dims)]
        spec = cps if param in lt.sequences else cps[0]
        key = _block_key(lt, param, unknown_every=True)
        plan.setdefault(key, {})[param] = spec
        if key.endswith(".0"):  # carried from block to block (a second stream): split once, where it enters
            d.notes.append(f"split '{param}' {shapes} on dims {_dims_note(dims)} where it enters '{lname}.0' (a "
                           f"stream its blocks carry)")
        else:
            d.notes.append(f"split '{param}' {shapes} on dims {_dims_note(dims)} at every block of '{lname}' "
                           f"(image positions)")
        d.at_blocks.update({i: spec for i in ids})


def _block_key(lt: ListTrace, param: str, unknown_every: bool) -> str:
    """``<list>.*`` when every block takes the same tensor, ``<list>.0`` when the blocks carry it."""
    if lt.unchanged is None:
        every = unknown_every
    else:
        every = param in lt.unchanged
    return f"{lt.name}.*" if every else f"{lt.name}.0"


def _split_again(d: _Draft, lt: ListTrace, param: str, ids: list[int]) -> None:
    """A later main list takes the whole tensor an earlier list's blocks split: split it where it enters too."""
    spec = d.at_blocks[ids[0]]
    key = _block_key(lt, param, unknown_every=True)
    d.plan.setdefault(key, {})[param] = spec
    d.notes.append(f"'{param}' of '{lt.name}' is the whole tensor the plan splits at an earlier list's blocks: "
                   f"split again at '{key}'")


def _split_block_inputs(d: _Draft) -> None:
    """Step 3: the other inputs of every main list's blocks (masks, positional tables)."""
    st = d.st
    for lname in st.lists:
        lt = d.tr.lists[lname]
        for param, shapes in lt.inputs.items():
            ids = lt.input_ids[param]
            if lname != st.lists[0] and ids and all(i in d.at_blocks for i in ids) \
                    and not any(i in d.covered for i in ids):
                _split_again(d, lt, param, ids)
                continue
            if param in (st.image, st.text) or not shapes:
                continue
            if all(i in d.covered for i in ids):
                continue
            if _MASK_NAMES.search(param):
                _split_mask(d, lname, param, shapes)
            elif _is_concatenated_stream(d, lname, shapes):
                continue
            elif st.s_txt and any(L == st.s_img + st.s_txt for s in shapes for L in s[:-1]):
                _split_joint_table(d, lname, param, shapes, ids)
            else:
                _split_image_table(d, lt, param, shapes, ids)


def _gather_site(tr: ForwardTrace, st: Streams, at_block: bool = False) -> tuple[ModuleCall, str]:
    """Step 4: where the image tokens are gathered, and a phrase saying which."""
    s_img = st.s_img
    end = max(tr.lists[n].last_order for n in st.lists)
    site = None
    last = max((tr.lists[n] for n in st.lists), key=lambda lt: lt.last_order)
    if at_block and any(len(o) >= 2 and o[1] == s_img for o in last.outputs):
        site = ModuleCall(f"{last.name}.{last.length - 1}", last.last_order, [], last.outputs)
        return site, "the last block (every split where a block takes it, every gather where one returns it)"
    for c in tr.calls:
        if c.order <= end or not c.outputs:
            continue
        if any(len(s) >= 2 and s[1] == s_img for s in c.inputs) and any(len(s) >= 2 and s[1] == s_img
                                                                        for s in c.outputs):
            site = c
            break
    if site is None:
        # the forward reshapes the tokens right after the blocks: gather at the last block
        last = tr.lists[st.lists[-1]]
        if not any(len(o) >= 2 and o[1] == s_img for o in last.outputs):
            raise PlanDerivationError("no module after the blocks takes and returns the image tokens, and the last "
                                      "block does not return them; nowhere to gather them")
        site = ModuleCall(f"{last.name}.{last.length - 1}", last.last_order, [], last.outputs)
        return site, "the last block (the forward reshapes the tokens right after it)"
    if tr.call_counts.get(site.name) != 1:
        raise PlanDerivationError(f"'{site.name}' (where the image tokens would be gathered) is called "
                                  f"{tr.call_counts.get(site.name)} times per forward")
    return site, "the first module after the blocks"


def _add_gather(d: _Draft, site: ModuleCall, where: str) -> None:
    """Step 4: gather every image-token output of ``site`` on dim 1."""
    s_img = d.st.s_img
    outs = [ContextParallelOutput(gather_dim=1, expected_dims=len(s)) if len(s) >= 2 and s[1] == s_img else None
            for s in site.outputs]
    d.plan[site.name] = outs[0] if len(outs) == 1 else tuple(outs)
    d.notes.append(f"gather image tokens at the output of '{site.name}' (dim 1), {where}")


def _plan_facts(d: _Draft, site: ModuleCall) -> dict:
    """What the launch and the sharding check read from a derived plan."""
    st = d.st
    return {"image_seq_len": st.s_img, "text_seq_len": st.s_txt, "width": st.image_shape[2],
            "attention_kind": _attention_kind(st), "block_lists": st.lists, "block_list": st.lists[0],
            "keyword_called": d.first.keywords, "image_input": st.image, "text_input": st.text,
            "gather_site": site.name, "sharding_expected": expected_lengths(d.tr, st),
            "whole_masks": list(d.whole_masks)}


def derive_cp_plan(transformer, args, kwargs, attention_kind: str | None = None, degree: int | None = None,
                   trace: ForwardTrace | None = None, at_input: bool = False, split_text: bool = False,
                   uneven: bool = False, at_block: bool = False, streams: Streams | None = None) -> CPPlan:
    """A CP plan from one traced forward call (steps 1-4), checked by ``check_plan_sites``. ``at_input``: split at the
    transformer's ``[B, S, C]`` inputs; ``split_text``: split cross-attention text too; ``uneven``: ``tensor_split``
    shares for counts the degree does not divide; ``at_block``: every split where the first block takes it;
    ``streams``: default ``find_streams``'s."""
    tr = trace if trace is not None else trace_forward(transformer, args, kwargs)
    st = streams if streams is not None else find_streams(tr, attention_kind)
    d = _Draft(tr, st, at_input and not at_block, notes=_stream_notes(st),
               split_text=split_text and not st.joint and bool(st.text), at_block=at_block)
    d.notes += _check_shards_divide(st, degree, uneven)
    if d.split_text and degree and st.s_txt % degree and not (uneven and st.s_txt >= degree):
        raise PlanDerivationError(f"{st.s_txt} text tokens do not divide into {degree} equal shards")
    _split_token_streams(d)
    _split_block_inputs(d)
    site, where = _gather_site(tr, st, at_block)
    _add_gather(d, site, where)
    cp = CPPlan(d.plan, "derived", d.notes, _plan_facts(d, site))
    check_plan_sites(cp.plan, tr, st)
    cp.plan = {_through_module_dicts(transformer, k): v for k, v in cp.plan.items()}
    return cp


def _through_module_dicts(transformer, key: str) -> str:
    """``key`` as cache-dit's lookup reaches it (a ModuleDict only as the last atom)."""
    atoms, mod = key.split(".") if key else [], transformer
    for i, atom in enumerate(atoms):
        if isinstance(mod, torch.nn.ModuleDict):
            if i == len(atoms) - 1:
                return ".".join(atoms[:i])
            raise PlanSiteError(f"the plan hooks '{key}', inside an entry of the ModuleDict "
                                f"'{'.'.join(atoms[:i])}': cache-dit's plan lookup cannot name a module there")
        if atom == "*" or not hasattr(mod, atom):
            return key
        mod = getattr(mod, atom)
    return key


def check_plan_sites(plan: dict, tr: ForwardTrace, streams: Streams | None = None) -> list[str]:
    """Step 5: every split runs before the first block, and something is split; returns the sites."""
    streams = streams or find_streams(tr)
    first = tr.lists[streams.lists[0]].first_order
    sites = []
    for key, value in plan.items():
        if not isinstance(value, dict) or not any(_is_input(v) or (isinstance(v, (list, tuple)) and any(
                _is_input(x) for x in v)) for v in value.values()):
            continue
        sites.append(key)
        if key == "" or _inside(key.split(".*")[0] if "*" in key else key, tr.lists):
            continue
        order = tr.first_call(key)
        if order is None:
            continue  # never called in this configuration: splits nothing here
        if order > first:
            raise PlanSiteError(f"the plan splits at '{key}', which runs after the first block of "
                                f"'{streams.lists[0]}': every rank would run the blocks on the whole sequence")
    effective = [k for k in sites if k == "" or "*" in k or _inside(k, tr.lists) or tr.first_call(k) is not None]
    if not effective:
        raise PlanSiteError("the plan splits nothing that this forward runs: every rank would run the whole "
                            "sequence")
    return sites


def _given_plan(transformer, plan_file, degree: int) -> tuple[CPPlan | None, list[str]]:
    """The plan of ``plan_file``, else the registered plan (a failing planner is noted)."""
    if plan_file is not None:
        return load_plan_code(plan_file), []
    try:
        return registered_cp_plan(transformer, degree), []
    except RegisteredPlanError as exc:
        return None, [f"registered planner not used: {exc}"]


def _checked_registered(reg: CPPlan, transformer, args, kwargs, tr: ForwardTrace, st: Streams, degree: int,
                        check) -> tuple[CPPlan | None, list[str]]:
    """A registered or file plan checked against the trace and judged by ``check`` (None: refused)."""
    check_plan_sites(reg.plan, tr, st)
    reg.facts.update({"block_lists": st.lists, "image_seq_len": st.s_img, "text_seq_len": st.s_txt,
                      "image_input": st.image, "text_input": st.text,
                      "sharding_expected": expected_lengths(tr, st)})
    if check is None:
        return reg, []
    try:
        reg.facts["prelaunch"] = check(transformer, args, kwargs, reg.plan, tr, st, degree)
        return reg, []
    except PlanCheckError as exc:
        if exc.final:
            raise
        return None, [f"registered plan ({reg.source}) not used: {type(exc).__name__}: {exc}"]


def _last_list_streams(tr: ForwardTrace, st: Streams) -> Streams | None:
    """The streams of a plan splitting the last main list alone, where it takes the longest stream."""
    if len(st.lists) < 2:
        return None
    last = max(st.lists, key=lambda n: tr.lists[n].last_order)
    if any(sum(v[2] == st.image_shape[2] for v in _token_inputs(tr.lists[n]).values()) >= 2
           for n in st.lists if n != last):
        return None  # an earlier list is a dual-stream main list, not a refiner: it must be split
    lt = tr.lists[last]
    img = _image_of(lt, tr)
    shape = _token_inputs(lt).get(img) if img else None
    if shape is None or shape[1] <= st.s_img:
        return None
    return Streams([last], img, shape, None, None, False, [n for n in tr.lists if n != last])


def _derive_checked(transformer, args, kwargs, tr: ForwardTrace, st: Streams, attention_kind, degree: int,
                    check, notes: list[str], uneven: bool = False) -> CPPlan:
    """The first derived plan variant that passes ``check``, else the error naming every variant's reason."""
    variants = [(False, False, "", st), (True, False, "the plan splitting at the transformer's inputs", st)]
    if check is not None:
        variants += [("block", False, "the plan splitting at the first block", st)]
    if check is not None and st.text and not st.joint:
        variants += [(False, True, "the plan splitting the text with the image", st),
                     (True, True, "the plan splitting the text with the image at the transformer's inputs", st),
                     ("block", True, "the plan splitting the text with the image at the first block", st)]
    last = _last_list_streams(tr, st) if check is not None else None
    if last is not None:
        variants += [("block", False, f"the plan splitting '{last.lists[0]}' alone", last)]
    failures: list[tuple[str, PlanDerivationError, dict]] = []
    for at_input, split_text, label, streams in variants:
        try:
            cp = derive_cp_plan(transformer, args, kwargs, attention_kind, degree, trace=tr, at_input=at_input is True,
                                split_text=split_text, uneven=uneven, at_block=at_input == "block",
                                streams=streams if streams is not st else None)
        except PlanDerivationError as exc:
            first_try = not (split_text or (check is not None and failures))  # not a variant after others failed
            if first_try and (check is None or len(variants) == 1):
                if notes:
                    raise type(exc)(f"{exc}; and {notes[0]}") from exc
                raise
            failures.append((label, exc, {}))
            continue
        if any(plan_to_jsonable(cp.plan) == j for _, _, j in failures if j):
            continue  # the same plan again (no stream is made from an input of the transformer)
        try:
            if check is not None:
                cp.facts["prelaunch"] = check(transformer, args, kwargs, cp.plan, tr, streams, degree)
        except PlanCheckError as exc:
            if exc.final:
                raise
            failures.append((label, exc, plan_to_jsonable(cp.plan)))
            continue
        cp.notes[:0] = notes + [f"derived plan {lab or 'splitting where the streams are made'} not used: "
                                f"{type(e).__name__}: {e}" for lab, e, _ in failures]
        return cp
    exc = failures[0][1]
    if not failures[0][0] and all(str(e) == str(exc) for _, e, _ in failures):
        raise type(exc)(f"{exc}" + (f"; and {notes[0]}" if notes else "")) from exc  # one reason for all
    reasons = "; ".join(f"{lab + ': ' if lab else ''}{type(e).__name__}: {e}" for lab, e, _ in failures)
    raise type(exc)(f"derived plan: {reasons}" + (f"; and {notes[0]}" if notes else "")) from exc


def resolve_cp_plan(transformer, capture=None, attention_kind: str | None = None, degree: int = 2,
                    plan_file: str | Path | None = None, check=None, uneven: bool = False) -> CPPlan:
    """The plan of ``plan_file``, else the registered plan, else a derived one. With ``capture()`` the plan is checked
    against a traced forward; ``check`` (``cp.dryrun.verify_before_launch``) judges it before launch (a failing
    registered plan is noted and derived variants tried). ``uneven``: the launch can enable cache-dit's
    ``ulysses_anything``, so uneven token counts are split into ``tensor_split`` shares."""
    cp = _resolve(transformer, capture, attention_kind, degree, plan_file,
                  functools.partial(check, uneven=True) if check is not None and uneven else check, uneven)
    cp.facts["ulysses_anything"] = bool((cp.facts.get("prelaunch") or {}).get("uneven_splits"))
    return cp


def needs_ulysses_anything(cp: CPPlan) -> bool:
    """The plan splits a token count its degree does not divide: cache-dit needs ``ulysses_anything``."""
    return bool(cp.facts.get("ulysses_anything"))


def _resolve(transformer, capture, attention_kind, degree: int, plan_file, check, uneven: bool) -> CPPlan:
    """``resolve_cp_plan`` without the last fact."""
    # the unsplit trace first: some registered planners patch the attention processors
    traced = None
    if capture is not None:
        args, kwargs = capture()
        tr = trace_forward(transformer, args, kwargs)
        traced = (args, kwargs, tr, find_streams(tr, attention_kind))
        from .attention import templated_attention_refusal

        why = templated_attention_refusal(transformer, args, kwargs)
        if why:
            raise PlanCheckError(why)
    reg, notes = _given_plan(transformer, plan_file, degree)
    if plan_file is not None:
        check = None  # the user's explicit plan: it runs, and the ranks' sharding check judges it
    if traced is None:
        if reg is not None:
            return reg
        raise PlanDerivationError(f"{type(transformer).__name__} has no registered CP plan and no call to trace")
    args, kwargs, tr, st = traced
    if reg is not None:
        chosen, notes = _checked_registered(reg, transformer, args, kwargs, tr, st, degree, check)
        if chosen is not None:
            return chosen
    return _derive_checked(transformer, args, kwargs, tr, st, attention_kind, degree, check, notes, uneven)


def _code(v) -> str:
    if type(v).__name__.endswith("ContextParallelInput"):
        return (f"ContextParallelInput(split_dim={v.split_dim}, expected_dims={v.expected_dims}, "
                f"split_output={v.split_output})")
    if type(v).__name__.endswith("ContextParallelOutput"):
        return f"ContextParallelOutput(gather_dim={v.gather_dim}, expected_dims={v.expected_dims})"
    if v is None:
        return "None"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_code(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_code(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ", ".join(_code(x) for x in v) + ",)"
    raise TypeError(f"cannot write {type(v).__name__} in a CP plan")


def plan_code(cp: CPPlan, model: str, transformer_class: str) -> str:
    lines = [
        f'"""Context-parallel plan for {model} ({transformer_class}), written by ditbook.',
        "",
        f"Source: {cp.source}.",
        *[f"- {n}" for n in cp.notes],
        "",
        "Use: cache_dit.enable_cache(pipe, parallelism_config=ParallelismConfig(ulysses_size=N, cp_plan=CP_PLAN))",
        'or transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N), cp_plan=CP_PLAN)."""',
        "",
        "from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput",
        "",
        "CP_PLAN = {",
    ]
    lines += [f"    {k!r}: {_code(v)}," for k, v in cp.plan.items()]
    lines += ["}", "", f"SOURCE = {cp.source!r}", ""]
    return "\n".join(lines)


def write_plan_code(cp: CPPlan, folder: str | Path, model: str, transformer_class: str) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_]+", "_", model)
    path = folder / f"cp_plan_{safe}.py"
    path.write_text(plan_code(cp, model, transformer_class))
    return path


def load_plan_code(path: str | Path) -> CPPlan:
    """Read back a plan file written by ``write_plan_code`` (or edited by hand)."""
    ns: dict = {}
    code = Path(path).read_text()
    exec(compile(code, str(path), "exec"), ns)  # our own generated file, in the run folder
    return CPPlan(ns["CP_PLAN"], ns.get("SOURCE", f"file:{path}"), [f"loaded from {path}"])
