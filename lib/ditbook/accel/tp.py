"""Tensor parallel of the transformer: shard its linear layers over the ranks with
``torch.distributed.tensor.parallel.parallelize_module`` (DTensor; gloo on the CPU, NCCL on GPUs).

The plan says, per linear layer, ``colwise`` (output features split) or ``rowwise`` (input features
split, partial sums all-reduced). It is the class's diffusers ``_tp_plan`` where it has one (applied
with torch's own styles: diffusers' ``apply_tensor_parallel`` accepts CUDA-like devices only), else
it is derived from one traced call's data flow (``derive_plan``), run in one process with the ranks
as threads (``simulate_tensor_plan``) and refused (``TensorParallelRefused``) unless every simulated
rank reproduces the plain forward. Packed layers are permuted so that each rank's contiguous chunk
is its slice of every block (``_permute``); every integer ``*heads*`` attribute of a sharded
attention module holding a global head count is set to the local count on that instance.

``TensorRecorder.record()`` reads what each rank holds from the model; ``check_tensor_sharding``
fails with ``TensorShardingError`` when a rank holds a whole weight or a shard not 1/degree of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cp.sharding import ShardingError
from ..hooks import swap_attribute
from . import plan_name, register
from .technique import Feasibility, Handle, NoSettings, ParallelTechnique


class TensorParallelRefused(RuntimeError):
    """The model cannot be tensor-parallel at this degree (the message says why)."""


class TensorShardingError(ShardingError):
    """A tensor-parallel run whose ranks did not each hold 1/degree of the sharded weights."""


@dataclass
class TensorPlan:
    source: str  # "diffusers _tp_plan" or "derived from the traced linear layers"
    # module path -> "colwise" | "rowwise" | ("packed_rowwise", [input block sizes])
    #                | ("packed_colwise", [output chunk sizes]): split per chunk
    styles: dict[str, object]
    attention: list[str] = field(default_factory=list)  # attention modules whose heads are split
    notes: list[str] = field(default_factory=list)
    # attention module -> the query and key/value head counts its traced attention calls had
    traced_heads: dict[str, list[int]] = field(default_factory=dict)

    def head_counts(self, path: str, heads: int | None, kv_heads: int | None) -> tuple[int | None, int | None]:
        """The head counts to look for on attention module ``path``: the inspection's, else the traced ones."""
        traced = self.traced_heads.get(path) or [None, None]
        return (heads or traced[0]), (kv_heads or heads or traced[1])

    def to_dict(self) -> dict:
        return {"source": self.source, "attention": self.attention, "notes": self.notes,
                "styles": {k: (v if isinstance(v, str) else {v[0]: list(v[1])})
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
                unit = module.in_features // sum(blocks)
                out[path] = ("packed_rowwise", [b * unit for b in blocks])
            else:
                raise TensorParallelRefused(f"_tp_plan: style {type(style).__name__} of '{path}' is not applied "
                                            f"by ditbook (colwise, rowwise and packed rowwise are)")
    return out


@dataclass
class LinearTrace:
    """One traced call: the events in order (("linear", path) per ``nn.Linear`` call, ("sdpa", the
    innermost running module) per attention call). ``inputs[path]``: the producers (a linear layer
    path, or ``sdpa#i`` for the i-th attention call's output) reaching that linear layer's input
    without passing another linear layer; ``operands[i]``: the same for the i-th call's q, k, v."""
    events: list[tuple[str, str]]
    inputs: dict[str, set] = field(default_factory=dict)
    operands: list[list[set]] = field(default_factory=list)
    output: set = field(default_factory=set)  # producers reaching the transformer's output
    heads: list[tuple[int, int]] = field(default_factory=list)  # (query, key) heads of each attention call


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, dict)):
        for o in (obj.values() if isinstance(obj, dict) else obj):
            yield from _tensors(o)
    elif hasattr(obj, "__dataclass_fields__") or hasattr(obj, "to_tuple"):
        for o in (vars(obj).values() if hasattr(obj, "__dict__") else ()):
            yield from _tensors(o)


# long: the hooks, the tag table and the function mode share one trace and are removed together
def trace_linear_order(transformer: nn.Module, call: tuple[tuple, dict]) -> LinearTrace:
    """One forward with (args, kwargs), recording the order of linear and attention calls and the
    data flow between them: every tensor carries the producers its values came from since the last
    linear layer; any other op passes on the union of its inputs' producers."""
    from torch.overrides import TorchFunctionMode

    import torch.nn.functional as F

    trace = LinearTrace([])
    stack: list[str] = []
    handles = []
    tags: dict[int, tuple[torch.Tensor, frozenset]] = {}  # id -> (tensor kept alive, producers)

    def tag_of(obj) -> frozenset:
        out: set = set()
        for t in _tensors(obj):
            hit = tags.get(id(t))
            if hit is not None and hit[0] is t:
                out |= hit[1]
        return frozenset(out)

    def tag(obj, producers: frozenset) -> None:
        if producers:
            for t in _tensors(obj):
                tags[id(t)] = (t, producers)

    linear_paths = {}
    for name, module in transformer.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n) and None))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: stack.pop() and None))
        if isinstance(module, nn.Linear):
            linear_paths[id(module)] = name
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: trace.events.append(("linear", n))))

    sdpa = F.scaled_dot_product_attention

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is F.linear and stack and stack[-1] in linear_paths.values():
                path = stack[-1]
                trace.inputs.setdefault(path, set()).update(tag_of(args[0] if args else kwargs.get("input")))
                tag(out, frozenset([path]))
            elif func is sdpa:
                trace.events.append(("sdpa", stack[-1] if stack else ""))
                qkv = list(args[:3]) + [kwargs.get(k) for k in ("query", "key", "value")[len(args[:3]):]]
                trace.operands.append([set(tag_of(t)) for t in qkv])
                trace.heads.append(tuple(int(t.shape[-3]) if isinstance(t, torch.Tensor) and t.dim() >= 3 else 0
                                         for t in qkv[:2]))
                tag(out, frozenset([f"sdpa#{len(trace.operands) - 1}"]))
            else:
                tag(out, tag_of((args, kwargs)))
            return out

    try:
        with torch.no_grad(), Spy():
            result = transformer(*call[0], **call[1])
        trace.output = set(tag_of(result))
    finally:
        for h in handles:
            h.remove()
    return trace


def derive_plan(transformer: nn.Module, trace: "LinearTrace", grouped: bool = True) -> TensorPlan:
    """Colwise/rowwise styles from the traced data flow; refuses when nothing can be sharded.

    Inside a module that calls attention, colwise are the linear layers whose output reaches the
    query, key or value directly, rowwise those whose input is the attention's output. A layer
    whose output does not reach the attention (an adaLN modulation whose chunks scale the whole
    stream) stays whole. A layer feeding several of q/k/v (a fused ``qkv``) is split per chunk
    (``grouped``): rank r holds its slice of each."""
    events, inputs, operands = trace.events, trace.inputs, trace.operands
    linears = {n: m for n, m in transformer.named_modules() if isinstance(m, nn.Linear)}
    styles: dict[str, object] = {}
    notes: list[str] = []
    attention: list[str] = []
    traced_heads: dict[str, list[int]] = {}
    # attention modules: the innermost module around an SDPA call that owns linear layers
    calls: dict[str, list[int]] = {}
    for i, where in enumerate(w for k, w in events if k == "sdpa"):
        owner = where
        while owner and not any(l.startswith(owner + ".") for l in linears):
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        if owner:
            calls.setdefault(owner, []).append(i)
    consumers = _consumers(inputs, operands)
    for owner, idx in calls.items():
        why = _attention_refusal(owner, idx, operands, inputs, consumers, trace)
        if why:
            notes.append(f"'{owner}': {why}: left whole")
            continue
        before = sorted({p for i in idx for op in operands[i] for p in op})
        after = sorted(p for p, src in inputs.items() if src and src <= {f"sdpa#{i}" for i in idx})
        for w in before:
            groups = len({j for i in idx for j, op in enumerate(operands[i]) if w in op})
            styles[w] = ("packed_colwise", [linears[w].out_features // groups] * groups) \
                if grouped and groups > 1 and linears[w].out_features % groups == 0 else "colwise"
        for w in after:
            styles[w] = "rowwise"
        attention.append(owner)
        if len(trace.heads) > max(idx):
            counts = {trace.heads[i] for i in idx}
            if len(counts) == 1:
                traced_heads[owner] = list(next(iter(counts)))
    skipped = [w for k, w in events if k == "linear" and w not in styles and _inside(w, attention)]
    for w in dict.fromkeys(skipped):
        if not any(w in op for ops in operands for op in ops) and not inputs.get(w, set()) & {
                f"sdpa#{i}" for ix in calls.values() for i in ix}:
            notes.append(f"'{w}': called inside an attention module, its output reaches no attention call "
                         f"(e.g. a modulation whose chunks scale the whole stream): left whole")
    _mlp_pairs(transformer, events, inputs, consumers, trace, linears, styles, attention)
    if not styles:
        raise TensorParallelRefused("no linear layer pair to shard: the traced call shows no attention with input and "
                                    "output projections and no d -> h -> d MLP")
    return TensorPlan("derived from the traced linear layers", styles, attention, notes, traced_heads)


def _inside(path: str, owners: list[str]) -> bool:
    return any(path.startswith(o + ".") for o in owners)


def _consumers(inputs: dict[str, set], operands: list[list[set]]) -> dict[str, set]:
    """producer -> what its output reaches: linear layer paths and ``sdpa#i`` operands."""
    out: dict[str, set] = {}
    for path, src in inputs.items():
        for p in src:
            out.setdefault(p, set()).add(path)
    for i, ops in enumerate(operands):
        for op in ops:
            for p in op:
                out.setdefault(p, set()).add(f"sdpa#{i}")
    return out


def _attention_refusal(owner, idx, operands, inputs, consumers, trace) -> str | None:
    """Why the attention calls ``idx`` of ``owner`` cannot be split by heads (None: they can)."""
    if not operands:
        return "no data flow traced"
    mine = {f"sdpa#{i}" for i in idx}
    for i in idx:
        if len(operands[i]) < 3 or not all(operands[i][:3]):
            return "a query, key or value that no linear layer produced inside the module"
        for op in operands[i][:3]:
            for p in op:
                if p.startswith("sdpa#") or not p.startswith(owner + "."):
                    return f"the attention input '{p}' is not a projection of this module"
                if not consumers.get(p, set()) <= mine:
                    return f"the output of '{p}' reaches more than this module's attention"
        out = f"sdpa#{i}"
        if out in trace.output:
            return "the attention output reaches the transformer's output without a projection"
        after = [p for p, src in inputs.items() if out in src]
        if not after or any(not src <= mine or not p.startswith(owner + ".") for p, src in inputs.items() if out in src):
            return "the attention output reaches something other than this module's output projections"
        if consumers.get(out, set()) - set(after):
            return "the attention output reaches something other than a linear layer"
    return None


def _mlp_pairs(transformer, events, inputs, consumers, trace, linears, styles, attention) -> None:
    """MLPs: a linear call d -> h whose output reaches only the next linear call h -> d of the same
    block (through activations), outside the attention modules: colwise then rowwise."""
    order = [w for k, w in events if k == "linear" and w not in styles]
    seen: set[str] = set()
    for a, b in zip(order, order[1:]):
        la, lb = linears[a], linears[b]
        if a in seen or b in seen or _block_of(transformer, a) is None or _block_of(transformer, a) != _block_of(transformer, b):
            continue
        if inputs and (inputs.get(b) != {a} or consumers.get(a) != {b} or a in trace.output):
            continue
        if la.out_features == lb.in_features and la.in_features == lb.out_features and la.out_features > la.in_features:
            styles[a], styles[b] = "colwise", "rowwise"
            seen.update((a, b))


def _block_of(model: nn.Module, path: str) -> str | None:
    """The block (element of the outermost ``ModuleList``) that holds the module at ``path``, or None."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        if isinstance(model.get_submodule(".".join(parts[:i - 1])) if i > 1 else model, nn.ModuleList) and \
                parts[i - 1].isdigit():
            return ".".join(parts[:i])
    return None


def attention_of(styles: dict[str, object], transformer: nn.Module) -> list[str]:
    """For a ``_tp_plan``: the attention modules, taken as the parent module of each colwise layer."""
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
        _check_widths(transformer, plan, degree)
        return plan
    if call is None:
        raise TensorParallelRefused("no _tp_plan on the class and no traced call to derive one from")
    trace = trace_linear_order(transformer, call)
    tried = []
    for grouped in (True, False):
        plan = derive_plan(transformer, trace, grouped=grouped)
        if any(p.styles == plan.styles for p, _ in tried):
            continue
        _check_widths(transformer, plan, degree)
        for owner, (hq, hk) in plan.traced_heads.items():
            if hq % degree or hk % degree:
                raise TensorParallelRefused(f"'{owner}': its attention has {hq} query / {hk} key-value heads "
                                            f"(traced), not divisible by tp {degree}")
        why = simulate_tensor_plan(transformer, plan, degree, call, heads, kv_heads)
        if why is None:
            plan.notes.append(f"simulated in one process ({degree} ranks as threads): output equal to the plain forward")
            return plan
        tried.append((plan, why))
    raise TensorParallelRefused(f"the derived plan ({len(tried[0][0].styles)} linear layers) simulated in one process "
                                f"({degree} ranks as threads) does not reproduce the plain forward: {tried[0][1]}")


def _check_widths(transformer: nn.Module, plan: TensorPlan, degree: int) -> None:
    for path, style in plan.styles.items():
        layer = transformer.get_submodule(path)
        sizes = ([layer.out_features] if style == "colwise" else [layer.in_features] if style == "rowwise"
                 else style[1])
        bad = [s for s in sizes if s % degree]
        if bad:
            raise TensorParallelRefused(f"'{path}': width {bad[0]} is not divisible by tp {degree}")


# -- the one-process simulation ------------------------------------------------------------------

def _rank_rows(style, layer: nn.Linear, degree: int, r: int) -> tuple[str, torch.Tensor]:
    """(which side is split, the indices rank r holds) of a planned layer: output rows for colwise
    (per chunk for packed colwise), input columns for rowwise (per block for packed rowwise)."""
    if style == "colwise":
        c = layer.out_features // degree
        return "out", torch.arange(r * c, (r + 1) * c)
    if style == "rowwise":
        c = layer.in_features // degree
        return "in", torch.arange(r * c, (r + 1) * c)
    kind, blocks = style
    idx, start = [], 0
    for b in blocks:
        c = b // degree
        idx.extend(range(start + r * c, start + (r + 1) * c))
        start += b
    return ("out" if kind == "packed_colwise" else "in"), torch.tensor(idx)


class _ThreadSum:
    """An all-reduce (sum) between threads standing for the ranks."""

    def __init__(self, n: int):
        import threading

        self.n, self.parts = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=120)

    def __call__(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = t
        self.barrier.wait()
        total = self.parts[0]
        for p in self.parts[1:]:
            total = total + p
        self.barrier.wait()
        return total


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "sample", None)


# long: the ranks' layer forwards, the threads and the comparison share the one set of swaps to undo
def simulate_tensor_plan(transformer: nn.Module, plan: TensorPlan, degree: int, call: tuple[tuple, dict],
                         heads: int | None, kv_heads: int | None) -> str | None:
    """Run ``plan`` in this process with ``degree`` threads standing for the ranks (each planned
    layer computes only its rank's rows or columns, partial sums added between the threads, head
    counts local) and compare each thread's output with the plain forward: None when every rank
    reproduces it, else why not."""
    import threading

    import torch.nn.functional as F

    with torch.no_grad():
        ref = _first_tensor(transformer(*call[0], **call[1]))
    if not isinstance(ref, torch.Tensor):
        return "the transformer's output holds no tensor to compare"
    local, reduce = threading.local(), _ThreadSum(degree)
    undo = []

    def forward_of(path, layer, style):
        shards = [_rank_rows(style, layer, degree, r) for r in range(degree)]

        def forward(x):
            side, idx = shards[local.rank]
            idx = idx.to(layer.weight.device)
            if side == "out":
                b = layer.bias.index_select(0, idx) if layer.bias is not None else None
                return F.linear(x, layer.weight.index_select(0, idx), b)
            y = reduce(local.rank, F.linear(x, layer.weight.index_select(1, idx)))
            return y + layer.bias if layer.bias is not None else y
        return forward

    try:
        for path, style in plan.styles.items():
            layer = transformer.get_submodule(path)
            undo.append(swap_attribute(layer, "forward", forward_of(path, layer, style)))
        for attn_path in plan.attention:
            module = transformer.get_submodule(attn_path)
            for attr, value in head_attributes(module, *plan.head_counts(attn_path, heads, kv_heads)).items():
                undo.append(swap_attribute(module, attr, value // degree))
        outs, errors = [None] * degree, [None] * degree

        def run(r):
            local.rank = r
            try:
                with torch.no_grad():
                    outs[r] = _first_tensor(transformer(*call[0], **call[1]))
            except threading.BrokenBarrierError as exc:
                errors[r] = exc
            except Exception as exc:  # noqa: BLE001 - the rank's error is the reason reported
                errors[r] = exc
                reduce.barrier.abort()
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(degree)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        for h in reversed(undo):
            h.remove()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        return f"{type(real[0]).__name__}: {str(real[0]).splitlines()[0][:300]}"
    if any(e is not None for e in errors) or any(o is None for o in outs):
        return "a simulated rank did not finish"
    tol = 1e-3 if ref.dtype == torch.float32 or ref.dtype == torch.float64 else 3e-2
    scale = float(ref.abs().max()) or 1.0
    for r, out in enumerate(outs):
        if out.shape != ref.shape:
            return f"rank {r}'s output is shaped {tuple(out.shape)}, the plain forward's {tuple(ref.shape)}"
        err = float((out.float() - ref.float()).abs().max()) / scale
        if not err <= tol:
            return f"rank {r}'s output differs from the plain forward by {err:.3g} of its largest value (tolerance {tol:g})"
    return None


# -- applying it ------------------------------------------------------------------------------

def _is_colwise(style) -> bool:
    return style == "colwise" or (isinstance(style, tuple) and style[0] == "packed_colwise")


def _permute(layer: nn.Linear, style: tuple, degree: int) -> None:
    """Reorder a packed layer's output rows (packed colwise: a fused qkv's q, k and v each split by
    heads) or input columns (packed rowwise) so that contiguous chunk r is rank r's slice of every
    chunk or block, which ``ColwiseParallel`` / ``RowwiseParallel`` then split."""
    idx = torch.cat([_rank_rows(style, layer, degree, r)[1] for r in range(degree)]).to(layer.weight.device)
    with torch.no_grad():
        if _is_colwise(style):
            layer.weight.data = layer.weight.data.index_select(0, idx).contiguous()
            if layer.bias is not None:
                layer.bias.data = layer.bias.data.index_select(0, idx).contiguous()
        else:
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
            _permute(layer, style, degree)
        styles[path] = ColwiseParallel() if _is_colwise(style) else RowwiseParallel()
    for attn_path in plan.attention:
        module = transformer.get_submodule(attn_path)
        for attr, value in head_attributes(module, *plan.head_counts(attn_path, heads, kv_heads)).items():
            applied._undo.append(swap_attribute(module, attr, value // degree).remove)
            applied.heads_set.setdefault(attn_path, {})[attr] = [value, value // degree]
    parallelize_module(transformer, mesh, styles)
    return applied


class TensorRecorder:
    """What this rank really holds under a tensor plan, read from the model: every planned
    parameter's local and global shape, and each colwise layer's output width in the first call."""

    def __init__(self, transformer: nn.Module, plan: TensorPlan, degree: int):
        import torch.distributed as dist

        self.transformer, self.plan, self.degree = transformer, plan, degree
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.activations: dict[str, dict] = {}
        self.handles = []
        for path, style in plan.styles.items():
            if not _is_colwise(style):
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
    """Each rank's ``TensorRecorder.record()``: every planned weight and colwise activation must be
    1/degree of its global shape on every rank; raises ``TensorShardingError`` naming what was whole."""
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
                 math.prod(s["local"]) * degree != math.prod(s["global"])]
        if wrong:
            problems.append(f"rank {r}: '{wrong[0]}' holds a shard that is not 1/{degree} of it")
        acts = rec.get("activations", {})
        if not acts:
            problems.append(f"rank {r}: no colwise layer ran (no sharded activation was seen)")
        fat = [k for k, a in acts.items() if a["local"] * degree != a["global"]]
        if fat:
            problems.append(f"rank {r}: activation of '{fat[0]}' was {acts[fat[0]]['local']} wide, expected "
                            f"{acts[fat[0]]['global']} / {degree}")
        totals.append(sum(math.prod(s["local"]) for s in weights))
    if problems:
        raise TensorShardingError("tensor parallel did not shard the transformer: " + "; ".join(problems))
    first = ranks[0]
    weights = [s for s in first["sharded"] if s["name"].endswith("weight")]
    return {"degree": degree, "source": first["plan"]["source"], "sharded_weights": len(weights),
            "local_weight_elements": totals, "global_weight_elements": sum(math.prod(s["global"]) for s in weights),
            "local_heads": first.get("heads", {})}


@register
class TensorParallel(ParallelTechnique):
    """The transformer's linear layers sharded over the ranks (this module's plan, torch's styles)."""

    name = "tp"
    token = "tp"
    family = "tensor parallel"
    Settings = NoSettings
    order = 60
    on_rank = True

    @classmethod
    def refusal(cls, spec, device: str | None = None) -> str | None:
        if spec.tp > 1 and len(spec.kinds()) > 1 and any(t.multiplies and t is not cls for t in spec.kinds()):
            return ("tensor parallel is run alone (tp<N>, optionally with vae<N>/te<N>): its composition with CFG or "
                    "context parallel (a 2-D mesh) is not wired")
        if spec.tp > 1 and (spec.cache or spec.compile or spec.graph):
            return "tensor parallel runs without +cache, +compile or +graph (their order with the sharding is not wired)"
        return None

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        """The class's ``_tp_plan``, else a plan derived from the traced linear layers; heads and
        KV heads must split evenly."""
        def no(why: str) -> list[Feasibility]:
            return [Feasibility("tp", n, False, None, why)]

        if n == 1:
            return no("one process: nothing to shard")
        if f.heads is None:
            return no("head count unknown")
        if f.heads % n:
            return no(f"{f.heads} heads not divisible by {n}")
        if f.kv % n:
            return no(f"GQA: {f.kv} KV heads not divisible by {n}: the K/V projections cannot be split by head")
        diffusers_plan = bool(f.tp_plan) and "_tp_plan" in f.tp_plan  # cache-dit's TP planners are not applied
        # a fused QKV is derived too: split per chunk (``packed_colwise``), the plan simulated before launch
        how = ("plan: diffusers _tp_plan" if diffusers_plan else
               "plan derived from the traced linear layers (attention in-projections colwise"
               + (", a fused qkv per chunk" if f.att.fused_qkv else "") + ", out-projection rowwise; "
               "MLP up colwise, down rowwise)")
        return [Feasibility("tp", n, True, plan_name(tp=n), how)]

    @classmethod
    def apply_on_rank(cls, pipe, card, spec, degree: int, noop: bool = False) -> Handle:
        from ..arch.static import inspect_transformer
        from ..cp.plan import capture_transformer_call

        tr = pipe.transformer
        att = inspect_transformer(tr, card.pipeline.cls, support=False).attention
        call = None if getattr(type(tr), "_tp_plan", None) else capture_transformer_call(pipe, card)
        plan = resolve_tensor_plan(tr, degree, att.heads, att.kv_heads or att.heads, call)
        if not noop:
            apply_tensor_parallel(tr, plan, degree, heads=att.heads, kv_heads=att.kv_heads or att.heads)
        recorder = TensorRecorder(tr, plan, degree)
        return Handle(recorder.remove, recorder.record)

    @classmethod
    def check(cls, records: list, degree: int) -> dict:
        """Fails when the planned weights are whole on the ranks (``check_tensor_sharding``)."""
        return check_tensor_sharding(records, degree)
