"""Text-encoder parallel: call ``i`` of any ``text_encoder*`` component runs on rank ``i % degree``
only (every rank calls the encoders in the same order, so the numbers agree) and its result is
shared: its structure by ``broadcast_object_list``, each tensor by ``broadcast`` into a tensor on the
receiving rank's own device (NCCL ranks never unpickle another GPU's tensors).
``check_text_encoder_sharding`` fails with ``TextEncoderShardingError`` when a call ran on more than
one rank or on none (``TextEncoderRecorder``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..cp.sharding import ShardingError
from ..hooks import WrapGroup
from . import plan_name, register
from .technique import Feasibility, Handle, NoSettings, ParallelTechnique

TE_WRAP = "ditbook.text-encoder-parallel"
RECORD_WRAP = "ditbook.text-encoder-record"


class TextEncoderParallelRefused(RuntimeError):
    """The pipeline has no text encoder to spread over the ranks."""


class TextEncoderShardingError(ShardingError):
    """A text-encoder-parallel run where a call ran on several ranks (or none)."""


def text_encoders(pipe) -> dict[str, nn.Module]:
    """The pipeline's text-encoder components (``text_encoder``, ``text_encoder_2``, ...)."""
    comps = getattr(pipe, "components", {}) or {}
    found = {k: v for k, v in comps.items() if k.startswith("text_encoder") and isinstance(v, nn.Module)}
    if not found:
        raise TextEncoderParallelRefused(f"{type(pipe).__name__} has no text_encoder component")
    return dict(sorted(found.items()))


def _is_marker(obj) -> bool:
    return isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__tensor__"


def _map_tensors(obj, leaf):
    """``obj`` rebuilt with ``leaf(x)`` in place of every tensor and tensor marker."""
    if isinstance(obj, torch.Tensor) or _is_marker(obj):
        return leaf(obj)
    if isinstance(obj, dict):  # transformers' ModelOutput is an OrderedDict subclass
        items = {k: _map_tensors(v, leaf) for k, v in obj.items()}
        try:
            return type(obj)(**items)
        except TypeError:
            return type(obj)(items)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tensors(v, leaf) for v in obj)
    if isinstance(obj, list):
        return [_map_tensors(v, leaf) for v in obj]
    return obj


def _take_tensors(obj, tensors: list):
    """``obj`` with every tensor replaced by a marker of its index in ``tensors`` (shape, dtype kept)."""
    def take(t):
        if not isinstance(t, torch.Tensor):
            return t
        tensors.append(t)
        return ("__tensor__", len(tensors) - 1, tuple(t.shape), str(t.dtype).replace("torch.", ""))
    return _map_tensors(obj, take)


def share_result(result, src: int, device, group=None):
    """``result`` (meaningful on ``src`` only) on every rank."""
    box = [None]
    tensors: list = []
    if dist.get_rank(group) == src:
        box[0] = _take_tensors(result, tensors)
    dist.broadcast_object_list(box, src=src, group=group)
    skeleton = box[0]
    if dist.get_rank(group) != src:
        markers: list = []
        _map_tensors(skeleton, lambda m: markers.append(m) or m)
        tensors = [None] * len(markers)
        for _, i, shape, dtype in markers:
            tensors[i] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    for t in tensors:
        dist.broadcast(t.contiguous() if dist.get_rank(group) == src else t, src=src, group=group)
    return result if dist.get_rank(group) == src else _map_tensors(skeleton, lambda m: tensors[m[1]])


class TextEncoderRecorder:
    """Per rank: every text-encoder call (its number, component and input shape) and whether this
    rank ran the encoder for it. Install it before ``apply_text_encoder_parallel``."""

    def __init__(self, pipe):
        self.calls: list[dict] = []
        self.handles = []
        self.wraps = WrapGroup(RECORD_WRAP)
        with self.wraps.applying():
            for name, enc in text_encoders(pipe).items():
                self.handles.append(enc.register_forward_pre_hook(self._counter(name), with_kwargs=True))
                self.wraps.wrap(enc, self._ran)

    def _counter(self, name: str):
        def pre(module, args, kwargs):
            first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            self.calls.append({"call": len(self.calls), "component": name, "ran": False,
                               "input": list(first.shape) if isinstance(first, torch.Tensor) else None})
        return pre

    def _ran(self, original, *args, **kwargs):
        if self.calls:
            self.calls[-1]["ran"] = True
        return original(*args, **kwargs)

    def record(self) -> dict:
        return {"rank": dist.get_rank() if dist.is_initialized() else 0, "calls": self.calls}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.wraps.remove()


def apply_text_encoder_parallel(pipe, degree: int, group=None) -> WrapGroup:
    """Wrap every text encoder's forward so that call ``i`` runs on rank ``i % degree`` only and
    its result is shared; returns the wraps (``remove()`` undoes them)."""
    encoders = text_encoders(pipe)
    counter = {"n": 0}
    wraps = WrapGroup(TE_WRAP)

    def make(enc: nn.Module):
        def wrapped(original, *args, **kwargs):
            i = counter["n"]
            counter["n"] += 1
            owner = i % degree
            out = original(*args, **kwargs) if dist.get_rank(group) == owner else None
            device = next(enc.parameters()).device
            return share_result(out, owner, device, group)
        return wrapped

    with wraps.applying():
        for enc in encoders.values():
            wraps.wrap(enc, make(enc))
    return wraps


def check_text_encoder_sharding(ranks: list[dict], degree: int) -> dict:
    """Each rank's ``TextEncoderRecorder.record()``: every call must have run on exactly one rank,
    and more than one rank must have run calls when there were at least two."""
    problems = []
    lists = [(rec or {}).get("calls") or [] for rec in ranks]
    if not lists or not lists[0]:
        raise TextEncoderShardingError("the text encoders were never called")
    if len({len(c) for c in lists}) != 1:
        raise TextEncoderShardingError(f"the ranks made different numbers of text-encoder calls: "
                                       f"{[len(c) for c in lists]}")
    runs = [[r for r, calls in enumerate(lists) if calls[i]["ran"]] for i in range(len(lists[0]))]
    many = [(i, who) for i, who in enumerate(runs) if len(who) > 1]
    none = [i for i, who in enumerate(runs) if not who]
    if many:
        i, who = many[0]
        problems.append(f"{len(many)} of {len(runs)} calls ran on several ranks (call {i}, "
                        f"{lists[0][i]['component']}, on ranks {who}): every rank ran the encoder")
    if none:
        problems.append(f"call {none[0]} ran on no rank")
    workers = {who[0] for who in runs if len(who) == 1}
    if not problems and len(runs) > 1 and len(workers) < min(degree, len(runs)):
        problems.append(f"only rank(s) {sorted(workers)} ran the encoders")
    if problems:
        raise TextEncoderShardingError("the text encoders were not spread over the ranks: " + "; ".join(problems))
    by_rank: dict = {r: {} for r in range(len(lists))}
    for i, who in enumerate(runs):
        comp = lists[0][i]["component"]
        by_rank[who[0]][comp] = by_rank[who[0]].get(comp, 0) + 1
    return {"degree": degree, "calls": len(runs), "ran_by_rank": {str(k): v for k, v in by_rank.items()}}


@register
class TextEncoderParallel(ParallelTechnique):
    """The text-encoder calls spread over the plan's ranks (rides on any plan of its size)."""

    name = "te"
    token = "te"
    family = "text-encoder parallel"
    Settings = NoSettings
    order = 80
    multiplies = False
    on_rank = True

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        encoders = {k: v for k, v in f.components.items() if k.startswith("text_encoder")}
        if n == 1:
            return [Feasibility("text_encoder", 1, False, None, "one process")]
        if not encoders:
            return [Feasibility("text_encoder", n, False, None, "the pipeline has no text encoder component")]
        listed = ", ".join(f"{k} ({v})" for k, v in encoders.items())
        return [Feasibility("text_encoder", n, True, plan_name(te=n),
                            f"the calls of {listed} spread round-robin over {n} ranks, each result broadcast")]

    @classmethod
    def apply_on_rank(cls, pipe, card, spec, degree: int, noop: bool = False) -> Handle:
        recorder = TextEncoderRecorder(pipe)  # before the parallel wraps: it sees only the calls that ran
        if not noop:
            apply_text_encoder_parallel(pipe, degree)
        return Handle(recorder.remove, recorder.record)

    @classmethod
    def check(cls, records: list, degree: int) -> dict:
        """Fails when every rank ran every text encoder (``check_text_encoder_sharding``)."""
        return check_text_encoder_sharding(records, degree)
