"""Context-parallel plans in diffusers' ``_cp_plan`` format: registered ones where they exist,
otherwise derived from a traced forward of the transformer, and written out as code.

A plan maps module names to ``ContextParallelInput`` (split an input, or with
``split_output=True`` an output, along the sequence) and ``ContextParallelOutput`` (gather the
sequence back). The derivation splits where the token sequences are *made* — the outputs of
the image and text embedders and of the RoPE module — so that everything the forward does
with them afterwards (extra work in the block loop, skip connections) sees the same local
shard, and gathers at the last module that still emits image tokens (``proj_out``).

Rules of the derivation (no model names anywhere):

- image tokens: the first module outside the block lists whose output is ``[B, S_img, D]``
  (D = the blocks' hidden width) is split on dim 1;
- text tokens: in joint attention (text and image attend together) the text embedder's output
  ``[B, S_txt, D]`` is split on dim 1 too, since every rank must hold a matching slice of the
  joint sequence; in cross attention the text stays whole (each rank attends its image shard
  to the full text);
- RoPE: a module output with a dimension of length ``S_img`` (image-only rotary tables) is
  split on that dimension, the same slices as the tokens; rotary tables passed to the blocks
  without a producing module are split at every block's input (``blocks.*``);
- masks: a ``[B, S_txt]`` text mask given to the blocks is split with the text in joint
  attention and left whole in cross attention; a full ``[B, ., S, S]`` mask stops the derivation;
- output: the last module outside the block lists whose output is ``[B, S_img, C]`` is gathered
  on dim 1.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

_IMAGE_NAMES = re.compile(r"^(hidden_states|x|img|image|latents?|h|tokens)$")
_TEXT_NAMES = re.compile(r"(encoder|context|txt|text|cond|caption|prompt)")
_ROPE_NAMES = re.compile(r"(rotary|rope|freqs|pos_emb|position)")
_MASK_NAMES = re.compile(r"mask")


class PlanDerivationError(RuntimeError):
    """The traced forward does not show where to split or gather; the message says what is missing."""


@dataclass
class CPPlan:
    plan: dict
    source: str  # "diffusers:<Class>._cp_plan", "cache-dit:<Planner>", "derived"
    notes: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"source": self.source, "notes": list(self.notes), "facts": dict(self.facts),
                "plan": plan_to_jsonable(self.plan)}


def plan_to_jsonable(plan: dict) -> dict:
    def one(v):
        if isinstance(v, ContextParallelInput) or type(v).__name__.endswith("ContextParallelInput"):
            return {"split_dim": v.split_dim, "expected_dims": v.expected_dims, "split_output": v.split_output}
        if isinstance(v, ContextParallelOutput) or type(v).__name__.endswith("ContextParallelOutput"):
            return {"gather_dim": v.gather_dim, "expected_dims": v.expected_dims}
        if isinstance(v, dict):
            return {str(k): one(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [one(x) for x in v]
        return repr(v)
    return {k: one(v) for k, v in plan.items()}


def registered_cp_plan(transformer) -> CPPlan | None:
    """diffusers' class ``_cp_plan`` or cache-dit's registered planner for this class, if any."""
    cls = type(transformer)
    plan = getattr(cls, "_cp_plan", None)
    if plan:
        return CPPlan(dict(plan), f"diffusers:{cls.__name__}._cp_plan")
    try:  # cache-dit's planners import optional packages (einops); absent -> no planner
        from cache_dit.distributed.transformers.dispatch import _ensure_cp_planners_activated
        from cache_dit.distributed.transformers.register import ContextParallelismPlannerRegister
        from cache_dit import ParallelismConfig

        _ensure_cp_planners_activated()
        planner = ContextParallelismPlannerRegister.get_planner(transformer)
        plan = planner()._apply(transformer=None, parallelism_config=ParallelismConfig(ulysses_size=2))
        if plan:
            return CPPlan(dict(plan), f"cache-dit:{planner.__name__}")
    except Exception:  # noqa: BLE001 - no planner registered, or planners not importable
        return None
    return None


# ---------------------------------------------------------------------------------------------
# capturing a real transformer call and tracing it


class _Captured(Exception):
    pass


def capture_transformer_call(pipe, card, **render_overrides) -> tuple[tuple, dict]:
    """The (args, kwargs) of the transformer's first call in a real pipeline run (1 step, first
    prompt and seed); the run stops right there."""
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


def _shapes(value) -> list[list[int] | None] | None:
    if isinstance(value, torch.Tensor):
        return [list(value.shape)]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return [list(v.shape) if v is not None else None for v in value]
    if hasattr(value, "sample") and isinstance(getattr(value, "sample"), torch.Tensor):
        return [list(value.sample.shape)]
    return None


def block_lists(transformer) -> list[str]:
    """Names of the transformer's ``nn.ModuleList`` children (its block lists)."""
    return [n for n, m in transformer.named_children() if isinstance(m, torch.nn.ModuleList) and len(m)]


@dataclass
class ForwardTrace:
    modules: list[tuple[str, list]]  # (name, output shapes) in call order, outside the block lists
    block_inputs: dict[str, dict[str, list]]  # block list -> parameter -> shapes, first block's first call
    block_outputs: dict[str, list]
    block_keywords: dict[str, list[str]]  # parameter names passed by keyword


def trace_forward(transformer, args, kwargs) -> ForwardTrace:
    lists = block_lists(transformer)
    mods: list[tuple[str, list]] = []
    binputs: dict[str, dict] = {}
    boutputs: dict[str, list] = {}
    bkeywords: dict[str, list[str]] = {}
    handles = []

    def inside_blocks(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in lists)

    for name, mod in transformer.named_modules():
        if not name or inside_blocks(name):
            continue

        def post(m, a, out, _name=name):
            s = _shapes(out)
            if s is not None:
                mods.append((_name, s))
        handles.append(mod.register_forward_hook(post))

    for b in lists:
        first = getattr(transformer, b)[0]
        params = list(inspect.signature(first.forward).parameters)

        def pre(m, a, kw, _b=b, _params=params):
            if _b in binputs:
                return
            named = dict(zip(_params, a))
            named.update(kw)
            binputs[_b] = {k: _shapes(v) for k, v in named.items() if _shapes(v) is not None}
            bkeywords[_b] = list(kw)

        def post(m, a, out, _b=b):
            if _b not in boutputs:
                boutputs[_b] = _shapes(out) or []
        handles.append(first.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(first.register_forward_hook(post))
    try:
        with torch.no_grad():
            transformer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return ForwardTrace(mods, binputs, boutputs, bkeywords)


def derive_cp_plan(transformer, args, kwargs, attention_kind: str | None = None) -> CPPlan:
    """A CP plan for a transformer nobody has planned, from one traced forward call."""
    tr = trace_forward(transformer, args, kwargs)
    lists = block_lists(transformer)
    if not lists:
        raise PlanDerivationError("the transformer has no nn.ModuleList of blocks to find the sequence in")
    first = lists[0]
    inputs = tr.block_inputs.get(first)
    if not inputs:
        raise PlanDerivationError(f"the first block of '{first}' was never called")
    three_d = {k: v[0] for k, v in inputs.items() if v and len(v) == 1 and v[0] is not None and len(v[0]) == 3}
    if not three_d:
        raise PlanDerivationError(f"no [batch, sequence, width] input to '{first}.0': {inputs}")
    img_name = next((k for k in three_d if _IMAGE_NAMES.match(k)), None) or next(
        (k for k in three_d if not _TEXT_NAMES.search(k)), None)
    if img_name is None:
        raise PlanDerivationError(f"cannot tell the image tokens among {list(three_d)} of '{first}.0'")
    batch, s_img, width = three_d[img_name]
    txt_name = next((k for k in three_d if k != img_name and _TEXT_NAMES.search(k)), None)
    s_txt = three_d[txt_name][1] if txt_name else None
    # text given to the blocks in the width of the blocks and updated by them -> joint attention
    if attention_kind is None:
        outs = tr.block_outputs.get(first, [])
        joint = bool(txt_name and three_d[txt_name][2] == width
                     and any(o and len(o) == 3 and o[1] == s_txt for o in outs))
        attention_kind = "joint" if joint else ("cross" if txt_name else "self")
    joint = attention_kind == "joint"
    notes = [f"block list '{first}': image tokens '{img_name}' {three_d[img_name]}"
             + (f", text '{txt_name}' {three_d[txt_name]}" if txt_name else "") + f"; attention {attention_kind}"]

    plan: dict[str, Any] = {}

    def site(name: str, index: int, dim: int, ndims: int) -> None:
        entry = plan.setdefault(name, {})
        entry[index] = ContextParallelInput(split_dim=dim, expected_dims=ndims, split_output=True)

    # image and text token producers
    img_site = next(((n, i) for n, shapes in tr.modules for i, s in enumerate(shapes)
                     if s == [batch, s_img, width]), None)
    if img_site is None:
        raise PlanDerivationError(f"no module outside the blocks emits the image tokens [{batch}, {s_img}, {width}]")
    site(img_site[0], img_site[1], 1, 3)
    notes.append(f"split image tokens at the output of '{img_site[0]}' (dim 1)")
    if txt_name and s_txt is not None:
        txt_site = next(((n, i) for n, shapes in tr.modules for i, s in enumerate(shapes)
                         if s == [batch, s_txt, three_d[txt_name][2]] and n != img_site[0]), None)
        if joint:
            if txt_site is None:
                plan.setdefault(f"{first}.0", {})[txt_name] = ContextParallelInput(split_dim=1, expected_dims=3)
                notes.append(f"split text tokens at '{first}.0' input '{txt_name}' (no producing module)")
            else:
                site(txt_site[0], txt_site[1], 1, 3)
                notes.append(f"split text tokens at the output of '{txt_site[0]}' (dim 1): joint attention")
        else:
            notes.append("text kept whole: cross attention reads the full text on every rank")
    # RoPE: outputs holding an image-length axis that are not token tensors
    rope_done = False
    for n, shapes in tr.modules:
        if n in (img_site[0],) or n.startswith(img_site[0] + "."):
            continue
        for i, s in enumerate(shapes):
            if s is None or s == [batch, s_img, width] or (len(s) == 3 and s[0] == batch and s[1] == s_img):
                continue
            dims = [d for d, L in enumerate(s) if L == s_img]
            if dims and _ROPE_NAMES.search(n):
                site(n, i, dims[0], len(s))
                rope_done = True
                notes.append(f"split RoPE table {i} of '{n}' {s} on dim {dims[0]} (image positions)")
            elif s_txt and any(L == s_img + s_txt for L in s) and _ROPE_NAMES.search(n):
                raise PlanDerivationError(
                    f"RoPE table of '{n}' {s} covers text and image in one axis; a derived plan cannot "
                    f"split it consistently — register a plan that splits the position ids instead")
    # rotary tables and masks handed to the blocks without a producing module
    for b in lists:
        for name, shapes in tr.block_inputs.get(b, {}).items():
            if name in (img_name, txt_name) or not shapes:
                continue
            if _ROPE_NAMES.search(name) and not rope_done:
                entries = []
                for s in shapes:
                    dims = [d for d, L in enumerate(s or []) if L == s_img]
                    if not dims:
                        entries = None
                        break
                    entries.append(ContextParallelInput(split_dim=dims[0], expected_dims=len(s)))
                if entries:
                    plan.setdefault(f"{b}.*", {})[name] = entries if len(entries) > 1 else entries[0]
                    notes.append(f"split RoPE '{name}' {shapes} at every block of '{b}' (image positions)")
            elif _MASK_NAMES.search(name):
                s = shapes[0]
                if s and len(s) == 2 and s_txt and s[1] == s_txt:
                    if joint:
                        plan.setdefault(f"{b}.*", {})[name] = ContextParallelInput(split_dim=1, expected_dims=2)
                        notes.append(f"text mask '{name}' {s} split with the text at every block of '{b}'")
                    else:
                        notes.append(f"text mask '{name}' {s} kept whole (cross attention)")
                elif s and len(s) == 4:
                    raise PlanDerivationError(f"mask '{name}' {s} covers the whole sequence; a derived plan "
                                              f"does not split it")
        if rope_done:
            break
    if not rope_done and not any(k.endswith(".*") and any(_ROPE_NAMES.search(str(p)) for p in v)
                                 for k, v in plan.items()):
        notes.append("no RoPE table found with an image-length axis (model without RoPE, or RoPE computed "
                     "inside the blocks from split inputs)")
    # gather: the last module outside the blocks that emits image tokens
    out_site = None
    for n, shapes in tr.modules:
        for i, s in enumerate(shapes):
            if s and len(s) == 3 and s[0] == batch and s[1] == s_img:
                out_site = (n, i, len(shapes))
    if out_site is None or out_site[0] == img_site[0]:
        raise PlanDerivationError("no module after the blocks emits the image tokens to gather")
    n, i, count = out_site
    plan[n] = ContextParallelOutput(gather_dim=1, expected_dims=3) if count == 1 else tuple(
        ContextParallelOutput(gather_dim=1, expected_dims=3) if j == i else None for j in range(count))
    notes.append(f"gather image tokens at the output of '{n}' (dim 1)")
    facts = {"image_seq_len": s_img, "text_seq_len": s_txt, "width": width, "attention_kind": attention_kind,
             "block_list": first, "keyword_called": tr.block_keywords.get(first, [])}
    return CPPlan(plan, "derived", notes, facts)


def resolve_cp_plan(transformer, capture=None, attention_kind: str | None = None) -> CPPlan:
    """The registered plan when there is one, else a derived one (``capture()`` gives (args, kwargs))."""
    reg = registered_cp_plan(transformer)
    if reg is not None:
        return reg
    if capture is None:
        raise PlanDerivationError(f"{type(transformer).__name__} has no registered CP plan and no call to trace")
    args, kwargs = capture()
    return derive_cp_plan(transformer, args, kwargs, attention_kind)


# ---------------------------------------------------------------------------------------------
# plans as code


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
    for k, v in cp.plan.items():
        lines.append(f"    {k!r}: {_code(v)},")
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
