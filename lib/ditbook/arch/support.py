"""What the libraries already support for a transformer class, asked of the libraries themselves: cache-dit's registered
adapter (block lists, patterns, patch functor, separate CFG) and CP / TP planners; diffusers' ``_cp_plan`` /
``_tp_plan`` and ``TransformerBlockRegistry`` entries. A library without a registry gives "unknown", not a crash."""

from __future__ import annotations

import logging

from torch import nn

from .report import ArchReport, SupportFacts


def _quiet_cache_dit():
    for name in ("cache_dit", "CACHE_DIT"):
        logging.getLogger(name).setLevel(logging.ERROR)


def cache_dit_adapter(module: nn.Module, pipeline_class: str | None):
    """(registered name, BlockAdapter or None, error) from cache-dit's registry."""
    try:
        from cache_dit.caching.block_adapters import BlockAdapterRegister, FakeDiffusionPipeline
    except Exception as exc:  # cache-dit missing or broken
        return None, None, f"cache-dit not importable: {exc}"
    _quiet_cache_dit()
    names = [n for n in (pipeline_class, type(module).__name__) if n]
    for cls_name in names:
        for name, factory in BlockAdapterRegister._adapters.items():
            if cls_name.startswith(name):
                try:
                    adapter = factory(FakeDiffusionPipeline(module), skip_post_init=True)
                except Exception as exc:  # the factory asserts the class or needs a newer diffusers
                    return name, None, f"cache-dit adapter {name!r} refused this module: {type(exc).__name__}: {exc}"
                return name, adapter, None
    return None, None, None


def _planner(kind: str, cls_name: str) -> str | None:
    try:
        from cache_dit.distributed.transformers import planners, register
    except Exception:
        return None
    reg = register.ContextParallelismPlannerRegister if kind == "cp" else register.TensorParallelismPlannerRegister
    try:
        if reg.supported_planners()[0] == 0:
            (planners._activate_cp_planners if kind == "cp" else planners._activate_tp_planners)()
    except Exception:
        return None
    return next((name for name in reg.supported_planners()[1] if cls_name.startswith(name)), None)


def _paths_of(module: nn.Module, lists) -> list[str]:
    """Attribute paths of cache-dit's block lists; a list concatenated from named lists is ``a+b``."""
    named = {id(m): n for n, m in module.named_modules()}
    lists_by_first = {id(m[0]): (n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m)}
    out = []
    for lst in lists:
        if id(lst) in named:
            out.append(named[id(lst)])
            continue
        parts, i, items = [], 0, list(lst)
        while i < len(items) and id(items[i]) in lists_by_first:
            n, m = lists_by_first[id(items[i])]
            if [id(x) for x in items[i:i + len(m)]] != [id(x) for x in m]:
                break
            parts.append(n)
            i += len(m)
        out.append("+".join(parts) if parts and i == len(items) else "<unnamed list>")
    return out


def support_facts(module: nn.Module, pipeline_class: str | None, report: ArchReport | None = None) -> SupportFacts:
    facts = SupportFacts()
    cls = type(module)
    facts.diffusers_cp_plan = bool(getattr(cls, "_cp_plan", None))
    facts.diffusers_tp_plan = bool(getattr(cls, "_tp_plan", None))
    from .patterns import diffusers_block_metadata

    if report is not None:
        for b in report.block_lists:
            block = module.get_submodule(b.path)[0]
            facts.diffusers_hook_blocks[type(block).__name__] = diffusers_block_metadata(type(block)) is not None
    facts.cache_dit_cp_planner = _planner("cp", cls.__name__)
    facts.cache_dit_tp_planner = _planner("tp", cls.__name__)

    name, adapter, err = cache_dit_adapter(module, pipeline_class)
    facts.cache_dit_adapter = name
    if err:
        facts.notes.append(err)
    if adapter is not None:
        blocks = adapter.blocks if isinstance(adapter.blocks, (list, tuple)) else [adapter.blocks]
        patterns = adapter.forward_pattern if isinstance(adapter.forward_pattern, (list, tuple)) else [adapter.forward_pattern]
        facts.cache_dit_blocks = _paths_of(module, blocks)
        facts.cache_dit_patterns = [p.name for p in patterns]
        functor = getattr(adapter, "patch_functor", None)
        facts.cache_dit_patch_functor = type(functor).__name__ if functor is not None else None
        facts.cache_dit_separate_cfg = bool(getattr(adapter, "has_separate_cfg", False))
    if report is not None:
        compare_with_cache_dit(report, facts)
    return facts


def compare_with_cache_dit(report: ArchReport, facts: SupportFacts) -> None:
    """Fill ``facts.agreement`` and each block list's ``cache_dit_pattern``."""
    facts.agreement = []
    if not facts.cache_dit_adapter:
        facts.agreement.append("cache-dit has no registered adapter for this class: nothing to compare")
        return
    if not facts.cache_dit_blocks:
        facts.agreement.append(f"cache-dit adapter {facts.cache_dit_adapter!r} could not be built for comparison")
        return
    ours = [b.path for b in report.block_lists]
    theirs = facts.cache_dit_blocks
    if sorted(ours) == sorted(theirs):
        facts.agreement.append(f"block lists agree: {ours}")
    else:
        missing = [p for p in ours if p not in theirs]
        extra = [p for p in theirs if p not in ours]
        facts.agreement.append(f"block lists differ: ditbook {ours}, cache-dit {theirs}"
                               + (f"; cache-dit leaves out {missing} (those blocks run uncached)" if missing else "")
                               + (f"; ditbook did not find {extra}" if extra else ""))
    if sorted(ours) != sorted(theirs) and sorted(p for t in theirs for p in t.split("+")) == sorted(ours):
        facts.agreement[-1] = (f"block lists agree: cache-dit runs {theirs} as one cached list "
                               f"(patch functor {facts.cache_dit_patch_functor}), ditbook found {ours}")
    pairs = [(p, pat) for t, pat in zip(theirs, facts.cache_dit_patterns) for p in t.split("+")]
    for path, pat in pairs:
        try:
            b = report.block_list(path)
        except KeyError:
            continue
        b.cache_dit_pattern = pat
        if b.forward_pattern == pat:
            facts.agreement.append(f"{path}: pattern agrees ({pat})")
        elif pat in b.compatible_patterns:
            facts.agreement.append(f"{path}: cache-dit declares {pat}, ditbook prefers {b.forward_pattern}; both run "
                                   f"the block correctly ({b.pattern_reason})")
        elif b.forward_pattern is None:
            facts.agreement.append(f"{path}: cache-dit declares {pat}; ditbook found no pattern: {b.pattern_reason}")
        else:
            facts.agreement.append(f"{path}: DISAGREE: cache-dit declares {pat}, ditbook found {b.forward_pattern} "
                                   f"({b.pattern_reason}) from a {b.pattern_source} reading")
