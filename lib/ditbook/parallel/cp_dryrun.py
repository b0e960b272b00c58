"""Checks of a context-parallel plan before any process is launched.

A plan splits the image (and joint text) tokens; everything else a block receives must agree
with that split, or the ranks crash (a RoPE table of the full length against a shard of the
tokens) or compute the wrong thing. Three checks, all in one process, all by mechanism:

1. ``check_grid_reshape``: a block that takes the token grid as integer arguments (height,
   width, frames whose product is the full token count) and reshapes the token axis into it in
   its own code (``unflatten``/``view``/``reshape``/``rearrange``) cannot run on a shard of the
   tokens: the plan would have to split the grid's leading axis and pass each shard's height,
   which a ``ContextParallelInput`` cannot do. Refused with the names of the arguments.
2. ``dry_run``: the plan's splits and gathers applied on one process, as rank 0 of ``degree``
   ranks would see them (a split keeps shard 0, a gather repeats the shard ``degree`` times),
   with the attention inside the split blocks given ``degree`` times the keys and values, as the
   Ulysses all-to-all gives them. It records what the first block of every block list receives
   and names the module where the forward fails.
3. ``check_token_axes``: every tensor a block of a split list receives that has an axis (not
   its last, feature axis) as long as a full token count (image tokens; with joint attention
   text, and text + image) must have that axis divided by ``degree`` in the dry run.

diffusers' and cache-dit's split hooks are the ones the real run uses; this module re-enacts
what they do to shapes by hand (no library offers a one-process CP simulation).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from .cp_plan import (ForwardTrace, PlanCheckError, Streams, _is_input, _is_output, _main_output, _shapes,
                      _tensors, expected_lengths)
from .sharding import bind_inputs

_SDPA = torch.nn.functional.scaled_dot_product_attention


class GridReshapeError(PlanCheckError):
    """The blocks reshape the token axis into the full spatial grid (no plan of splits helps)."""

    final = True


class TokenAxisError(PlanCheckError):
    """A block input keeps a full-length token axis while the plan splits the tokens."""


class DryRunError(PlanCheckError):
    """The plan's one-process dry run fails."""


class CausalAttentionUnderSplit(ValueError):
    """A block inside the split lists calls causal attention."""


class DryRunUnavailable(RuntimeError):
    """The forward under the plan cannot run in one process (it calls ``torch.distributed``): the
    dry run says nothing, the launch decides."""


def _needs_process_group(exc: BaseException) -> bool:
    frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(exc.__traceback__)]
    return any("torch/distributed" in f for f in frames)


# ---------------------------------------------------------------------------------------------
# 1. blocks that reshape tokens into the grid

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
    """Raise ``GridReshapeError`` when the first block of a split list takes integer arguments
    whose product is its full token count and reshapes with them in its forward."""
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


# ---------------------------------------------------------------------------------------------
# 2. the dry run


@dataclass
class DryRun:
    inputs: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)  # list -> param -> shapes
    skipped: list[str] = field(default_factory=list)  # splits not applied (dimension count differs)
    sdpa_calls: int = 0  # attention calls inside the split blocks
    output_shape: list[int] | None = None  # the transformer's main output after the plan's gathers

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "skipped": self.skipped, "sdpa_calls": self.sdpa_calls,
                "output_shape": self.output_shape}


class _StandInCP:
    """What a planner's patched forward reads from ``transformer._cp_config`` during the dry run."""

    def __init__(self, degree: int):
        self._rank, self._world_size = 0, degree
        self.ulysses_degree, self.ring_degree = degree, 1

    @property
    def context_parallel_config(self):
        return self


class _UlyssesShapes(TorchFunctionMode):
    """SDPA inside a split block: keys and values ``degree`` times as long (what the all-to-all
    gathers), queries as they are; elsewhere the real SDPA."""

    def __init__(self, degree: int, depth: dict, run: DryRun):
        super().__init__()
        self.degree, self.depth, self.run = degree, depth, run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and self.depth["n"] > 0:
            self.run.sdpa_calls += 1
            if kwargs.get("is_causal") or (len(args) > 5 and args[5]):
                raise CausalAttentionUnderSplit(
                    "causal attention (is_causal=True) inside a split block: under a sequence split each "
                    "rank's queries would need the keys before them only, across ranks; the context-parallel "
                    "attention does not take a causal mask")
            args = list(args)
            for i, name in ((1, "key"), (2, "value")):
                if i < len(args):
                    args[i] = torch.cat([args[i]] * self.degree, dim=-2)
                elif name in kwargs:
                    kwargs[name] = torch.cat([kwargs[name]] * self.degree, dim=-2)
            return func(*args, **kwargs)
        return func(*args, **kwargs)


def _modules_for(transformer, key: str) -> list:
    if key == "":
        return [transformer]
    if "*" in key:
        prefix = key.split(".*")[0]
        parent = transformer.get_submodule(prefix)
        return list(parent.children())
    return [transformer.get_submodule(key)]


def _shard(x: torch.Tensor, cpi, where: str, degree: int, run: DryRun) -> torch.Tensor:
    """Rank 0's shard of ``x`` under one ``ContextParallelInput`` (a wrong rank count is skipped and noted)."""
    if cpi.expected_dims is not None and x.dim() != cpi.expected_dims:
        run.skipped.append(f"{where}: expects {cpi.expected_dims} dims, got {list(x.shape)}: not split")
        return x
    n = x.shape[cpi.split_dim]
    if n % degree:
        raise DryRunError(f"the plan splits {where} {list(x.shape)} on dim {cpi.split_dim}: {n} does not "
                          f"divide into {degree} equal shards")
    return x.chunk(degree, dim=cpi.split_dim)[0]


def _split_hooks(key: str, spec: dict, module, degree: int, run: DryRun):
    """The (pre, post) hooks that re-enact one plan entry of splits: named inputs before the
    call, indexed outputs (``split_output``) after it."""
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
                continue
            where = f"'{name}' at '{key or '<transformer>'}'"
            if isinstance(val, torch.Tensor):
                put(_shard(val, cpi, where, degree, run))
            elif isinstance(val, (list, tuple)):
                put(type(val)(_shard(x, c, where, degree, run) if torch.is_tensor(x) and not c.split_output else x
                              for x, c in zip(val, cpi)))
        return tuple(a), kw

    def post(m, a, out):
        if not any(isinstance(i, int) for i in spec):
            return None
        _tensor_outputs(out, f"'{key}'")
        outs = [out] if torch.is_tensor(out) else list(out)
        for idx, cpi in spec.items():
            if isinstance(idx, int) and _is_input(cpi) and cpi.split_output:
                outs[idx] = _shard(outs[idx], cpi, f"output {idx} of '{key}'", degree, run)
        return outs[0] if torch.is_tensor(out) else type(out)(outs)
    return pre, post


def _tensor_outputs(out, where: str) -> None:
    """cache-dit's split/gather hooks take a module output that is a tensor or a tuple/list of tensors
    only (a block returning ``(tensor, None)`` raises in every rank): the dry run refuses it first."""
    if torch.is_tensor(out) or (isinstance(out, (list, tuple)) and all(torch.is_tensor(x) for x in out)):
        return
    kinds = [type(x).__name__ for x in out] if isinstance(out, (list, tuple)) else [type(out).__name__]
    raise DryRunError(f"the plan hooks the output of {where}, which returns ({', '.join(kinds)}): cache-dit's "
                      f"context parallel splits and gathers only a tensor or a tuple of tensors")


def _gather_hook(spec, degree: int):
    """The post hook that re-enacts a gather: each gathered output repeated ``degree`` times."""
    specs = [spec] if _is_output(spec) else list(spec)

    def post(m, a, out):
        _tensor_outputs(out, f"the gather at '{type(m).__name__}'")
        outs = [out] if torch.is_tensor(out) else list(out)
        for i, cpo in enumerate(specs):
            if cpo is not None and i < len(outs):
                outs[i] = torch.cat([outs[i]] * degree, dim=cpo.gather_dim)
        return outs[0] if torch.is_tensor(out) else type(out)(outs)
    return post


def _hook_plan(transformer, plan: dict, degree: int, run: DryRun, handles: list) -> None:
    """Register the plan's splits and gathers on their modules (handles appended as they are made)."""
    for key, spec in plan.items():
        for module in _modules_for(transformer, key):
            if isinstance(spec, dict):
                pre, post = _split_hooks(key, spec, module, degree, run)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post))
            elif _is_output(spec) or isinstance(spec, (list, tuple)):
                handles.append(module.register_forward_hook(_gather_hook(spec, degree)))


def _module_index(transformer, lists: list[str]) -> tuple[dict, dict, set]:
    """id(module) -> name; id(first block) -> its list; ids of every block of the split lists."""
    names = {id(m): n for n, m in transformer.named_modules()}
    firsts = {id(transformer.get_submodule(n)[0]): n for n in lists}
    split_blocks = {id(b) for n in lists for b in transformer.get_submodule(n)}
    return names, firsts, split_blocks


def _hook_recorder(transformer, index: tuple[dict, dict, set], run: DryRun, depth: dict, stack: list[str],
                   handles: list) -> None:
    """Hooks on every module: the stack of running modules (to name where a failure happens), the
    depth inside split blocks (for ``_UlyssesShapes``), and the inputs of each list's first block."""
    names, firsts, split_blocks = index

    def enter(m, a, kw):
        stack.append(names.get(id(m), "?"))
        if id(m) in split_blocks:
            depth["n"] += 1
        lname = firsts.get(id(m))
        if lname is not None and lname not in run.inputs:
            run.inputs[lname] = {k: _shapes(v) for k, v in bind_inputs(m, a, kw).items() if _tensors(v)}

    def leave(m, a, out):
        stack.pop()
        if id(m) in split_blocks:
            depth["n"] -= 1
    for m in transformer.modules():
        handles.append(m.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(m.register_forward_hook(leave))


def _dry_run_failure(exc: Exception, stack: list[str], run: DryRun) -> Exception:
    """The error to raise for a forward that failed under the plan: ``DryRunUnavailable`` when it
    needs a process group, else a ``DryRunError`` naming the module that failed."""
    if _needs_process_group(exc):
        return DryRunUnavailable(f"the forward under the plan needs a process group (a planner's patched "
                                 f"forward talks to the other ranks): {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
    where = stack[-1] if stack else "<transformer>"
    skipped = f" (splits not applied: {'; '.join(run.skipped)})" if run.skipped else ""
    err = DryRunError(f"one-process dry run of the plan fails in '{where or '<transformer>'}': "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}{skipped}")
    err.run = run  # what the blocks had received until then
    err.short = f"in '{where or '<transformer>'}': {type(exc).__name__}: " + \
        (str(exc).splitlines()[0][:200] if str(exc) else "")
    return err


def dry_run(transformer, args, kwargs, plan: dict, degree: int, lists: list[str]) -> DryRun:
    """Run the forward once with ``plan`` re-enacted for rank 0 of ``degree``; returns what the
    first block of each list received. Raises ``DryRunError`` naming the module that failed."""
    run = DryRun()
    handles: list = []
    depth = {"n": 0}
    stack: list[str] = []
    index = _module_index(transformer, lists)
    old_cp = transformer.__dict__.get("_cp_config", _MISSING)
    try:
        # the plan's hooks first, so the recorder below sees what the blocks get after the split
        _hook_plan(transformer, plan, degree, run, handles)
        _hook_recorder(transformer, index, run, depth, stack, handles)
        transformer._cp_config = _StandInCP(degree)
        with torch.no_grad(), _UlyssesShapes(degree, depth, run):
            out = _main_output(transformer(*args, **kwargs))
        run.output_shape = list(out.shape) if out is not None else None
    except PlanCheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plan does not fit the model: named
        raise _dry_run_failure(exc, stack, run) from exc
    finally:
        for h in handles:
            h.remove()
        if old_cp is _MISSING:
            transformer.__dict__.pop("_cp_config", None)
        else:
            transformer.__dict__["_cp_config"] = old_cp
    return run


_MISSING = object()


# ---------------------------------------------------------------------------------------------
# 3. every full-length token axis is split


def token_counts(tr: ForwardTrace, streams: Streams, lname: str) -> set[int]:
    """The full token counts a block of ``lname`` can see: image tokens and the list's own token
    streams, and with joint attention the text and text + image (with cross attention the text
    is whole on every rank: its length is not one of them)."""
    out = {streams.s_img}
    own = expected_lengths(tr, streams).get(lname)
    if own:
        out.add(own["full"])
    if streams.joint and streams.s_txt:
        out |= {streams.s_txt, streams.s_img + streams.s_txt}
    return out


def _unsplit_axis(shapes, after, counts, degree):
    """(index, full shape, axis, shape under the plan) of the first full-length token axis the
    plan left unsplit, else None."""
    for i, s in enumerate(shapes):
        g = after[i] if after and i < len(after) else None
        for axis, n in enumerate(s[:-1]):  # never the last (feature) axis
            if n in counts and (g is None or len(g) != len(s) or g[axis] * degree != n):
                return i, s, axis, g
    return None


def check_token_axes(tr: ForwardTrace, streams: Streams, run: DryRun, degree: int) -> dict:
    """Raise ``TokenAxisError`` for the first block input of a split list with a full-length
    token axis that the dry run did not divide by ``degree``. Returns {list: checked arguments}."""
    problems, checked = [], {}
    for lname in streams.lists:
        full, got = tr.lists[lname].inputs, run.inputs.get(lname)
        if got is None:
            problems.append(f"the blocks of '{lname}' were never called in the dry run")
            continue
        counts = token_counts(tr, streams, lname)
        checked[lname] = sorted(p for p, sh in full.items() if any(n in counts for s in sh for n in s[:-1]))
        split = [p for p, sh in got.items() if sh and len(sh) == 1 and len(sh[0]) == 3
                 and sh[0][1] * degree in counts and full.get(p) and full[p][0][1] == sh[0][1] * degree]
        own = expected_lengths(tr, streams).get(lname, {}).get("argument")
        for param, shapes in full.items():
            if not streams.joint and param != own and (param == streams.text or shapes == [streams.text_shape]):
                continue  # cross attention: the text is whole on every rank
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
                         degree: int) -> dict:
    """All three checks; returns a summary for the plan's facts. Raises a ``PlanCheckError``."""
    check_grid_reshape(transformer, tr, streams)
    try:
        run = dry_run(transformer, args, kwargs, plan, degree, streams.lists)
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
    return {"degree": degree, "checked": checked, "block_inputs": run.inputs, "skipped_splits": run.skipped,
            "split_attention_calls": run.sdpa_calls}
