"""What each rank's blocks really received, and the check that a parallel plan split the sequence (parity alone cannot
see a plan that splits nothing). ``BlockInputRecorder`` wraps every block, before the plan's hooks, and records per
list the sequence lengths of ``[B, S, ...]`` arguments; ``check_sharding`` raises ``ShardingError`` unless every
rank's main lists got their share (``shard_sizes``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..hooks import WrapError, wrap_method

WRAP_NAME = "ditbook_sharding_record"


def _tensors(value) -> list[torch.Tensor] | None:
    """The tensor, or the tensors of a tuple/list of tensors (None entries skipped), else None."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return [v for v in value if v is not None]
    if hasattr(value, "sample") and isinstance(getattr(value, "sample"), torch.Tensor):
        return [value.sample]
    return None


def bind_inputs(module, args, kwargs) -> dict[str, Any]:
    """A call's arguments by parameter name (positional ones bound through the signature)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names, star = [], None
    for p in params:  # positional names up to a ``*args`` (``forward(self, *args, **kwargs)``: SD3.5's blocks)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
            continue
        star = p.name if p.kind is p.VAR_POSITIONAL else None
        break
    named = {(names[i] if i < len(names) else f"{star}[{i - len(names)}]" if star else f"arg{i}"): a
             for i, a in enumerate(args)}
    named.update(kwargs)
    return named


def block_lists(transformer) -> list[str]:
    """Names of every non-empty ``nn.ModuleList`` of the transformer, outermost first."""
    return [n for n, m in transformer.named_modules() if n and isinstance(m, torch.nn.ModuleList) and len(m)]


class ShardingError(RuntimeError):
    """A parallel plan's blocks did not run on their share of the tokens."""


class BlockInputRecorder:
    """Per block list: block calls, and for each argument the set of sequence lengths seen."""

    def __init__(self, transformer, lists: list[str] | None = None):
        self.lists = lists if lists is not None else block_lists(transformer)
        self.calls: dict[str, int] = {}
        self.rows: dict[str, int] = {}  # batch rows the blocks evaluated (calls x batch)
        # entries into the list: batch rows of its first block, which a block cache always computes
        self.entries: dict[str, int] = {}
        self.entry_calls: dict[str, int] = {}
        self.lengths: dict[str, dict[str, set[int]]] = {}
        self.handles = []
        for name in self.lists:
            for block in transformer.get_submodule(name):
                try:
                    signature = inspect.signature(block.forward)
                except (TypeError, ValueError):
                    signature = None
                self.handles.append(wrap_method(block, WRAP_NAME, self._wrapper(name, block, signature,
                                                                                first=block is transformer.get_submodule(name)[0])))
                if signature is not None:  # cache-dit matches forward patterns by parameter names
                    block.forward.__signature__ = signature

    def _wrapper(self, lname: str, block, signature, first: bool = False):
        params = list(signature.parameters) if signature is not None else []

        def record(original, *args, **kwargs):
            self.calls[lname] = self.calls.get(lname, 0) + 1
            per = self.lengths.setdefault(lname, {})
            named = {(params[i] if i < len(params) else f"arg{i}"): a for i, a in enumerate(args)}
            named.update(kwargs)
            batch = None
            for param, value in named.items():
                ts = _tensors(value)
                if ts and len(ts) == 1 and ts[0].dim() == 3:
                    per.setdefault(param, set()).add(int(ts[0].shape[1]))
                    batch = int(ts[0].shape[0]) if batch is None else batch
            rows = batch if batch is not None else 1
            self.rows[lname] = self.rows.get(lname, 0) + rows
            if first:
                self.entries[lname] = self.entries.get(lname, 0) + rows
                self.entry_calls[lname] = self.entry_calls.get(lname, 0) + 1
            return original(*args, **kwargs)
        return record

    def to_dict(self) -> dict:
        """Per called list: calls, rows, entries, entry_calls and ``seq_lens`` per argument."""
        return {n: {"calls": self.calls[n], "rows": self.rows.get(n, 0), "entries": self.entries.get(n, 0),
                    "entry_calls": self.entry_calls.get(n, 0),
                    "seq_lens": {p: sorted(v) for p, v in self.lengths.get(n, {}).items()}}
                for n in self.lists if self.calls.get(n)}

    def reset(self) -> None:
        self.calls, self.rows, self.lengths, self.entries, self.entry_calls = {}, {}, {}, {}, {}

    def remove(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except WrapError:  # a plan's own hooks wrapped the block after us: it goes with the model
                pass
        self.handles = []


def shard_sizes(n: int, degree: int) -> list[int]:
    """Each rank's share of ``n`` tokens, as ``torch.tensor_split`` gives them."""
    return [n // degree + (1 if r < n % degree else 0) for r in range(degree)]


def check_sharding(ranks: list[dict], expected: dict[str, dict], degree: int) -> dict:
    """Raise ``ShardingError`` unless every rank's main lists got the rank's share of the tokens."""
    if not expected:
        raise ShardingError("no block list with [batch, sequence, width] inputs to check the split on")
    problems, seen = [], {}
    for name, e in expected.items():
        sizes = shard_sizes(e["full"], degree)
        if not all(sizes):
            problems.append(f"'{name}': {e['full']} tokens cannot give each of {degree} ranks one")
        for r, rec in enumerate(ranks):
            got = rec.get(name, {}).get("seq_lens", {}).get(e["argument"])
            seen.setdefault(name, []).append(got)
            # the (cfg, ring, ulysses) mesh is row-major: a rank's place in its CP group is rank % degree
            want = sizes[r % degree]
            if not got:
                problems.append(f"rank {r}: the blocks of '{name}' never received '{e['argument']}'")
            elif got != [want]:
                problems.append(f"rank {r}: the blocks of '{name}' received '{e['argument']}' with {got} tokens, "
                                f"expected {want} (rank {r}'s share of {e['full']} over {degree})")
    if problems:
        raise ShardingError("the plan did not split the blocks' sequence: " + "; ".join(problems))
    whole = _whole_lists(ranks, expected)
    if whole:
        raise ShardingError(whole)
    return {"degree": degree, "expected": expected, "per_rank": seen}


def _whole_lists(ranks: list[dict], expected: dict[str, dict]) -> str | None:
    """Why the split is mostly vacuous: the lists outside ``expected`` that took the whole sequence
    (a ``[B, S, D]`` input at least as long as the longest split one) on every rank ran more block
    calls than the split lists did. None when the split lists carry most of the blocks."""
    longest = max(e["full"] for e in expected.values())
    first = ranks[0] if ranks else {}
    nested = {n for n in first if any(n.startswith(o + ".") for o in first)}  # lists inside a block
    whole = [n for n in first if n not in expected and n not in nested and all(
        any(max(v, default=0) >= longest for v in rec.get(n, {}).get("seq_lens", {}).values()) for rec in ranks)]
    split_calls = sum(first.get(n, {}).get("calls", 0) for n in expected)
    whole_calls = sum(first[n].get("calls", 0) for n in whole)
    if whole_calls <= split_calls:
        return None
    return (f"the plan split {sorted(expected)} ({split_calls} block calls a rank) while {whole} "
            f"({whole_calls} block calls) ran on the whole {longest}-token sequence on every rank: "
            f"most of the blocks are not split")


class CfgSplitError(RuntimeError):
    """A CFG-parallel plan whose ranks did not divide the guidance branches between them."""


def check_cfg_split(ranks: list[dict], reference: dict, degree: int) -> dict:
    """Raise ``CfgSplitError`` unless each rank entered the lists with about 1 / degree of the rows."""
    if not reference:
        raise CfgSplitError("no one-process block record to compare the ranks' work with")
    problems, per_list = [], {}
    for name, ref in reference.items():
        ref_rows, ref_calls = ref.get("entries") or 0, ref.get("entry_calls") or 0
        if not ref_rows or not ref_calls:
            continue
        allowed = ref_rows / degree + ref_rows / ref_calls
        rows = [((rec or {}).get(name) or {}).get("entries", 0) for rec in ranks]
        per_list[name] = {"rows": rows, "reference_rows": ref_rows, "allowed": allowed}
        for r, got in enumerate(rows):
            if not got:
                problems.append(f"rank {r}: the blocks of '{name}' were never entered")
            elif got > allowed:
                problems.append(f"rank {r}: '{name}' was entered with {got} batch rows, in the one-process run with "
                                f"{ref_rows}; split {degree} ways a rank may enter at most {allowed:g}")
    if not per_list:
        raise CfgSplitError("the one-process run recorded no block entries to compare with")
    if problems:
        raise CfgSplitError("the ranks did not divide the CFG branches: " + "; ".join(problems))
    return {"degree": degree, "per_list": per_list}
