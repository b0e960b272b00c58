"""Checks of a context-parallel plan before any process is launched, all in one process, by mechanism:
``check_grid_reshape`` (blocks reshaping tokens into the full grid), ``dry_run`` (the plan re-enacted for rank 0,
probing which attention runs as CP), ``check_token_axes`` (every full-length token axis split) and ``check_parity``
(every rank simulated as a thread must give the plain forward's output). No library offers such a simulation."""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools
import os
import textwrap
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .plan import (_MASK_NAMES, ForwardTrace, PlanCheckError, Streams, _is_input, _is_output, _main_output, _shapes, _tensors, expected_lengths)
from ..hooks import WrapGroup, swap_attribute
from ..settings import CP_DRYRUN_REL_TOL
from .sharding import bind_inputs, shard_sizes

_SDPA = torch.nn.functional.scaled_dot_product_attention


class GridReshapeError(PlanCheckError):
    """The blocks reshape the token axis into the full spatial grid (no plan of splits helps)."""

    final = True


class TokenAxisError(PlanCheckError):
    """A block input keeps a full-length token axis while the plan splits the tokens."""


class DryRunError(PlanCheckError):
    """The plan's one-process dry run fails."""


class ParityError(PlanCheckError):
    """The simulated ranks' output differs from the plain forward's."""


class CausalAttentionUnderSplit(ValueError):
    """A block inside the split lists calls causal attention."""


class DryRunUnavailable(RuntimeError):
    """The forward under the plan calls ``torch.distributed``: the dry run says nothing, the launch decides."""


_RESHAPES = {"unflatten", "view", "reshape", "rearrange"}


def _reshape_names(fn) -> set[str]:
    """Names used in the arguments of reshape calls of ``fn``'s own source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else None)
        if called not in _RESHAPES:
            continue
        for a in list(node.args) + [k.value for k in node.keywords]:
            names |= {n.id for n in ast.walk(a) if isinstance(n, ast.Name)}
    return names


def check_grid_reshape(transformer, tr: ForwardTrace, streams: Streams) -> None:
    """Raise ``GridReshapeError`` when a split list's blocks reshape tokens into the full grid."""
    for lname in streams.lists:
        lt = tr.lists[lname]
        image = streams.image if lname == streams.lists[0] else None
        shapes = lt.inputs.get(image) if image else None
        full = shapes[0][1] if shapes else None
        if full is None:
            full = next((s[0][1] for p, s in lt.inputs.items() if s and len(s) == 1 and len(s[0]) == 3), None)
        ints = {k: v for k, v in lt.scalars.items() if v > 1}
        if full is None or len(ints) < 2:
            continue
        block = transformer.get_submodule(lname)[0]
        used = _reshape_names(type(block).forward)
        for r in (3, 2):
            for combo in itertools.combinations(sorted(ints), r):
                prod = 1
                for k in combo:
                    prod *= ints[k]
                if prod == full and {k.split("[")[0] for k in combo} <= used:
                    grid = ", ".join(f"{k}={ints[k]}" for k in combo)
                    raise GridReshapeError(
                        f"the blocks of '{lname}' take the token grid ({grid}: {' x '.join(str(ints[k]) for k in combo)}"
                        f" = {full}, the full token count) and reshape the token axis into it in "
                        f"{type(block).__name__}.forward (a convolution over the tokens): a shard of the tokens "
                        f"cannot take that shape; a plan would have to split the grid's leading axis, pass each "
                        f"shard's '{combo[0]}' and exchange the rows at the shard borders, which a split of tensors "
                        f"cannot do")


@dataclass
class DryRun:
    inputs: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)  # list -> param -> shapes
    skipped: list[str] = field(default_factory=list)  # splits not applied (dimension count differs)
    uneven: list[str] = field(default_factory=list)  # splits the degree does not divide (tensor_split sizes)
    allow_uneven: bool = False  # such splits are simulated (the launch enables ulysses_anything), else refused
    sdpa_calls: int = 0  # attention calls inside the split blocks
    keys: dict[str, dict] = field(default_factory=dict)  # attention module -> rank 0's first SDPA call there
    output_shape: list[int] | None = None  # the transformer's main output after the plan's gathers
    # (attention module, call index) -> index of its first CP SDPA call (None: all run locally)
    cp_calls: dict[tuple[str, int], int | None] = field(default_factory=dict)

    def inputs_seen_uneven(self, where: str) -> bool:
        return any(u.startswith(where + " ") for u in self.uneven)

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "skipped": self.skipped, "uneven": self.uneven, "sdpa_calls": self.sdpa_calls,
                "output_shape": self.output_shape,
                "local_attention": sorted({n for (n, _), k in self.cp_calls.items() if k is None})}


@dataclass
class _Frame:
    """One call of an attention module whose processor takes a CP config."""

    name: str
    cp_from: int | None  # its SDPA calls from this index on run as CP attention (None: none do)
    n_sdpa: int = 0


@dataclass
class _RankState:
    """What the hooks know about the rank that runs in the current thread."""

    rank: int = 0
    depth: int = 0  # inside how many blocks of the split lists
    stack: list[str] = field(default_factory=list)  # running modules
    frames: list[_Frame] = field(default_factory=list)  # running attention-module calls
    counts: dict[str, int] = field(default_factory=dict)  # attention module -> calls so far


class _PeerGone(RuntimeError):
    """A simulated rank waits for a collective that a peer will never join."""


class _Exchange:
    """Collectives between simulated ranks (threads): ``all_gather`` in rank order."""

    def __init__(self, degree: int):
        self.degree = degree
        self.cond = threading.Condition()
        self.rounds = [0] * degree
        self.boxes: dict[int, dict] = {}
        self.left: set[int] = set()

    def all_gather(self, rank: int, value):
        with self.cond:
            k = self.rounds[rank]
            self.rounds[rank] += 1
            box = self.boxes.setdefault(k, {"reads": 0})
            box[rank] = value
            self.cond.notify_all()
            while any(r not in box for r in range(self.degree)):
                if any(r in self.left and r not in box for r in range(self.degree)):
                    raise _PeerGone("a peer rank ended before this collective")
                self.cond.wait(timeout=1.0)
            out = [box[r] for r in range(self.degree)]
            box["reads"] += 1
            if box["reads"] == self.degree:
                del self.boxes[k]
            return out

    def leave(self, rank: int) -> None:
        with self.cond:
            self.left.add(rank)
            self.cond.notify_all()


class _World:
    """What one dry run's hooks share: degree, per-thread rank state, the exchange (None: rank 0 alone)."""

    def __init__(self, degree: int, run: DryRun, exchange: _Exchange | None = None, uneven: bool = False):
        self.degree, self.run, self.exchange, self.uneven = degree, run, exchange, uneven
        self.full_of: dict[int, int] = {}  # rank 0's share of an uneven split -> the split's full length
        self.local = threading.local()
        self.probe = _ConfigProbe()

    def state(self) -> _RankState:
        st = getattr(self.local, "state", None)
        if st is None:
            st = self.local.state = _RankState()
        return st

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.exchange is None:  # alone: rank 0's share repeated, cut to the full length of an uneven split
            out = torch.cat([x] * self.degree, dim=dim)
            full = self.full_of.get(x.shape[dim])
            return out.narrow(dim, 0, full) if full is not None else out
        return torch.cat(self.exchange.all_gather(self.state().rank, x), dim=dim)


class _StandInCP:
    """What a planner's patched forward reads from ``transformer._cp_config`` during the dry run."""

    def __init__(self, world: _World):
        self._world = world
        self._world_size = world.degree
        self.ulysses_degree, self.ring_degree = world.degree, 1

    @property
    def _rank(self) -> int:
        return self._world.state().rank

    @property
    def context_parallel_config(self):
        return self

    def __getattr__(self, name):  # only for what is not defined above
        raise AttributeError(f"'{name}' of the parallel config is read by the forward (a registered planner's patched "
                             f"forward reads the device mesh itself): the one-process dry run cannot stand in for it, "
                             f"so a plan for this forward cannot be checked before launch")


class _WouldRunCP(Exception):
    """Raised by ``_ConfigProbe`` when attention code reads the CP config it was given."""


class _ConfigProbe:
    """An attention processor's CP config during the dry run: the first use says the call runs as CP attention."""

    def __getattr__(self, name):
        raise _WouldRunCP(name)

    def __bool__(self):
        raise _WouldRunCP("__bool__")


_CONFIG_ATTRS = ("_parallel_config", "_cp_config")


def _cp_processors(transformer, lists: list[str]) -> dict[str, object]:
    """Attention modules in the split lists whose processor decides per call whether to run as CP."""
    from .attention import _processor_calls_sdpa

    out = {}
    for name, module in transformer.named_modules():
        proc = getattr(module, "processor", None)
        if proc is None or _processor_calls_sdpa(module) or not any(name.startswith(p + ".") for p in lists):
            continue
        if hasattr(proc, "_attention_backend") or any(hasattr(proc, a) for a in _CONFIG_ATTRS):
            out[name] = module
    return out


def _set_configs(proc, value) -> list:
    """Set both CP config attributes of ``proc`` as cache-dit does; returns the restoring handles."""
    return [swap_attribute(proc, attr, value) for attr in _CONFIG_ATTRS]


def _restore_configs(proc, saved: list) -> None:
    for handle in reversed(saved):
        handle.remove()


def _attention_wrapper(world: _World, name: str, module, probe: bool):
    """Wraps one CP-capable attention module: probing records which calls run as CP (``run.cp_calls``)."""
    def wrapper(original, *args, **kwargs):
        st = world.state()
        idx = st.counts.get(name, 0)
        st.counts[name] = idx + 1
        if not probe:
            frame = _Frame(name, world.run.cp_calls.get((name, idx), 0))
            st.frames.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                st.frames.pop()
        frame = _Frame(name, None)
        st.frames.append(frame)
        try:
            try:
                out = original(*args, **kwargs)
                world.run.cp_calls[(name, idx)] = None
                return out
            except _WouldRunCP:
                first_cp = frame.n_sdpa
            world.run.cp_calls[(name, idx)] = first_cp
            proc = module.processor
            off = _set_configs(proc, None)  # run the call again without the probe, as CP from there on
            frame.cp_from, frame.n_sdpa = first_cp, 0
            try:
                return original(*args, **kwargs)
            finally:
                _restore_configs(proc, off)  # the probe again, exactly
        finally:
            st.frames.pop()
    return wrapper


class _RankAttention(TorchFunctionMode):
    """SDPA inside a split block as a rank sees it (CP attention: every rank's keys and values)."""

    def __init__(self, world: _World):
        super().__init__()
        self.world = world

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.world.state()
        if func is not _SDPA or st.depth <= 0:
            return func(*args, **kwargs)
        frame = st.frames[-1] if st.frames else None
        cp = True
        if frame is not None:
            cp = frame.cp_from is not None and frame.n_sdpa >= frame.cp_from
            frame.n_sdpa += 1
        if st.rank == 0:
            self.world.run.sdpa_calls += 1
        key = args[1] if len(args) > 1 else kwargs.get("key")
        where = st.stack[-1] if st.stack else "<transformer>"
        if st.rank == 0 and where not in self.world.run.keys and torch.is_tensor(key):
            self.world.run.keys[where] = {"cp": cp, "keys": key.shape[-2], "repeated": 0}
        if not cp:
            return func(*args, **kwargs)
        if kwargs.get("is_causal") or (len(args) > 5 and args[5]):
            raise CausalAttentionUnderSplit(
                "causal attention (is_causal=True) inside a split block: under a sequence split each "
                "rank's queries would need the keys before them only, across ranks; the context-parallel "
                "attention does not take a causal mask")
        args = list(args)
        qk = (args[0] if args else kwargs.get("query"), key)
        if len(args) > 3:
            args[3] = self._mask_for_rank(args[3], *qk)
        elif "attn_mask" in kwargs:
            kwargs["attn_mask"] = self._mask_for_rank(kwargs["attn_mask"], *qk)
        for i, name in ((1, "key"), (2, "value")):
            if i < len(args):
                args[i] = self._gathered(args[i], where if i == 1 else None)
            elif name in kwargs:
                kwargs[name] = self._gathered(kwargs[name], where if name == "key" else None)
        return func(*args, **kwargs)

    def _query_rows(self, n_local: int) -> tuple[int, int, int]:
        """(first row, rows, all rows) of this rank's queries after the Ulysses all-to-all."""
        world = self.world
        if world.exchange is None:
            return 0, n_local, n_local * world.degree
        lens = world.exchange.all_gather(world.state().rank, n_local)
        rank = world.state().rank
        return sum(lens[:rank]), n_local, sum(lens)

    def _mask_for_rank(self, mask, query, key):
        """The mask as Ulysses attention applies it (``cp.mask.fit_mask``), cut to this rank's rows."""
        if not torch.is_tensor(mask) or not torch.is_tensor(query) or not torch.is_tensor(key):
            return mask
        start, n, total = self._query_rows(query.shape[-2])
        heads, degree = query.shape[-3] if query.dim() >= 3 else 1, self.world.degree
        if mask.dim() >= 3 and mask.shape[-3] != 1 and not (mask.dim() == 4 and mask.shape[-3] == heads
                                                            and heads % degree == 0):
            raise DryRunError(f"a mask {list(mask.shape)} with {mask.shape[-3]} heads reaches context-parallel "
                              f"attention with {heads} heads: under Ulysses each rank's attention holds "
                              f"1/{degree} of the heads, and the mask's heads are not the attention's to cut "
                              f"into the ranks' shares")
        alone = self.world.exchange is None  # rank 0 alone: the other ranks' query counts are not known
        own_rows = mask.dim() == 4 and mask.shape[-2] == n and n > 1  # the launch gathers them
        if mask.dim() >= 2 and mask.shape[-2] != 1 and not own_rows:
            if mask.shape[-2] != total and not (alone and mask.shape[-2] > n):
                raise DryRunError(f"a mask {list(mask.shape)} reaches context-parallel attention with "
                                  f"{mask.shape[-2]} query rows: under Ulysses the attention holds all {total} "
                                  f"queries of the ranks (the mask's rows are neither theirs nor this rank's {n})")
            mask = mask.narrow(-2, start, n)
        keys = key.shape[-2] * degree
        if not alone and mask.shape[-1] == key.shape[-2] and key.shape[-2] > 1:
            mask = torch.cat(self.world.exchange.all_gather(self.world.state().rank, mask), dim=-1)
        elif alone and mask.shape[-1] not in (1, keys):
            mask = torch.cat([mask] * -(-keys // mask.shape[-1]), dim=-1)[..., :keys]
        return mask

    def _gathered(self, x: torch.Tensor, keys_of: str | None) -> torch.Tensor:
        """Every rank's ``x`` on the sequence axis; for keys rank 0 counts positions equal on all ranks."""
        world = self.world
        if world.exchange is None:
            return torch.cat([x] * world.degree, dim=-2)
        parts = world.exchange.all_gather(world.state().rank, x)
        facts = world.run.keys.get(keys_of) if keys_of is not None and world.state().rank == 0 else None
        if facts is not None and not facts.get("counted") and all(p.shape == x.shape for p in parts):
            same = torch.stack([p == parts[0] for p in parts[1:]]).all(0)
            dims = [d for d in range(x.dim()) if d != x.dim() - 2]
            facts["repeated"] = int(same.permute(*dims, x.dim() - 2).reshape(-1, x.shape[-2]).all(0).sum())
            facts["counted"] = True
        return torch.cat(parts, dim=-2)


def _modules_for(transformer, key: str) -> list:
    if key == "":
        return [transformer]
    if "*" in key:
        prefix = key.split(".*")[0]
        parent = transformer.get_submodule(prefix)
        return list(parent.children())
    mod = transformer.get_submodule(key)
    return list(mod.values()) if isinstance(mod, torch.nn.ModuleDict) else [mod]  # cache-dit hooks every entry


def _shard(x: torch.Tensor, cpi, where: str, world: _World) -> torch.Tensor:
    """This rank's shard of ``x`` under one ``ContextParallelInput`` (a wrong dim count is skipped and noted)."""
    rank, degree, run = world.state().rank, world.degree, world.run
    if cpi.expected_dims is not None and x.dim() != cpi.expected_dims:
        if rank == 0:
            run.skipped.append(f"{where}: expects {cpi.expected_dims} dims, got {list(x.shape)}: not split")
        return x
    n = x.shape[cpi.split_dim]
    if n % degree and not (world.uneven and n >= degree):
        more = (" (an uneven split needs cache-dit's ulysses_anything, which this launch does not enable)"
                if n >= degree else "")
        raise DryRunError(f"the plan splits {where} {list(x.shape)} on dim {cpi.split_dim}: {n} does not "
                          f"divide into {degree} equal shards{more}")
    if n % degree and rank == 0:
        world.full_of[shard_sizes(n, degree)[0]] = n
        if not run.inputs_seen_uneven(where):
            run.uneven.append(f"{where} {list(x.shape)} dim {cpi.split_dim}: {shard_sizes(n, degree)}")
    # torch.tensor_split, as cache-dit's uneven sharder (the same as chunk where degree divides n)
    return x.tensor_split(degree, dim=cpi.split_dim)[rank]


def _split_hooks(key: str, spec: dict, module, world: _World):
    """The (pre, post) hooks re-enacting one plan entry: named inputs before, ``split_output`` after."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = []

    def pre(m, a, kw):
        a = list(a)
        for name, cpi in spec.items():
            if isinstance(name, int) or (_is_input(cpi) and cpi.split_output):
                continue
            if name in kw:
                val, put = kw[name], (lambda v, _n=name: kw.__setitem__(_n, v))
            elif name in params and params.index(name) < len(a):
                i = params.index(name)
                val, put = a[i], (lambda v, _i=i: a.__setitem__(_i, v))
            else:
                if "[" in name and world.state().rank == 0:  # bound from ``*args`` (``sharding.bind_inputs``)
                    world.run.skipped.append(f"'{name}' at '{key or '<transformer>'}': an element of *{name.split('[')[0]}, "
                                             f"which cache-dit's split hooks cannot name: not split")
                continue
            where = f"'{name}' at '{key or '<transformer>'}'"
            if isinstance(val, torch.Tensor):
                put(_shard(val, cpi, where, world))
            elif isinstance(val, (list, tuple)):
                put(type(val)(_shard(x, c, where, world) if torch.is_tensor(x) and not c.split_output else x
                              for x, c in zip(val, cpi)))
        return tuple(a), kw

    def post(m, a, out):
        if not any(isinstance(i, int) for i in spec):
            return None
        _tensor_outputs(out, f"'{key}'")
        outs = [out] if torch.is_tensor(out) else list(out)
        for idx, cpi in spec.items():
            if isinstance(idx, int) and _is_input(cpi) and cpi.split_output:
                outs[idx] = _shard(outs[idx], cpi, f"output {idx} of '{key}'", world)
        return outs[0] if torch.is_tensor(out) else type(out)(outs)
    return pre, post


def _tensor_outputs(out, where: str) -> None:
    """Refuse a hooked output that is not a tensor or tuple of tensors, as cache-dit's hooks would fail."""
    if torch.is_tensor(out) or (isinstance(out, (list, tuple)) and all(torch.is_tensor(x) for x in out)):
        return
    kinds = [type(x).__name__ for x in out] if isinstance(out, (list, tuple)) else [type(out).__name__]
    raise DryRunError(f"the plan hooks the output of {where}, which returns ({', '.join(kinds)}): cache-dit's "
                      f"context parallel splits and gathers only a tensor or a tuple of tensors")


def _gather_hook(spec, world: _World):
    """The post hook re-enacting a gather; ``None`` outputs pass as in ``cp.uneven.gather_around_none``."""
    specs = [spec] if _is_output(spec) else list(spec)

    def post(m, a, out):
        whole = out
        if isinstance(out, (list, tuple)) and any(o is None for o in out) and \
                len([o for o in out if o is not None]) == len(specs):
            out = [o for o in out if o is not None]  # the specs name the output's tensors
        _tensor_outputs(out, f"the gather at '{type(m).__name__}'")
        outs = [out] if torch.is_tensor(out) else list(out)
        for i, cpo in enumerate(specs):
            if cpo is not None and i < len(outs):
                outs[i] = world.gather(outs[i], cpo.gather_dim)
        if out is not whole:
            it = iter(outs)
            return type(whole)(next(it) if o is not None else None for o in whole)
        return outs[0] if torch.is_tensor(out) else type(out)(outs)
    return post


def _hook_plan(transformer, plan: dict, world: _World, handles: list) -> None:
    """Register the plan's splits and gathers on their modules (handles appended as they are made)."""
    for key, spec in plan.items():
        for module in _modules_for(transformer, key):
            if isinstance(spec, dict):
                pre, post = _split_hooks(key, spec, module, world)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post))
            elif _is_output(spec) or isinstance(spec, (list, tuple)):
                handles.append(module.register_forward_hook(_gather_hook(spec, world)))


def _module_index(transformer, lists: list[str]) -> tuple[dict, dict, set]:
    """id(module) -> name; id(first block) -> its list; ids of every block of the split lists."""
    names = {id(m): n for n, m in transformer.named_modules()}
    firsts = {id(transformer.get_submodule(n)[0]): n for n in lists}
    split_blocks = {id(b) for n in lists for b in transformer.get_submodule(n)}
    return names, firsts, split_blocks


def _hook_recorder(transformer, index: tuple[dict, dict, set], world: _World, handles: list,
                   outputs: dict | None = None, watch: set | None = None) -> None:
    """Hooks on every module: running stack, split depth, first-block inputs, ``watch`` outputs."""
    names, firsts, split_blocks = index
    run = world.run

    def enter(m, a, kw):
        st = world.state()
        st.stack.append(names.get(id(m), "?"))
        if id(m) in split_blocks:
            st.depth += 1
        lname = firsts.get(id(m))
        if st.rank == 0 and lname is not None and lname not in run.inputs:
            run.inputs[lname] = {k: _shapes(v) for k, v in bind_inputs(m, a, kw).items() if _tensors(v)}

    def leave(m, a, out):
        st = world.state()
        name = st.stack.pop()
        if id(m) in split_blocks:
            st.depth -= 1
        if outputs is not None and name in watch:
            mine = outputs.setdefault(st.rank, [])
            if not any(n == name for n, _ in mine):
                mine.append((name, [t.detach().clone() for t in _tensors(out) or []]))
    for m in transformer.modules():
        handles.append(m.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(m.register_forward_hook(leave))


def _dry_run_failure(exc: Exception, stack: list[str], run: DryRun) -> Exception:
    """``DryRunUnavailable`` for a forward needing a process group, else a ``DryRunError`` naming the module."""
    line = str(exc).splitlines()[0] if str(exc) else ""
    if any("torch/distributed" in f.filename.replace("\\", "/") for f in traceback.extract_tb(exc.__traceback__)):
        return DryRunUnavailable(f"the forward under the plan needs a process group (a planner's patched "
                                 f"forward talks to the other ranks): {type(exc).__name__}: {line[:160]}")
    where = (stack[-1] if stack else "") or "<transformer>"
    skipped = f" (splits not applied: {'; '.join(run.skipped)})" if run.skipped else ""
    short = f"in '{where}': {type(exc).__name__}: {line[:200]}"
    err = DryRunError(f"one-process dry run of the plan fails {short}{skipped}")
    err.run, err.short = run, short  # what the blocks had received until then
    return err


@contextlib.contextmanager
def _plan_installed(transformer, plan: dict, world: _World, lists: list[str], probe: bool,
                    outputs: dict | None = None, watch: set | None = None):
    """The plan's hooks, recorder, attention wrappers and stand-in CP config, removed on exit."""
    handles: list = []
    group = WrapGroup("ditbook-cp-dryrun")
    procs: list[tuple[object, dict]] = []
    old_cp = transformer.__dict__.get("_cp_config", _MISSING)
    try:
        # the plan's hooks first, so the recorder below sees what the blocks get after the split
        _hook_plan(transformer, plan, world, handles)
        _hook_recorder(transformer, _module_index(transformer, lists), world, handles, outputs, watch)
        for name, module in _cp_processors(transformer, lists).items():
            group.wrap(module, _attention_wrapper(world, name, module, probe))
            if probe and not any(p is module.processor for p, _ in procs):
                procs.append((module.processor, _set_configs(module.processor, world.probe)))
        transformer._cp_config = _StandInCP(world)
        yield
    finally:
        for proc, saved in procs:
            _restore_configs(proc, saved)
        group.remove()
        for h in handles:
            h.remove()
        if old_cp is _MISSING:
            transformer.__dict__.pop("_cp_config", None)
        else:
            transformer.__dict__["_cp_config"] = old_cp


def dry_run(transformer, args, kwargs, plan: dict, degree: int, lists: list[str], uneven: bool = False) -> DryRun:
    """Run the forward once with ``plan`` re-enacted for rank 0 of ``degree``."""
    run = DryRun(allow_uneven=uneven)
    world = _World(degree, run, uneven=uneven)
    try:
        with _plan_installed(transformer, plan, world, lists, probe=True):
            with torch.no_grad(), _RankAttention(world):
                out = _main_output(transformer(*args, **kwargs))
        run.output_shape = list(out.shape) if out is not None else None
    except PlanCheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plan does not fit the model: named
        raise _dry_run_failure(exc, world.state().stack, run) from exc
    return run


def _os_threads() -> int | None:
    """How many OS threads this process runs now (None where /proc does not say)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _wait_os_threads(before: int | None, timeout: float = 5.0) -> None:
    """Until the rank threads have really ended: a fork during their exit hangs on held locks."""
    if before is None:
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end and (_os_threads() or 0) > before:
        time.sleep(0.01)


def simulate_ranks(transformer, args, kwargs, plan: dict, degree: int, lists: list[str], cp_calls: dict,
                   watch: set | None = None, uneven: bool = False) -> tuple[list, dict, DryRun]:
    """Every rank of ``plan`` as one thread; returns each rank's output and its ``watch`` modules' outputs."""
    run = DryRun(cp_calls=dict(cp_calls), allow_uneven=uneven)
    world = _World(degree, run, _Exchange(degree), uneven=uneven)
    outputs: dict | None = {} if watch else None
    results: list = [None] * degree
    errors: list = [None] * degree
    failed_in: list = [None] * degree

    threads_per_rank = torch.get_num_threads()

    def rank_thread(rank: int) -> None:
        st = world.state()
        st.rank = rank
        # per-thread intra-op count: the default would use an inherited OpenMP pool that hangs
        torch.set_num_threads(threads_per_rank)
        try:
            with torch.no_grad(), _RankAttention(world):
                results[rank] = _main_output(transformer(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank], failed_in[rank] = exc, list(st.stack)
        finally:
            world.exchange.leave(rank)

    with _plan_installed(transformer, plan, world, lists, probe=False, outputs=outputs, watch=watch):
        threads = [threading.Thread(target=rank_thread, args=(r,), name=f"ditbook-cp-rank{r}") for r in range(degree)]
        before = _os_threads()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait_os_threads(before)
    own = [(r, e) for r, e in enumerate(errors) if e is not None and not isinstance(e, _PeerGone)]
    if own or any(e is not None for e in errors):
        r, exc = own[0] if own else next((r, e) for r, e in enumerate(errors) if e is not None)
        if isinstance(exc, PlanCheckError):
            raise exc
        raise _dry_run_failure(exc, failed_in[r], run) from exc
    return results, outputs or {}, run


def _tolerance(t: torch.Tensor) -> float:
    return CP_DRYRUN_REL_TOL[0] if t.dtype in (torch.float32, torch.float64) else CP_DRYRUN_REL_TOL[1]


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
        return float("inf")
    diff = (got.double() - ref.double()).abs().max()
    if not torch.isfinite(diff):
        return float("inf")
    return float(diff / ref.double().abs().max().clamp_min(1e-6))


def _whole(parts: list[torch.Tensor], shape) -> torch.Tensor | None:
    """A module's whole-sequence output from every rank's (rank 0's, or joined on the split axis)."""
    first = parts[0]
    if list(first.shape) == list(shape):
        return first
    if first.dim() != len(shape) or any(p.dim() != first.dim() for p in parts):
        return None
    axes = [d for d in range(first.dim()) if first.shape[d] != shape[d]]
    if len(axes) == 1 and sum(p.shape[axes[0]] for p in parts) == shape[axes[0]] and all(
            list(p.shape[:axes[0]]) + list(p.shape[axes[0] + 1:]) == list(shape[:axes[0]]) + list(shape[axes[0] + 1:])
            for p in parts):
        return torch.cat(parts, dim=axes[0])
    return None


def _watched(transformer, lists: list[str]) -> set[str]:
    """The first block of every split list and every module inside it."""
    out = set()
    for lname in lists:
        first = f"{lname}.0"
        out |= {first} | {f"{first}.{n}" for n, _ in transformer.get_submodule(first).named_modules() if n}
    return out


def _reference_outputs(transformer, args, kwargs, watch: set[str]) -> list[tuple[str, list]]:
    """The plain forward's first outputs of the ``watch`` modules, in the order they return."""
    got: list = []
    handles = []
    for name, module in transformer.named_modules():
        if name in watch:
            def post(m, a, out, _n=name):
                if not any(n == _n for n, _ in got):
                    got.append((_n, [t.detach().clone() for t in _tensors(out) or []]))
            handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad(), _without_cp(transformer):
            transformer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return got


def _attention_note(name: str, keys: dict, degree: int) -> str:
    """What the simulation saw of the attention in ``name`` (rank 0's first call)."""
    facts = keys.get(name)
    if facts is None:
        return ""
    if not facts["cp"]:
        return (f": it runs as local attention on each rank (its processor passes no CP config for this call), "
                f"over the {facts['keys']} keys the rank holds; when they come from a split input, each rank's "
                f"queries miss the other ranks' keys")
    if facts.get("repeated"):
        return (f": it runs as CP attention, and {facts['repeated']} of the {facts['keys']} keys each rank gives "
                f"it hold the same values on every rank (tokens every rank holds whole, concatenated with split "
                f"tokens inside the attention): gathered from the ranks they count {degree} times")
    return f": it runs as CP attention over {facts['keys']} keys per rank"


def _first_divergence(transformer, args, kwargs, plan: dict, degree: int, lists: list[str],
                      cp_calls: dict, uneven: bool = False) -> str:
    """Where the simulated ranks first part from the plain forward in the first blocks ('' if nowhere)."""
    watch = _watched(transformer, lists)
    ref = _reference_outputs(transformer, args, kwargs, watch)
    _, outs, run = simulate_ranks(transformer, args, kwargs, plan, degree, lists, cp_calls, watch=watch, uneven=uneven)
    per_rank = [dict(outs.get(r, [])) for r in range(degree)]
    for name, tensors in ref:
        if any(name not in o for o in per_rank):
            continue
        for i, t in enumerate(tensors):
            if any(i >= len(o[name]) for o in per_rank):
                continue
            whole = _whole([o[name][i] for o in per_rank], t.shape)
            if whole is None:
                continue
            err = _rel_error(whole, t)
            if err > _tolerance(t):
                # the attention it is, is inside, or is inside of (an output projection)
                near = [n for n in run.keys if n == name or name.startswith(n + ".") or n.startswith(name + ".")]
                note = f"; attention '{near[0]}'{_attention_note(near[0], run.keys, degree)}" if near else ""
                block = next((f"{lname}.0" for lname in lists if name == f"{lname}.0" or name.startswith(f"{lname}.0.")),
                             None)
                if not near and block and not any(n.startswith(block + ".") for n in run.keys):
                    note = (f"; no SDPA call inside '{block}' (attention written by hand, or another kernel, is "
                            f"not made CP attention: it runs on each rank's own tokens only)")
                return f"first at '{name}' (max rel. error {err:.1e}){note}"
    return ""


@contextlib.contextmanager
def _without_cp(transformer):
    """``transformer._cp_config`` is None while the plain forward of a planner-patched transformer runs."""
    missing = "_cp_config" not in transformer.__dict__
    if missing:
        transformer.__dict__["_cp_config"] = None
    try:
        yield
    finally:
        if missing:
            transformer.__dict__.pop("_cp_config", None)


def check_parity(transformer, args, kwargs, plan: dict, degree: int, lists: list[str], run: DryRun,
                 reference: torch.Tensor | None = None) -> float | None:
    """Raise ``ParityError`` unless every simulated rank gives ``reference``; returns the largest error."""
    ref = reference
    if ref is None:
        with torch.no_grad(), _without_cp(transformer):
            ref = _main_output(transformer(*args, **kwargs))
    if ref is None:  # nothing to compare: the plan cannot be verified here, so it is not passed
        raise ParityError("the transformer's output holds no tensor to compare with the plain forward's: the "
                          "simulated ranks cannot be checked")
    outs, _, _ = simulate_ranks(transformer, args, kwargs, plan, degree, lists, run.cp_calls, uneven=run.allow_uneven)
    err = max(_rel_error(o, ref) if o is not None else float("inf") for o in outs)
    if err <= _tolerance(ref):
        return err
    where = _first_divergence(transformer, args, kwargs, plan, degree, lists, run.cp_calls, run.allow_uneven)
    raise ParityError(
        f"simulated in one process ({degree} ranks as threads: each applies its own splits, CP attention takes "
        f"every rank's keys and values, gathers concatenate), the plan's output differs from the plain forward: "
        f"max rel. error {err:.2e} > {_tolerance(ref):g}" + (f"; {where}" if where else
                                                              "; the first blocks agree, the output does not"))


_MISSING = object()


def token_counts(tr: ForwardTrace, streams: Streams, lname: str) -> set[int]:
    """The full token counts a block of ``lname`` can see (joint attention: text and text + image too)."""
    out = {streams.s_img}
    own = expected_lengths(tr, streams).get(lname)
    if own:
        out.add(own["full"])
    if streams.joint and streams.s_txt:
        out |= {streams.s_txt, streams.s_img + streams.s_txt}
    return out


def _unsplit_axis(shapes, after, counts, degree):
    """(index, full shape, axis, shape under the plan) of the first full-length token axis left unsplit, else None."""
    for i, s in enumerate(shapes):
        g = after[i] if after and i < len(after) else None
        axes = [axis for axis, n in enumerate(s[:-1]) if n in counts]  # never the last (feature) axis
        if g is not None and len(g) == len(s) and any(g[a] == shard_sizes(s[a], degree)[0] < s[a] for a in axes):
            continue  # split along its token axis: another axis that happens to be a token count long is not one
        for axis in axes:
            if g is None or len(g) != len(s) or g[axis] != shard_sizes(s[axis], degree)[0]:
                return i, s, axis, g
    return None


def check_token_axes(tr: ForwardTrace, streams: Streams, run: DryRun, degree: int) -> dict:
    """Raise ``TokenAxisError`` for a full-length token axis left unsplit; returns the checked arguments."""
    problems, checked = [], {}
    for lname in streams.lists:
        full, got = tr.lists[lname].inputs, run.inputs.get(lname)
        if got is None:
            problems.append(f"the blocks of '{lname}' were never called in the dry run")
            continue
        counts = token_counts(tr, streams, lname)
        checked[lname] = sorted(p for p, sh in full.items() if any(n in counts for s in sh for n in s[:-1]))
        split = [p for p, sh in got.items() if sh and len(sh) == 1 and len(sh[0]) == 3 and full.get(p)
                 and full[p][0][1] in counts and sh[0][1] == shard_sizes(full[p][0][1], degree)[0] < full[p][0][1]]
        own = expected_lengths(tr, streams).get(lname, {}).get("argument")
        for param, shapes in full.items():
            if not streams.joint and param != own and (param == streams.text or shapes == [streams.text_shape]):
                continue  # cross attention: the text is whole on every rank
            if _MASK_NAMES.search(param):
                continue  # Ulysses attention takes a mask whole (rows fitted in the simulation, which judges it)
            bad = _unsplit_axis(shapes, got.get(param), counts, degree)
            if bad is None:
                continue
            i, s, axis, g = bad
            kind = "token stream" if len(shapes) == 1 and len(s) == 3 and axis == 1 else "positional table"
            problems.append(
                f"{kind} '{param}' {shapes if len(shapes) > 1 else s} of the blocks of '{lname}' has the full token "
                f"axis {s[axis]} (dim {axis}), but under the plan it is {g if g is not None else 'missing'} while "
                f"the plan splits {', '.join(repr(p) for p in split) or 'no token stream'} to 1/{degree}")
    if problems:
        skipped = f" (splits not applied: {'; '.join(run.skipped)})" if run.skipped else ""
        raise TokenAxisError("; ".join(problems) + skipped)
    return checked


def verify_before_launch(transformer, args, kwargs, plan: dict, tr: ForwardTrace, streams: Streams,
                         degree: int, uneven: bool = False) -> dict:
    """All checks; returns a summary for the plan's facts, raises a ``PlanCheckError``."""
    check_grid_reshape(transformer, tr, streams)
    try:
        run = dry_run(transformer, args, kwargs, plan, degree, streams.lists, uneven=uneven)
    except DryRunUnavailable as exc:
        return {"degree": degree, "dry_run": f"not possible: {exc}"}
    except DryRunError as exc:
        # the more telling reason first: a block that already got a full-length table
        partial = getattr(exc, "run", None)
        if partial is not None and partial.inputs:
            seen = Streams(**{**streams.__dict__, "lists": [n for n in streams.lists if n in partial.inputs]})
            try:
                check_token_axes(tr, seen, partial, degree)
            except TokenAxisError as axis:
                raise TokenAxisError(f"{axis}; the dry run then fails {exc.short}") from exc
        raise
    checked = check_token_axes(tr, streams, run, degree)
    if tr.output_shape is not None and run.output_shape != tr.output_shape:
        raise PlanCheckError(f"under the plan the transformer returns {run.output_shape}, one process returns "
                             f"{tr.output_shape}: after the blocks the forward does not get back the whole sequence "
                             f"(it reads a token count from an input the plan split elsewhere, or gathers in the "
                             f"wrong place)")
    try:
        err = check_parity(transformer, args, kwargs, plan, degree, streams.lists, run, tr.output)
        parity = None if err is None else f"simulated ranks match one process: max rel. error {err:.1e}"
    except DryRunUnavailable as exc:
        parity = f"not simulated: {exc}"
    return {"degree": degree, "checked": checked, "block_inputs": run.inputs, "skipped_splits": run.skipped,
            "uneven_splits": run.uneven,
            "split_attention_calls": run.sdpa_calls, "simulated_parity": parity,
            "local_attention": run.to_dict()["local_attention"]}
