"""CFG parallel: the two classifier-free-guidance branches of each step on two ranks, by a
per-instance wrapper around ``pipe.transformer.forward`` (``ditbook.hooks``; ``CfgStats.remove()``
undoes it exactly):

- **separate** (two transformer calls per step, cond then uncond): the rank whose CFG index equals
  the call's parity computes it, the other returns a placeholder of the output's shape. At the
  second call both ranks ``all_gather`` their branch, the first call's placeholder is filled in
  place, and every rank continues with identical outputs. The pipeline must not copy the first
  output before the second call (views are fine) — the parity test catches one that does.
- **batched** (one call with cond and uncond concatenated): each rank runs its half of every tensor
  argument batched like the input, and the halves are all-gathered along the batch.

With context parallelism, the CFG group pairs the ranks holding the same sequence shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..hooks import WrapHandle, wrap_method
from . import plan_name, register
from ._forecast import main_tensor, replace_tensor
from .technique import Feasibility, NoSettings, ParallelTechnique

WRAP = "ditbook.cfg-parallel"


@dataclass
class CfgStats:
    style: str
    calls: int = 0
    computed: int = 0
    skipped: int = 0
    extra_forwards: int = 0
    exchanges: int = 0
    notes: list[str] = field(default_factory=list)
    one_branch_caches: int = 0  # cache contexts told that this rank sees one branch per step
    handle: WrapHandle | None = field(default=None, repr=False, compare=False)
    undo: list = field(default_factory=list, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("handle", "undo")}

    def remove(self) -> None:
        """Take the CFG wrapper (and the caches' one-branch setting) off the transformer again."""
        if self.handle is not None:
            self.handle.remove()
        for h in reversed(self.undo):
            h.remove()
        self.undo = []


def _hidden_input(args, kwargs):
    """The call's image input: ``hidden_states``, else its first positional tensor (None without one)."""
    t = kwargs.get("hidden_states")
    return t if t is not None else next((a for a in args if isinstance(a, torch.Tensor)), None)


def _input_key(args, kwargs) -> tuple:
    t = _hidden_input(args, kwargs)
    return tuple(t.shape) if t is not None else ()


def _gather(local: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    local = local.contiguous()
    out = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(out, local, group=group)
    return out


class CfgShapeError(RuntimeError):
    """Under CFG parallel with a cache, the transformer's output was shaped (or wrapped) unlike the
    input-shaped placeholder a rank answered the other branch's first call with."""


def _placeholder_like_input(args, kwargs, takes_return_dict: bool = True):
    """(placeholder output, its tensor): an empty tensor shaped like the image input, wrapped the
    way the call asks (``return_dict=False``: a tuple; else diffusers' output class; a forward
    without ``return_dict``, ``takes_return_dict`` False: the bare tensor)."""
    t = _hidden_input(args, kwargs)
    if t is None:
        # the input as a list of one tensor per sample (the Wan2.1 reference code's WanModel takes and
        # returns ``[C, F, H, W]`` tensors in a list): the placeholder is a list of the same shape
        seq = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple)) and len(a) == 1
                    and isinstance(a[0], torch.Tensor)), None)
        if seq is None:
            raise CfgShapeError("CFG parallel with a cache: the transformer call has no tensor input to shape the "
                                "other branch's placeholder from; run this model's CFG parallel without the cache")
        ph = torch.empty_like(seq[0])
        return type(seq)([ph]), ph
    ph = torch.empty_like(t)
    if not takes_return_dict:
        return ph, ph
    if kwargs.get("return_dict", True) is False:
        return (ph,), ph
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=ph), ph


def takes_return_dict(transformer) -> bool:
    """Whether the transformer's class ``forward`` has a ``return_dict`` parameter (or ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(type(transformer).forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "return_dict" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class _SeparateState:
    """What one rank's separate-calls wrapper carries from call to call (see ``_separate``)."""

    def __init__(self, stats: CfgStats, me: int, group, wraps: bool = True):
        self.stats, self.me, self.group, self.wraps = stats, me, group, wraps
        self.shapes: dict = {}  # input shape -> (output shape, dtype, device) learnt for it
        self.pending = None  # the first call's output or placeholder; the exchange fills it
        self.own0 = None  # this rank's own first-call output, when it computed that call
        self.guessed = None  # (shape, output type) of a placeholder taken from the input, to check
        self.template = None  # the latest output: placeholders and gathered tensors are wrapped like it

    def first_from_input(self, i: int, args, kwargs):
        """A first call of a new input shape on a rank that skips it, with a cache: answer with a
        placeholder shaped like the input (checked against this rank's output in the same step)."""
        template, ph = _placeholder_like_input(args, kwargs, self.wraps)
        self.template, self.guessed = template, (tuple(ph.shape), type(template))
        self.stats.skipped += 1
        self.own0 = None
        self.pending = ph
        self.stats.notes.append(f"call {i + 1}: output shape taken from the input {tuple(ph.shape)}")
        return template

    def first(self, orig, key, args, kwargs):
        """The first call of a pair: rank 0 computes it (any rank, once per new input shape, to
        learn the output's shape); the other ranks answer with a placeholder of that shape."""
        if self.me == 0 or key not in self.shapes:
            out = orig(*args, **kwargs)
            self.stats.computed += 1
            if self.me != 0:
                self.stats.extra_forwards += 1
            t = main_tensor(out)
            self.template = out
            self.shapes[key] = (tuple(t.shape), t.dtype, t.device)
            self.own0 = t
            self.pending = t
            return out
        shape, dtype, device = self.shapes[key]
        ph = torch.empty(shape, dtype=dtype, device=device)
        self.stats.skipped += 1
        self.own0 = None
        self.pending = ph
        return replace_tensor(self.template, ph)

    def second(self, orig, key, args, kwargs):
        """The second call of a pair: rank 1 computes, rank 0 contributes its first-call result;
        the ranks exchange, and each returns the branch it did not compute from the other."""
        if self.me == 1:
            out = orig(*args, **kwargs)
            self.stats.computed += 1
            self.template = out
            mine = main_tensor(out)
            if self.guessed is not None:
                self._check_guess(out, mine, key)
        else:
            out = None
            mine = self.own0
            self.stats.skipped += 1
        parts = _gather(mine, self.group, 2)
        self.stats.exchanges += 1
        self.pending.copy_(parts[0])  # fills the first call's placeholder (or rewrites it equal)
        if self.me == 1:
            return out
        return replace_tensor(self.template, parts[1])

    def _check_guess(self, out, mine: torch.Tensor, key) -> None:
        """Refuse an output shaped (or wrapped) unlike the input-shaped placeholder; else learn it."""
        want = (tuple(mine.shape), type(out))
        if want != self.guessed:
            raise CfgShapeError(
                f"CFG parallel with a cache: the transformer returned {type(out).__name__} {tuple(mine.shape)}, "
                f"but the placeholder for the other branch was {self.guessed[1].__name__} "
                f"{self.guessed[0]} (the input's shape); run this model's CFG parallel without the cache")
        self.shapes[key] = (tuple(mine.shape), mine.dtype, mine.device)
        self.guessed = None


def _separate(stats: CfgStats, me: int, group, heartbeat, shape_from_input: bool = False, wraps: bool = True):
    """The wrapper for a pipeline that calls the transformer twice per step (cond, uncond). The
    placeholder's shape is learnt for a new input shape by one extra forward, or — with a cache,
    ``shape_from_input`` — from the input's shape, checked against the rank's own output in the
    same step: an extra forward would put that rank's cache (and its collectives) one call ahead."""
    state = _SeparateState(stats, me, group, wraps)

    def separate(orig, *args, **kwargs):
        i = stats.calls
        stats.calls += 1
        if heartbeat:
            heartbeat()
        key = _input_key(args, kwargs)
        if i % 2 == 0 and me != 0 and shape_from_input and key not in state.shapes:
            return state.first_from_input(i, args, kwargs)
        if i % 2 == 0:
            return state.first(orig, key, args, kwargs)
        return state.second(orig, key, args, kwargs)

    return separate


def _batched(stats: CfgStats, me: int, group, heartbeat):
    """The wrapper for a pipeline that calls the transformer once with a batch of two."""

    def batched(orig, *args, **kwargs):
        stats.calls += 1
        if heartbeat:
            heartbeat()
        t = _hidden_input(args, kwargs)
        b = t.shape[0] if t is not None else 0
        if b < 2 or b % 2:
            stats.notes.append(f"call {stats.calls}: batch {b} not splittable, computed whole")
            stats.computed += 1
            return orig(*args, **kwargs)

        def half(v):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b:
                return v.chunk(2, dim=0)[me]
            return v
        out = orig(*[half(a) for a in args], **{k: half(v) for k, v in kwargs.items()})
        stats.computed += 1
        parts = _gather(main_tensor(out), group, 2)
        stats.exchanges += 1
        return replace_tensor(out, torch.cat(parts, dim=0))

    return batched


def one_branch_per_step(transformer) -> list:
    """Every cache context of the transformer set to one call per step; returns the handles that put
    it back. Under separate-calls CFG parallel a rank sees one branch only: a cache set for separate
    CFG (``enable_separate_cfg``) would count a step per two calls and compare each call with its
    branch's call two steps back, computing blocks the one-process run skips (``CfgSplitError``)."""
    from ..hooks import swap_attribute

    configs = {}
    # the keywords cache-dit (re)creates each context from on every pipeline call: kept on the
    # transformer and on its block lists (``_context_kwargs``), the same config objects
    for module in transformer.modules():
        kwargs = vars(module).get("_context_kwargs")
        if isinstance(kwargs, dict) and kwargs.get("cache_config") is not None:
            configs[id(kwargs["cache_config"])] = kwargs["cache_config"]
    cm = getattr(transformer, "_context_manager", None)
    for ctx in (getattr(cm, "_cached_context_manager", None) or {}).values():  # contexts already made
        if getattr(ctx, "cache_config", None) is not None:
            configs[id(ctx.cache_config)] = ctx.cache_config
    return [swap_attribute(c, "enable_separate_cfg", False) for c in configs.values()
            if getattr(c, "enable_separate_cfg", False)]


def apply_cfg_parallel(transformer, style: str, group=None, heartbeat=None, cached: bool = False) -> CfgStats:
    """Wrap ``transformer.forward`` (this instance) for CFG parallel over ``group`` (2 ranks); the
    returned stats' ``remove()`` undoes it. ``cached``: a cache runs inside (see ``_separate``)."""
    if style not in ("separate", "batched"):
        raise ValueError(f"CFG parallel needs a 'separate' or 'batched' CFG style, got {style!r}")
    size = dist.get_world_size(group)
    if size != 2:
        raise ValueError(f"the CFG group must hold 2 ranks, it holds {size}")
    stats = CfgStats(style=style)
    me = dist.get_rank(group)
    wrapper = _separate(stats, me, group, heartbeat, shape_from_input=cached,
                        wraps=takes_return_dict(transformer)) if style == "separate" \
        else _batched(stats, me, group, heartbeat)
    stats.handle = wrap_method(transformer, WRAP, wrapper)
    if cached and style == "separate":
        stats.undo = one_branch_per_step(transformer)
        stats.one_branch_caches = len(stats.undo)
    return stats


def detect_cfg_style(pipe, card) -> str:
    """Count the transformer's calls and batch in a 2-step run: 'separate', 'batched' or 'none'."""
    from ..render import call_kwargs, make_generator

    seen: list[int] = []

    def hook(module, args, kwargs):
        t = _hidden_input(args, kwargs)
        seen.append(int(t.shape[0]) if t is not None else 0)

    h = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        kw = call_kwargs(pipe, card, num_inference_steps=2, output_type="latent")
        pipe(prompt=card.generation.prompts[0], generator=make_generator(card.generation.seeds[0]), **kw)
    finally:
        h.remove()
    if not seen:
        return "none"
    per_step = len(seen) / 2
    if per_step >= 2 and len(seen) % 2 == 0:
        return "separate"
    if seen[0] >= 2 and seen[0] % 2 == 0:
        return "batched"
    return "none"


@register
class CfgParallel(ParallelTechnique):
    """The two CFG branches of each step on two ranks (composed by the worker with CP into one
    mesh; the split is judged from every rank's block rows, ``cp.sharding.check_cfg_split``)."""

    name = "cfg"
    token = "cfg"
    family = "CFG parallel"
    Settings = NoSettings
    order = 10

    @classmethod
    def degree_problem(cls, n: int) -> str | None:
        return None if n in (1, 2) else "CFG parallel splits two branches, so cfg is 2"

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        from .ulysses import ulysses_check

        if n == 1:
            row = Feasibility("cfg", 1, False, None, "one process: nothing to split")
        elif n == 2:
            row = Feasibility("cfg", 2, f.cfg_ok, "cfg2" if f.cfg_ok else None, f.cfg_why)
        else:
            row = Feasibility("cfg", n, False, None, f"CFG has two branches: world size {n} needs cfg2 x CP{n // 2}"
                              " (see cfg_x_ulysses)")
        if n < 4:
            both = Feasibility("cfg_x_ulysses", n, False, None, "needs at least 4 processes (cfg2 x ulysses2)")
        elif not f.cfg_ok:
            both = Feasibility("cfg_x_ulysses", n, False, None, f.cfg_why)
        else:
            ok, why = ulysses_check(f, n // 2, uneven=True)
            both = Feasibility("cfg_x_ulysses", n, ok, plan_name(cfg=2, ulysses=n // 2), f"cfg2 x ulysses{n // 2}: {why}")
        return [row, both]
