"""Inputs for a forward that takes one packed joint sequence (no batch axis) described by its parts
(``joint_layout``, ``layout_inputs``): an int total length (``sequence_length``), per part a tensor of
its positions in the sequence (``text_indexes``), and its contents (token ids an ``Embedding`` reads,
or per-item latents with a companion list of each item's token grid, frame index lists, per-token
timesteps). Read from the signature, the docstring, the data flow and the config; no class names.
The parts are laid out one after another in signature order, each index tensor its part's range,
the lengths their sums; optional parts are left out, and what is left wrong to ``coverage.repairs``."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field

import torch

from .config import config_int
from .dataflow import annotation_text, axis_role

_INDEX_WORDS = ("index", "indexes", "indices", "idx")


@dataclass
class Part:
    """One part of the joint sequence: the parameters named with its prefix."""

    prefix: str
    indexes: list = field(default_factory=list)  # index tensors of its positions in the sequence
    items: str | None = None  # the list[Tensor] of per-item latents
    shapes: str | None = None  # the list[tuple] of each item's token grid
    frame_lists: list = field(default_factory=list)  # list[Tensor] of per-item frame indexes
    times: list = field(default_factory=list)  # per-token timesteps


def _ann(p) -> str:
    return annotation_text(p.annotation)


def _is_index(name: str) -> bool:
    return name.lower().rsplit("_", 1)[-1] in _INDEX_WORDS


def _is_int(p) -> bool:
    return _ann(p) == "int"


def _total_param(params: list) -> str | None:
    """The required int that is the length of the whole sequence (``sequence_length``)."""
    for p in params:
        low = p.name.lower()
        if _is_int(p) and axis_role(p.name) == "tokens" and any(w in low for w in ("seq", "total")):
            return p.name
    return None


def joint_layout(fn) -> tuple[str, list[Part]] | None:
    """(the total-length parameter, the parts in signature order) when the forward ``fn`` takes a
    packed joint sequence by parts (see the module docstring): a required int total length and
    required index tensors of the parts' positions; None otherwise."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = [p for p in sig.parameters.values() if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
              and p.default is inspect.Parameter.empty]
    total = _total_param(params)
    if total is None:
        return None
    parts: dict[str, Part] = {}
    for p in params:
        ann = _ann(p)
        if _is_index(p.name) and not ann.startswith("list[") and "_" in p.name:
            prefix = p.name.split("_", 1)[0]
            parts.setdefault(prefix, Part(prefix)).indexes.append(p.name)
    if not parts:
        return None
    for p in params:
        prefix, ann, low = p.name.split("_", 1)[0], _ann(p), p.name.lower()
        part = parts.get(prefix)
        if part is None or p.name in part.indexes:
            continue
        if ann.startswith("list[tuple[") and low.endswith("shapes"):
            part.shapes = p.name
        elif ann.startswith("list[") and "Tensor" in ann and _is_index(p.name):
            part.frame_lists.append(p.name)
        elif ann.startswith("list[") and "Tensor" in ann:
            part.items = part.items or p.name
        elif "time" in low or "sigma" in low:
            part.times.append(p.name)
    return total, list(parts.values())


def _doc_line(fn, name: str) -> str:
    doc = inspect.getdoc(fn) or ""
    m = re.search(rf"^[ \t]*{re.escape(name)}\b[^\n]*", doc, re.M)
    return m.group(0) if m else ""


_DOC_DIMS = re.compile(r"`+[\[(]([\w ,+*]+)[\])]`+")


def layout_inputs(model, grid, needs: dict, base: dict, gen: torch.Generator | None = None) -> dict | None:
    """Keyword inputs laid out as one packed joint sequence (``joint_layout``) on top of ``base``;
    None when the forward takes no such sequence. ``needs`` tells which input an ``Embedding`` reads."""
    # long: one layout built part by part; its sizes, index ranges, ids, lengths and positions depend on each other
    fn = type(model).forward
    found = joint_layout(fn)
    if found is None:
        return None
    total_name, parts = found
    cfg = dict(getattr(model, "config", None) or {})
    patch = config_int(cfg, "patch_size", exclude=("_t", "temporal")) or 1
    patch_t = config_int(cfg, "patch_size_t", "temporal_patch") or 1
    chans = config_int(cfg, "in_channels", "in_dim", "in_chans", "latent_channel", "input_dim") \
        or config_int(cfg, "channel", exclude=("out", "hidden", "mult")) or grid.channels
    frames = max(1, grid.frames // patch_t)
    tok_h, tok_w = max(1, grid.height // max(grid.patch, 1)), max(1, grid.width // max(grid.patch, 1))
    token_grid = (frames, tok_h, tok_w)
    out = dict(base)
    counts, offset, starts = {}, 0, {}
    for part in parts:
        counts[part.prefix] = math.prod(token_grid) if part.shapes or part.items else grid.text
        starts[part.prefix] = offset
        offset += counts[part.prefix]
    for part in parts:
        n, s = counts[part.prefix], starts[part.prefix]
        for name in part.indexes:
            out[name] = torch.arange(s, s + n)
        if part.shapes:
            out[part.shapes] = [token_grid]
        if part.items:
            out[part.items] = [torch.randn((1, chans, frames * patch_t, tok_h * patch, tok_w * patch), generator=gen)]
        for name in part.frame_lists:
            low = name.lower()
            out[name] = [torch.arange(frames if axis_role(name) == "frames" or "frame" in low else n)]
        for name in part.times:
            out[name] = torch.full((n,), 500.0)  # one per token: a packed sequence has no batch axis
    # token ids an Embedding reads: those of the one part without latents (the text)
    texts = [p for p in parts if not (p.shapes or p.items)]
    for name, need in needs.items():
        if need.vocab and name in out and len(texts) == 1 and not any(name.startswith(p.prefix + "_") for p in parts):
            out[name] = torch.randint(0, min(need.vocab, 16), (counts[texts[0].prefix],), generator=gen)
    out[total_name] = offset
    sig = inspect.signature(fn).parameters
    for name, p in sig.items():
        if p.default is not inspect.Parameter.empty or name == total_name or not _is_int(p) \
                or axis_role(name) != "tokens":
            continue
        line = _doc_line(fn, name).lower()  # a length of one part: the part its docstring names
        part = next((q for q in parts if q.prefix.lower() in line.split(":", 1)[-1]), parts[0])
        out[name] = counts[part.prefix]
    for name, p in sig.items():
        low = name.lower()
        if p.default is not inspect.Parameter.empty or not (low.endswith("ids") or "position" in low) \
                or name in out and any(name.startswith(q.prefix + "_") for q in parts) or (needs.get(name) and needs[name].vocab):
            continue
        m = _DOC_DIMS.search(_doc_line(fn, name))
        dims = [d.strip() for d in m.group(1).split(",")] if m else [total_name]
        shape = [int(d) if d.isdigit() else out[d] if isinstance(out.get(d), int) else offset for d in dims]
        out[name] = torch.zeros(shape, dtype=torch.long)  # positions along the whole sequence
    return out
