"""Tensor parallel of the transformer: shard its linear layers over the ranks with
``torch.distributed.tensor.parallel.parallelize_module`` (DTensor; gloo on the CPU, NCCL on GPUs).

The plan says, per linear layer, ``colwise`` (output features split: each rank computes some of
the heads / some of the hidden units) or ``rowwise`` (input features split: each rank multiplies
its slice, the partial sums are all-reduced). It comes from

- the class's diffusers ``_tp_plan`` (globs over block lists; ``PackedRowwiseParallel`` for a
  linear layer whose input concatenates two separately column-split streams, with the block
  sizes on the layer as ``_tp_packed_row_blocks``) where the class has one — applied here with
  torch's own styles, since diffusers' ``apply_tensor_parallel`` accepts CUDA-like devices only;
- otherwise a plan derived from one traced call: inside every module that calls attention (SDPA),
  the linear layers that run before the attention call are colwise, those after it rowwise; in a
  block, two linear layers called one after the other where the first widens ``d -> h`` and the
  second narrows ``h -> d`` are an MLP: colwise then rowwise. A module whose attention has no
  rowwise partner (its output is used otherwise) stays whole.

A packed rowwise layer is sharded without private torch API: its input columns are permuted (on
every rank alike) so that the contiguous column chunk of rank r is rank r's slice of every block,
which is what that rank's concatenated input holds; ``RowwiseParallel`` then splits it normally.

Attention code that reads the head count from the module (``attn.heads``, ``self.num_heads``)
would reshape local projections with the global count: every integer attribute of a sharded
attention module whose name says ``heads`` and whose value is the global query or KV head count is
set to the local count on that instance, and ``TensorParallelApplied.undo_heads()`` puts it back.

What each rank holds is recorded (``TensorRecorder.record()``, read from the model: every planned
parameter with its local and global shape, the local width of every colwise activation, the head
counts of the attention modules) and
``check_tensor_sharding`` fails with ``TensorShardingError`` when a rank holds a whole weight (the
plan sharded nothing, every rank ran the whole model) or a shard that is not 1/degree of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..hooks import swap_attribute
from .sharding import ShardingError


class TensorParallelRefused(RuntimeError):
    """The model cannot be tensor-parallel at this degree (the message says why)."""


class TensorShardingError(ShardingError):
    """A tensor-parallel run whose ranks did not each hold 1/degree of the sharded weights."""


@dataclass
class TensorPlan:
    source: str  # "diffusers _tp_plan" or "derived from the traced linear layers"
    styles: dict[str, object]  # module path -> "colwise" | "rowwise" | ("packed_rowwise", [block sizes])
    attention: list[str] = field(default_factory=list)  # attention modules whose heads are split
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"source": self.source, "attention": self.attention, "notes": self.notes,
                "styles": {k: (v if isinstance(v, str) else {"packed_rowwise": list(v[1])})
                           for k, v in self.styles.items()}}


# -- the plan ---------------------------------------------------------------------------------

def expand_globs(model: nn.Module, flat: dict) -> dict[str, object]:
    """A diffusers ``_tp_plan`` ({"blocks.*.attn.to_q": "colwise", ...}) -> {module path: style}."""
    out: dict[str, object] = {}
    for pattern, style in flat.items():
        if "*" in pattern:
            prefix, _, suffix = pattern.partition("*")
            container = model.get_submodule(prefix.strip("."))
            paths = [f"{prefix.strip('.')}.{i}.{suffix.strip('.')}" for i in range(len(container))]
        else:
            paths = [pattern]
        for path in paths:
            module = model.get_submodule(path)
            if isinstance(style, str):
                out[path] = style
            elif type(style).__name__ == "PackedRowwiseParallel":
                blocks = getattr(style, "blocks", None) or getattr(module, "_tp_packed_row_blocks", None)
                if not blocks:
                    raise TensorParallelRefused(f"_tp_plan: '{path}' is packed rowwise without block sizes")
                total = module.in_features
                unit = total // sum(blocks)
                out[path] = ("packed_rowwise", [b * unit for b in blocks])
            else:
                raise TensorParallelRefused(f"_tp_plan: style {type(style).__name__} of '{path}' is not applied "
                                            f"by ditbook (colwise, rowwise and packed rowwise are)")
    return out


def trace_linear_order(transformer: nn.Module, call: tuple[tuple, dict]) -> list[tuple[str, str]]:
    """One forward with (args, kwargs): the events in order, ("linear", path) for every
    ``nn.Linear`` call and ("sdpa", path of the innermost running module) for every attention call."""
    from torch.overrides import TorchFunctionMode

    import torch.nn.functional as F

    events: list[tuple[str, str]] = []
    stack: list[str] = []
    handles = []
    for name, module in transformer.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n) and None))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: stack.pop() and None))
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: events.append(("linear", n))))

    sdpa = F.scaled_dot_product_attention

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is sdpa:
                events.append(("sdpa", stack[-1] if stack else ""))
            return func(*args, **(kwargs or {}))

    try:
        with torch.no_grad(), Spy():
            transformer(*call[0], **call[1])
    finally:
        for h in handles:
            h.remove()
    return events


def derive_plan(transformer: nn.Module, events: list[tuple[str, str]]) -> TensorPlan:
    """Colwise/rowwise styles from the traced order of linear and attention calls (see the module
    docstring); refuses when nothing can be sharded."""
    linears = {n: m for n, m in transformer.named_modules() if isinstance(m, nn.Linear)}
    styles: dict[str, object] = {}
    notes: list[str] = []
    attention: list[str] = []
    # attention modules: the innermost module around an SDPA call that owns linear layers
    owners: dict[str, str] = {}
    for kind, where in events:
        if kind != "sdpa":
            continue
        owner = where
        while owner and not any(l.startswith(owner + ".") for l in linears):
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        if owner:
            owners[where] = owner
    for owner in dict.fromkeys(owners.values()):
        inside = [(k, w) for k, w in events if (k == "linear" and w.startswith(owner + ".")) or
                  (k == "sdpa" and owners.get(w) == owner)]
        first = next(i for i, (k, _) in enumerate(inside) if k == "sdpa")
        before = list(dict.fromkeys(w for k, w in inside[:first] if k == "linear"))
        after = [w for w in dict.fromkeys(w for k, w in inside[first:] if k == "linear") if w not in before]
        if not before or not after:
            notes.append(f"'{owner}': attention without {'input' if not before else 'output'} projections "
                         f"inside the module: left whole")
            continue
        for w in before:
            styles[w] = "colwise"
        for w in after:
            styles[w] = "rowwise"
        attention.append(owner)
    # MLPs: consecutive linear calls d -> h, h -> d outside the attention modules
    order = [w for k, w in events if k == "linear" and w not in styles and
             not any(w.startswith(o + ".") for o in attention)]
    seen: set[str] = set()
    for a, b in zip(order, order[1:]):
        la, lb = linears[a], linears[b]
        if a in seen or b in seen or _block_of(transformer, a) is None or _block_of(transformer, a) != _block_of(transformer, b):
            continue
        if la.out_features == lb.in_features and la.in_features == lb.out_features and la.out_features > la.in_features:
            styles[a], styles[b] = "colwise", "rowwise"
            seen.update((a, b))
    if not styles:
        raise TensorParallelRefused("no linear layer pair to shard: the traced call shows no attention with input and "
                                    "output projections and no d -> h -> d MLP")
    return TensorPlan("derived from the traced linear layers", styles, attention, notes)


def _block_of(model: nn.Module, path: str) -> str | None:
    """The block (element of the outermost ``ModuleList``) that holds the module at ``path``, or None."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        if isinstance(model.get_submodule(".".join(parts[:i - 1])) if i > 1 else model, nn.ModuleList) and \
                parts[i - 1].isdigit():
            return ".".join(parts[:i])
    return None


def attention_of(styles: dict[str, object], transformer: nn.Module) -> list[str]:
    """For a ``_tp_plan``: the modules holding colwise layers and a rowwise or packed layer below
    them or beside them — taken as the parent module of each colwise layer."""
    return sorted({p.rsplit(".", 1)[0] for p, s in styles.items() if s == "colwise" and "." in p})


def head_attributes(module: nn.Module, heads: int | None, kv_heads: int | None) -> dict[str, int]:
    """Integer attributes of an attention module that hold its head counts (name says ``heads``,
    value is the global query or KV head count)."""
    wanted = {h for h in (heads, kv_heads) if h}
    return {k: v for k, v in vars(module).items()
            if "heads" in k.lower() and isinstance(v, int) and not isinstance(v, bool) and v in wanted}


def resolve_tensor_plan(transformer: nn.Module, degree: int, heads: int | None, kv_heads: int | None,
                        call: "tuple[tuple, dict] | None" = None) -> TensorPlan:
    """The class's ``_tp_plan`` where it has one, else one derived from a traced ``call``;
    refuses (``TensorParallelRefused``) with the reason when the heads or a layer's width do not
    divide by ``degree``."""
    if heads is not None and heads % degree:
        raise TensorParallelRefused(f"{heads} attention heads are not divisible by tp {degree}")
    if kv_heads is not None and kv_heads % degree:
        raise TensorParallelRefused(f"GQA: {kv_heads} KV heads are not divisible by tp {degree}; the K/V "
                                    f"projections cannot be split by head")
    flat = getattr(type(transformer), "_tp_plan", None)
    if flat:
        plan = TensorPlan("diffusers _tp_plan", expand_globs(transformer, flat))
        plan.attention = attention_of(plan.styles, transformer)
    else:
        if call is None:
            raise TensorParallelRefused("no _tp_plan on the class and no traced call to derive one from")
        plan = derive_plan(transformer, trace_linear_order(transformer, call))
    for path, style in plan.styles.items():
        layer = transformer.get_submodule(path)
        sizes = ([layer.out_features] if style == "colwise" else [layer.in_features] if style == "rowwise"
                 else style[1])
        bad = [s for s in sizes if s % degree]
        if bad:
            raise TensorParallelRefused(f"'{path}': width {bad[0]} is not divisible by tp {degree}")
    return plan


# -- applying it ------------------------------------------------------------------------------

def _permute_packed(layer: nn.Linear, blocks: list[int], degree: int) -> None:
    """Reorder the input columns so that contiguous chunk r = rank r's slice of every block."""
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    order = []
    for r in range(degree):
        for s, b in zip(starts, blocks):
            c = b // degree
            order.extend(range(s + r * c, s + (r + 1) * c))
    idx = torch.tensor(order, device=layer.weight.device)
    with torch.no_grad():
        layer.weight.data = layer.weight.data.index_select(1, idx).contiguous()


@dataclass
class TensorParallelApplied:
    plan: TensorPlan
    degree: int
    heads_set: dict[str, dict] = field(default_factory=dict)  # module -> {attr: [global, local]}
    _undo: list = field(default_factory=list, repr=False)

    def undo_heads(self) -> None:
        """Put the head counts set on the attention modules back."""
        for fn in reversed(self._undo):
            fn()
        self._undo = []


def apply_tensor_parallel(transformer: nn.Module, plan: TensorPlan, degree: int, mesh=None,
                          heads: int | None = None, kv_heads: int | None = None) -> TensorParallelApplied:
    """Shard ``transformer`` in place after ``plan`` over a 1-D mesh of ``degree`` ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        dev = next(transformer.parameters()).device
        mesh = init_device_mesh(dev.type, (degree,), mesh_dim_names=("tp",))
    applied = TensorParallelApplied(plan, degree)
    styles = {}
    for path, style in plan.styles.items():
        layer = transformer.get_submodule(path)
        if isinstance(style, tuple):
            _permute_packed(layer, style[1], degree)
            styles[path] = RowwiseParallel()
        else:
            styles[path] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    for attn_path in plan.attention:
        module = transformer.get_submodule(attn_path)
        for attr, value in head_attributes(module, heads, kv_heads).items():
            applied._undo.append(swap_attribute(module, attr, value // degree).remove)
            applied.heads_set.setdefault(attn_path, {})[attr] = [value, value // degree]
    parallelize_module(transformer, mesh, styles)
    return applied


class TensorRecorder:
    """What this rank really holds and computes under a tensor plan, read from the model (not from
    what ``apply_tensor_parallel`` meant to do): every planned parameter's local and global shape,
    and the width of each colwise layer's output activation in the first call."""

    def __init__(self, transformer: nn.Module, plan: TensorPlan, degree: int):
        import torch.distributed as dist

        self.transformer, self.plan, self.degree = transformer, plan, degree
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.activations: dict[str, dict] = {}
        self.handles = []
        for path, style in plan.styles.items():
            if style != "colwise":
                continue
            layer = transformer.get_submodule(path)

            def seen(m, a, out, path=path, width=layer.out_features):
                if path not in self.activations and isinstance(out, torch.Tensor):
                    self.activations[path] = {"local": int(out.shape[-1]), "global": int(width)}
            self.handles.append(layer.register_forward_hook(seen))

    def record(self) -> dict:
        from torch.distributed.tensor import DTensor

        sharded = []
        for path in self.plan.styles:
            layer = self.transformer.get_submodule(path)
            for pname, p in layer.named_parameters(recurse=False):
                is_d = isinstance(p, DTensor)
                local = p.to_local() if is_d else p
                sharded.append({"name": f"{path}.{pname}", "placement": str(p.placements[0]) if is_d else "plain",
                                "local": list(local.shape), "global": list(p.shape)})
        heads = {a: {k: v for k, v in vars(self.transformer.get_submodule(a)).items()
                     if "heads" in k.lower() and isinstance(v, int) and not isinstance(v, bool)}
                 for a in self.plan.attention}
        heads = {a: h for a, h in heads.items() if h}
        return {"rank": self.rank, "degree": self.degree, "plan": self.plan.to_dict(), "sharded": sharded,
                "heads": heads, "activations": dict(self.activations)}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def check_tensor_sharding(ranks: list[dict], degree: int) -> dict:
    """Each rank's ``TensorRecorder.record()``. Every rowwise/colwise weight must be
    held as 1/degree of its global shape on every rank, and the colwise activations must have been
    1/degree wide; raises ``TensorShardingError`` naming what was whole."""
    problems = []
    totals = []
    for r, rec in enumerate(ranks):
        if not rec:
            problems.append(f"rank {r} recorded no tensor-parallel sharding")
            continue
        weights = [s for s in rec.get("sharded", []) if s["name"].endswith("weight")]
        if not weights:
            problems.append(f"rank {r}: no weight was sharded")
        whole = [s["name"] for s in weights if s["local"] == s["global"]]
        if whole:
            problems.append(f"rank {r}: {len(whole)} of {len(weights)} planned weights are whole (e.g. '{whole[0]}'): "
                            f"this rank runs the unsharded layers")
        wrong = [s["name"] for s in weights if s["local"] != s["global"] and
                 _numel(s["local"]) * degree != _numel(s["global"])]
        if wrong:
            problems.append(f"rank {r}: '{wrong[0]}' holds a shard that is not 1/{degree} of it")
        acts = rec.get("activations", {})
        if not acts:
            problems.append(f"rank {r}: no colwise layer ran (no sharded activation was seen)")
        fat = [k for k, a in acts.items() if a["local"] * degree != a["global"]]
        if fat:
            problems.append(f"rank {r}: activation of '{fat[0]}' was {acts[fat[0]]['local']} wide, expected "
                            f"{acts[fat[0]]['global']} / {degree}")
        totals.append(sum(_numel(s["local"]) for s in weights))
    if problems:
        raise TensorShardingError("tensor parallel did not shard the transformer: " + "; ".join(problems))
    first = ranks[0]
    return {"degree": degree, "source": first["plan"]["source"],
            "sharded_weights": len([s for s in first["sharded"] if s["name"].endswith("weight")]),
            "local_weight_elements": totals,
            "global_weight_elements": sum(_numel(s["global"]) for s in first["sharded"] if s["name"].endswith("weight")),
            "local_heads": first.get("heads", {})}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
