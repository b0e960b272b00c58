"""Cache on top of context parallelism: ``agree_cache_decisions`` all-reduces cache-dit's ``can_cache`` so every rank
skips together (a lone skip would pair mismatched collectives), and ``split_at_cached_units`` moves a split at a
list's first block onto cache-dit's cached unit of that list."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CacheAgreement:
    decisions: int = 0
    skips: int = 0
    disagreements: int = 0
    handle: Any = field(default=None, repr=False, compare=False)  # takes the agreement off (exact undo)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "handle"}


def static_schedule(mask) -> dict:
    """``parallel.cache`` options of a static schedule (``mask``: 1 = computed step)."""
    mask = [int(m) for m in mask]
    return {"steps_computation_mask": mask, "steps_computation_policy": "static", "num_inference_steps": len(mask),
            "max_warmup_steps": 0}


def _collective_device(group=None) -> torch.device:
    """The current CUDA device for NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_cache_decisions(pipe, group=None) -> CacheAgreement:
    """Wrap cache-dit's decision on this pipeline so every rank of ``group`` takes the same one."""
    cm = getattr(pipe, "_context_manager", None) or getattr(pipe.transformer, "_context_manager", None)
    if cm is None:
        raise RuntimeError("no cache-dit context manager on this pipeline: enable the cache first")
    from ..hooks import wrap_method

    stats = CacheAgreement()

    def can_cache(orig, *args, **kwargs):
        local = bool(orig(*args, **kwargs))
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=_collective_device(group))
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        agreed = bool(int(flag.item()))
        stats.decisions += 1
        stats.skips += int(agreed)
        stats.disagreements += int(agreed != local)
        return agreed

    # this pipeline's context manager only; ``stats.remove()`` puts cache-dit's decision back exactly
    stats.handle = wrap_method(cm, "agree-cache-decisions", can_cache, attr="can_cache")
    return stats


class CacheSplitError(RuntimeError):
    """A CP plan that splits at a block's input cannot be moved onto cache-dit's cached unit."""


def cached_block_units(transformer) -> dict[str, torch.nn.Module]:
    """cache-dit's cached units by block-list name, found in the closures of its installed forward."""
    seen, found = set(), {}

    def walk(fn, depth):
        if fn is None or id(fn) in seen or depth > 4:
            return
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            walk(fn.func, depth + 1)
            for a in fn.args:  # ditbook.hooks composes wraps as partial(wrapper, inner)
                if callable(a):
                    walk(a, depth + 1)
            return
        inner = getattr(fn, "__wrapped__", None)  # a wrap installed over cache-dit's forward (ditbook.hooks)
        if callable(inner):
            walk(inner, depth + 1)
        cells = {}
        code = getattr(fn, "__code__", None)
        for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
            try:
                cells[name] = cell.cell_contents
            except ValueError:
                continue
        if {"blocks_name", "unique_blocks_name", "unified_blocks"} <= set(cells):
            for b, u in zip(cells["blocks_name"], cells["unique_blocks_name"]):
                found[b] = cells["unified_blocks"][u][0]
        for v in cells.values():
            if callable(v):
                walk(v, depth + 1)
            elif not isinstance(v, torch.nn.Module):
                # a hook registry's reference to the forward it wraps (diffusers' HookFunctionReference)
                for attr in ("forward", "original_forward"):
                    inner_fn = getattr(v, attr, None)
                    if callable(inner_fn) and not isinstance(inner_fn, torch.nn.Module):
                        walk(inner_fn, depth + 1)

    # the modules cache-dit was handed: the transformer, a network it holds, or stand-in container owners
    paths = {id(m): n for n, m in transformer.named_modules()}
    roots = [("", transformer)] + [(n, m) for n, m in transformer.named_modules()
                                   if n and "forward" in m.__dict__ and getattr(m, "_is_cached", False)]
    roots += [(paths.get(id(o.__dict__.get("_container")), ""), o)
              for o in transformer.__dict__.get("_ditbook_container_owners") or ()]
    units = {}
    for prefix, module in roots:
        found.clear()
        walk(module.__dict__.get("forward"), 0)
        units.update({f"{prefix}.{name}" if prefix else name: unit for name, unit in found.items()})
    if not units:
        raise CacheSplitError("cache-dit's cached block units were not found on this transformer's forward")
    return units


def split_at_cached_units(transformer, plan: dict, facts: dict) -> tuple[dict, dict[str, torch.nn.Module], dict]:
    """Move splits at ``<list>.0`` onto cache-dit's cached unit of that list: (rest, units, unit plans)."""
    units = None
    rest, unit_plans = {}, {}
    roles = {facts.get("image_input"): "hidden_states", facts.get("text_input"): "encoder_hidden_states"}
    for key, value in plan.items():
        head, _, tail = key.rpartition(".")
        if tail.isdigit() and not isinstance(value, dict) and head in (facts.get("block_lists") or []):
            raise CacheSplitError(f"the plan gathers the tokens at the output of block '{key}'; with a cache that "
                                  f"block is skipped on cached steps and the gather with it")
        if tail == "0" and isinstance(value, dict):
            units = units if units is not None else cached_block_units(transformer)
            if head not in units:
                raise CacheSplitError(f"the plan splits at '{key}', and cache-dit has no cached unit for '{head}'")
            mapped = {}
            for param, cpi in value.items():
                if param not in roles or roles[param] is None:
                    raise CacheSplitError(f"'{key}' input '{param}' is neither the image nor the text stream; "
                                          f"the cached unit of '{head}' cannot split it")
                mapped[roles[param]] = cpi
            unit_plans[head] = {"": mapped}
        else:
            rest[key] = value
    return rest, (units or {}), unit_plans
