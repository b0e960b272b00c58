"""The automatic cache adapter: from the inspection report to a cache-dit ``BlockAdapter``.

``build_cache_adapter`` decides per block list the ``ForwardPattern`` and whether the loop must be folded into the
blocks (``loopfold``), writes the adapter as a plain Python module file (``adapter_source``) and imports that file, so
the adapter the stage verifies is the file it ships. Where cache-dit registers the pipeline, its adapter is preferred
and ``info.differences`` says where ours differs."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import itertools
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import hooks
from ..arch.report import ArchReport
from ..arch.loop_source import list_uses
from .source import (PATTERN_OUTPUT_INDEX, adapter_function_name, adapter_module_source, refused_module_source, safe_name)
from .loopfold import FoldError, LoopFold, loop_body_class_name, plan_fold

class CacheRefused(ValueError):
    """No cache strategy can be applied safely to this model; the message names why."""


@dataclass
class BlockListPlan:
    path: str
    length: int
    block_class: str  # class the cache runs (the loop-body class when folded)
    pattern: str
    folded: bool = False
    fold: dict | None = None
    reason: str = ""


@dataclass
class AdapterInfo:
    model: str
    transformer_class: str
    pipeline_class: str
    block_lists: list[BlockListPlan] = field(default_factory=list)
    has_separate_cfg: bool = False
    patch_functor: str | None = None
    functor_reasons: list[str] = field(default_factory=list)
    cache_dit_registered: str | None = None  # cache-dit's adapter name, when it has one
    used: str = "ditbook"  # which adapter the cache-dit strategies use: "ditbook" or "cache-dit"
    differences: list[str] = field(default_factory=list)
    diffusers_hooks: dict = field(default_factory=dict)  # block class -> registered / reason
    module_name: str = ""
    refused: str | None = None  # why no adapter could be made safely (then block_lists is empty)
    uncached: list[str] = field(default_factory=list)  # block lists left uncached, each with why
    owner: str = ""  # attribute path of the module whose forward loops over the lists ('' = the transformer)
    # [containers, attribute]: lists ``<containers>.<i>.<attribute>`` of containers the transformer never calls
    containers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _get(obj, path: str):
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def loop_owner(transformer, paths: list[str]) -> str:
    """The path of the module whose own forward loops over every list ('' for the transformer, or when unclear)."""
    owners = {p.rsplit(".", 1)[0] if "." in p else "" for p in paths}
    if len(owners) != 1:
        return ""
    owner = owners.pop()
    if not owner or any(part.isdigit() for part in owner.split(".")):
        return ""
    try:
        module = _get(transformer, owner)
    except AttributeError:
        return ""
    names = [p[len(owner) + 1:] for p in paths]
    try:
        uses = list_uses(type(module), names)
    except Exception:  # noqa: BLE001 - a class whose source cannot be read: its loops cannot be shown
        return ""
    return owner if all(uses[n].loops for n in names) else ""


def _pattern_from_report(bl) -> str | None:
    if bl.forward_pattern:
        return bl.forward_pattern
    call = bl.call
    if call is None or not call.output_roles:
        return None
    roles = list(call.output_roles)
    takes_enc = "encoder_hidden_states" in (call.positional + call.keywords + bl.signature)
    if roles == ["hidden_states", "encoder_hidden_states"]:
        return "Pattern_0" if takes_enc else "Pattern_4"
    if roles == ["encoder_hidden_states", "hidden_states"]:
        return "Pattern_1" if takes_enc else "Pattern_5"
    if roles == ["hidden_states"]:
        return "Pattern_2" if takes_enc else "Pattern_3"
    return None


def _contradicts_trace(bl, pattern: str) -> str:
    """Why ``pattern`` disagrees with the traced outputs (count, roles, shapes); '' otherwise."""
    from ..arch.patterns import PATTERNS

    call = bl.call
    if call is None or bl.pattern_source != "traced":
        return ""
    outs = list(PATTERNS[pattern][1])
    if call.outputs != len(outs) or list(call.output_roles) != outs:
        return (f"pattern {pattern} declares outputs {outs} but the traced block returned {call.outputs} "
                f"value(s) with roles {call.output_roles}")
    shapes = call.input_shapes or {}
    for role, shape in zip(call.output_roles, call.output_shapes):
        want = shapes.get(role)
        if want is not None and list(shape) != list(want):
            return f"the traced block's {role} output has shape {shape}, its input {want}"
    return ""


def needs_fold(report: ArchReport, bl, fold: LoopFold | None) -> list[str]:
    """Why the loop over ``bl`` must be folded into its blocks (empty: it need not)."""
    reasons = []
    # only active loop work (on every call, not only with an optional argument) forces a fold
    if report.loop_extra_work and fold is not None and fold.extra_statements:
        mine = [r for r in report.loop_extra_work_reasons if bl.path in r] or report.loop_extra_work_reasons
        reasons += [f"inspection: {r}" for r in mine] or [
            f"the loop over {bl.path} does {fold.extra_statements} statement(s) of extra work per block"]
    if fold is not None and fold.per_block_args:
        reasons.append(f"the loop over {bl.path} in {fold.method} passes each block its own "
                       f"{', '.join(fold.per_block_args[:3])}: a cached unit is called once, with the first "
                       f"block's; folded, each block gets its own")
    pattern = _pattern_from_report(bl)
    if pattern is not None and bl.signature:
        from ..arch.patterns import PATTERNS

        missing = [n for n in PATTERNS[pattern][0] if n not in bl.signature]
        if missing:
            reasons.append(f"blocks of {bl.path} name their streams {bl.signature[:2]}, not {missing}: cache-dit "
                           f"passes {list(PATTERNS[pattern][0])} by name, so the loop body is folded into a block "
                           f"that takes them")
    kws = set(fold.call_keywords if fold else (bl.call.keywords if bl.call else []))
    pos = fold is None or not fold.keyword_call
    if kws and not pos and not ({"hidden_states"} <= kws):
        reasons.append(f"blocks of {bl.path} are called with keywords {sorted(kws)}, "
                       f"which cache-dit's cached blocks cannot route to hidden_states/encoder_hidden_states")
    return reasons


def _fold_reasons(report: ArchReport, bl, u, fold: LoopFold | None, fold_problem: str) -> list[str]:
    """Why the loop over ``bl`` must be folded (in every mode method when one needs it)."""
    reasons = needs_fold(report, bl, fold)
    for mode in fold.modes if fold is not None else []:
        reasons += [r for r in needs_fold(report, bl, mode) if r not in reasons]
    if reasons and fold is not None and fold.modes:  # not a reason by itself: unfolded, every mode's loop runs the unit
        reasons.append(f"self.{bl.path} is looped in {len(fold.variants)} mode methods "
                       f"({', '.join(v.method for v in fold.variants)}), one per call; folded, each "
                       f"runs its own loop body")
    if report.loop_extra_work and fold is None:
        reasons.append(f"inspection reports loop work but the loop cannot be folded: {fold_problem}")
    if u.element_attrs:
        reasons.append(f"the code reads attributes of self.{bl.path}[i] outside the loop "
                       f"({'; '.join(u.element_attrs[:2])}); folded, it reads them from the original blocks")
    if fold is not None and fold.partners:
        reasons.append(f"the loop zips self.{bl.path} with {sorted(fold.partners.values())}; folded, each block "
                       f"runs its partners as one unit")
    if u.early_exits:
        reasons.append(f"the loop over self.{bl.path} uses {'/'.join(u.early_exits)}: a cached unit runs every block "
                       f"of its list; folded, each block's loop body returns early as the loop would")
    if u.in_body:
        reasons.append(f"the loop body reads self.{bl.path} itself ({'; '.join(u.in_body[:2])}); folded, it "
                       f"sees the original list")
    if bl.call is not None and getattr(bl.call, "returns_tuple", False) and bl.call.outputs == 1:
        reasons.append(f"blocks of {bl.path} return a 1-tuple that the loop unpacks; folded, the loop body "
                       f"does the unpacking")
    return reasons


def container_lists(transformer, paths: list[str]) -> tuple[str, str] | None:
    """``(containers, attribute)`` when the block lists are ``<containers>.<i>.<attribute>`` the transformer iterates.
    """
    import torch

    parts = [p.split(".") for p in paths]
    if not parts or any(len(q) < 3 or not q[-2].isdigit() for q in parts):
        return None
    outers, attrs = {".".join(q[:-2]) for q in parts}, {q[-1] for q in parts}
    if len(outers) != 1 or len(attrs) != 1:
        return None
    outer, attr = outers.pop(), attrs.pop()
    try:
        containers = _get(transformer, outer)
    except AttributeError:
        return None
    if not isinstance(containers, torch.nn.ModuleList):
        return None
    holding = [i for i, c in enumerate(containers) if isinstance(getattr(c, attr, None), torch.nn.ModuleList)]
    if [int(q[-2]) for q in parts] != holding:
        return None
    if any(list_uses(type(c), [attr])[attr].loops for c in containers):
        return None  # a container that runs its own blocks: not this case
    uses = list_uses(type(transformer), [outer])[outer]
    iterated = uses.loops or [e for e in uses.element_attrs if ": for " in e]
    return (outer, attr) if iterated else None


def _container_problem(report: ArchReport, bl, pattern: str) -> str:
    """Why a never-called container's list cannot be cached unfolded through a stand-in owner ('' if it can)."""
    from ..arch.patterns import PATTERNS

    if report.loop_extra_work:
        return ("the loop does work of its own per block, and a loop over the blocks of never-called containers "
                "is not folded")
    call, (ins, outs) = bl.call, PATTERNS[pattern]
    if call is None or call.outputs != len(outs) or list(call.output_roles) != list(outs):
        return f"its traced call does not return {list(outs)}"
    if call.varying_arguments:
        return f"the loop passes each block its own {call.varying_arguments[:3]}, which an unfolded unit cannot"
    for k, role in enumerate(ins):
        name = call.positional[k] if k < len(call.positional) else None
        if name is None or call.input_shapes.get(name) != call.output_shapes[list(outs).index(role)]:
            return (f"the loop does not pass the {role} stream as positional argument {k} (traced: positional "
                    f"{call.positional}, keywords {call.keywords}): cache-dit's unit takes the streams first")
    return ""


def _container_plans(report: ArchReport, transformer, containers: tuple[str, str], uncached: list[str]) -> list:
    """The plans of the lists of never-called containers (``container_lists``), unfolded."""
    plans = []
    for bl in report.block_lists:
        plan = _unfolded_plan(bl, transformer)
        why = plan if isinstance(plan, str) else _container_problem(report, bl, plan.pattern)
        if why:
            uncached.append(f"{bl.path}: {why}")
            continue
        plan.reason = ((plan.reason + "; ") if plan.reason else "") + (
            f"held by a container the transformer never calls (its code iterates self.{containers[0]}): cache-dit "
            f"swaps each container's {containers[1]} through a stand-in owner while the transformer's forward runs")
        plans.append(plan)
    return plans


def _unfolded_plan(bl, transformer) -> "BlockListPlan | str":
    """The plan for a list cache-dit runs as it is, or why no forward pattern fits it."""
    pattern = _pattern_from_report(bl)
    if pattern is None:
        return (f"no cache-dit forward pattern fits its traced call "
                f"({bl.pattern_reason or 'outputs ' + str(bl.call.output_roles if bl.call else None)})")
    contradiction = _contradicts_trace(bl, pattern)
    if contradiction:
        return contradiction
    return BlockListPlan(bl.path, len(_get(transformer, bl.path)), bl.block_class, pattern,
                         reason=bl.pattern_reason or "from the inspection report")


def _nesting(tcls, path: str, u) -> str:
    """Who runs a nested list's loop: the container's forward, or the transformer iterating the containers."""
    if u.loops:
        return "though the transformer's forward runs its loop"
    parts = path.split(".")
    outer = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                  if not parts[i - 1].isdigit() and parts[i].isdigit()), None)
    outer_uses = list_uses(tcls, [outer])[outer] if outer else None
    # a for statement over the containers only reads each one's block list: an attribute read
    loops = (outer_uses.loops + [e.split(": ")[0] for e in outer_uses.element_attrs if ": for " in e]) \
        if outer_uses else []
    if loops:
        return (f"whose containers are never called: the transformer's code iterates self.{outer} and runs "
                f"each container's blocks itself ({', '.join(loops[:2])})")
    return "whose own code runs the loop"


def _list_problem(path: str, u, tcls=None) -> str:
    """Why the list cannot be handed to cache-dit at all ('' when it can): nested, or used unsafely."""
    if "." in path:
        # cache-dit swaps a block list by a direct attribute of the transformer only
        where = _nesting(tcls, path, u) if tcls is not None else "nested"
        return (f"nested inside {path.rsplit('.', 1)[0]}, {where}; "
                f"cache-dit swaps block lists by attribute of the transformer, so it is left uncached")
    if u.zipped_after:
        return (f"runs inside the zip loop over self.{u.zipped_after[0]}: it is cached with that list as one unit "
                f"(each folded block runs its partner), never on its own")
    return u.unsafe()


def _folded_plan(transformer, path: str, fold: LoopFold, reasons: list[str]) -> "BlockListPlan":
    """The plan for a list whose loop body is folded into its blocks."""
    return BlockListPlan(path, len(_get(transformer, path)), loop_body_class_name(type(transformer), path),
                         fold.pattern, True, fold.to_dict(), "; ".join(reasons) or "forced")


def _unfolded_or_renamed(bl, transformer, fold: LoopFold | None, folds: list, info: AdapterInfo,
                         owner=None, rel: str | None = None):
    """The unfolded plan, else the folded one where a fold can rename the streams, else why not."""
    plan = _unfolded_plan(bl, transformer)
    if isinstance(plan, str) and fold is not None:
        why = [f"{plan}; folded, the loop body renames and reorders the streams"]
        folds.append(fold)
        info.functor_reasons += why
        folded = _folded_plan(owner if owner is not None else transformer, rel or bl.path, fold, why)
        folded.path = bl.path
        return folded
    return plan


def _try_plan_fold(tcls, path: str) -> tuple[LoopFold | None, str]:
    """The loop fold of ``self.<path>``, or None and why it cannot be folded."""
    try:
        return plan_fold(tcls, path), ""
    except FoldError as exc:
        return None, str(exc)


def _assigned_from_block(fold: LoopFold) -> list[str]:
    """The names the loop body assigns the block call's outputs to, in order (``context, x = block(...)``)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(fold.body_source))
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                                                and c.func.id == fold.block_var for c in ast.walk(node.value)):
            target = node.targets[0]
            names = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            return [n.id for n in names if isinstance(n, ast.Name)]
    return []


def orient_fold(fold: LoopFold | None, bl) -> LoopFold | None:
    """The image stream first among a fold's carried names where the block returns (encoder, hidden)."""
    if fold is None or len(fold.carried) != 2 or bl.call is None:
        return fold
    if list(bl.call.output_roles) != ["encoder_hidden_states", "hidden_states"]:
        return fold
    for variant in fold.variants:
        if _assigned_from_block(variant) == variant.carried:
            variant.carried = variant.carried[::-1]
    return fold


def _override_patterns(plans: list, overrides: dict) -> None:
    """Set the forward pattern of the listed block lists (deliberately wrong adapters in tests)."""
    for p in plans:
        if p.path in overrides:
            p.pattern = overrides[p.path]
            p.reason = "overridden (deliberately)"


def _owner_view(transformer, report: ArchReport, info: AdapterInfo):
    """The module whose forward runs the loops, each list's path in it, and how its code uses them."""
    info.owner = loop_owner(transformer, [b.path for b in report.block_lists])
    owner = _get(transformer, info.owner)
    rel = {b.path: b.path[len(info.owner) + 1:] if info.owner else b.path for b in report.block_lists}
    return owner, rel, list_uses(type(owner), list(rel.values()))


def generate_adapter_source(pipe, report: ArchReport, model: str, *, force_fold: bool | None = None,
                            pattern_overrides: dict | None = None) -> tuple[str, AdapterInfo]:
    """The adapter module's source and its decisions (``pattern_overrides``: wrong adapters for tests)."""
    transformer = pipe.transformer
    tcls = type(transformer)
    info = AdapterInfo(model=model, transformer_class=tcls.__name__, pipeline_class=type(pipe).__name__,
                       has_separate_cfg=report.cfg.style == "separate")
    folds: list[LoopFold] = []
    plans: list[BlockListPlan] = []
    if not report.block_lists:
        raise CacheRefused(f"inspection found no block list in {tcls.__name__} (no ModuleList whose modules "
                           f"the forward calls and that run attention): nothing for a block cache to skip")
    owner, rel, uses = _owner_view(transformer, report, info)
    ocls = type(owner)
    uncached: list[str] = []
    nested = None if info.owner or force_fold else container_lists(transformer, list(rel.values()))
    if nested:
        info.containers = list(nested)
        plans = _container_plans(report, transformer, nested, uncached)
    for bl in report.block_lists if not nested else ():
        u = uses[rel[bl.path]]
        unsafe = _list_problem(rel[bl.path], u, ocls)
        if unsafe:
            uncached.append(f"{bl.path}: {unsafe}")
            continue
        fold, fold_problem = _try_plan_fold(ocls, rel[bl.path])
        fold = orient_fold(fold, bl)
        reasons = _fold_reasons(report, bl, u, fold, fold_problem)
        do_fold = bool(reasons) if force_fold is None else force_fold
        if do_fold and fold is None:
            if force_fold:
                raise FoldError(f"{bl.path}: {fold_problem}")
            uncached.append(f"{bl.path}: the loop must be folded ({reasons[0]}) but cannot be: {fold_problem}")
            continue
        if do_fold:
            folds.append(fold)
            plans.append(_folded_plan(owner, rel[bl.path], fold, reasons))
            plans[-1].path = bl.path
            info.functor_reasons += reasons
        else:
            plan = _unfolded_or_renamed(bl, transformer, fold if force_fold is None else None, folds, info,
                                        owner, rel[bl.path])
            if isinstance(plan, str):
                uncached.append(f"{bl.path}: {plan}")
                continue
            plans.append(plan)
        if u.conditional:
            plans[-1].reason += ("; the code also reads the list outside its loop in an optional mode, which is "
                                 "unsafe with the cache on: " + "; ".join(u.conditional[:2]))
    return _finished_source(info, plans, folds, uncached, tcls, ocls, model, pattern_overrides)


def _finished_source(info: AdapterInfo, plans: list, folds: list, uncached: list[str], tcls, ocls, model: str,
                     pattern_overrides: dict | None) -> tuple[str, AdapterInfo]:
    """The decisions recorded in ``info`` and the adapter module's text; refused without a plan."""
    info.uncached = uncached
    if not plans:
        raise CacheRefused("no block list of " + tcls.__name__ + " can be cached safely: " + "; ".join(uncached))
    _override_patterns(plans, pattern_overrides or {})
    info.block_lists = plans
    functor = f"{tcls.__name__}PatchFunctor" if folds else None
    info.patch_functor = functor
    info.module_name = f"adapter_{model}".replace("-", "_").replace(".", "_")
    from .. import __version__

    return adapter_module_source(ocls, info, folds, __version__), info


class _AdapterFileLoader(importlib.machinery.SourceFileLoader):
    """Imports an adapter file as it is on disk now (no ``__pycache__``), keeping the text it ran in ``text``."""

    text = ""

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        data = self.get_data(path)
        self.text = data.decode("utf-8")
        return self.source_to_code(data, path)


@contextlib.contextmanager
def _model_modules_by_plain_name(transformer):
    """During the import, the model's file-loaded modules answer to the plain names the file uses."""
    from .source import importable_module_name

    aliases = {}
    for cls in type(transformer).__mro__ if transformer is not None else ():
        plain, folder = importable_module_name(cls.__module__)
        module = sys.modules.get(cls.__module__)
        if folder and module is not None and plain not in aliases:
            aliases[plain] = module
    entries = [hooks.set_item(sys.modules, name, module) for name, module in aliases.items()]
    try:
        yield
    finally:
        for entry in reversed(entries):
            entry.remove()


@contextlib.contextmanager
def _registrations_kept():
    """The file's cache-dit registration runs against a copy of cache-dit's table, never the real one."""
    from cache_dit import BlockAdapterRegister

    with hooks.swap_attribute(BlockAdapterRegister, "_adapters", dict(BlockAdapterRegister._adapters)):
        yield


_LOADS = itertools.count()
_RUN_TIME_REFUSALS: list[type] = []


def run_time_refusals() -> tuple:
    """The exception classes loaded adapter files raise to refuse a model (``CarriedNotTensor``)."""
    return tuple(_RUN_TIME_REFUSALS)


def load_adapter_module(path: str | Path, transformer=None, *, register: bool = False):
    """Import the adapter file under a fresh unique name (``register``: keep its cache-dit registration)."""
    path = Path(path).resolve()
    name = f"ditbook_adapter_{safe_name(path.stem)}_{next(_LOADS)}"
    loader = _AdapterFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    entry = hooks.set_item(sys.modules, name, module)  # an import: stays unless the file fails
    try:
        with _model_modules_by_plain_name(transformer), \
                (contextlib.nullcontext() if register else _registrations_kept()):
            loader.exec_module(module)
    except BaseException:
        entry.remove()
        raise
    _RUN_TIME_REFUSALS.extend(v for v in vars(module).values() if isinstance(v, type)
                              and issubclass(v, Exception) and v.__module__ == name)
    return module


def load_adapter_file(path: str | Path, transformer=None, *, register: bool = False):
    """Import a generated adapter module from its file (``load_adapter_module``)."""
    return load_adapter_module(path, transformer, register=register)


def import_adapter_module(source: str, path: str | Path | None = None, name: str = "adapter", transformer=None):
    """Write adapter source to ``path`` (else a removed temporary folder) and import it from there."""
    import linecache
    import tempfile

    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(source)  # the file is part of the run's record: always written
        return load_adapter_module(path, transformer)
    with tempfile.TemporaryDirectory(prefix="ditbook_adapter_") as tmp:
        file = Path(tmp).resolve() / f"{safe_name(name)}.py"
        file.write_text(source)
        module = load_adapter_module(file, transformer)
    # the module's text for tracebacks and ``inspect``, for the module's life (as an imported file's)
    hooks.set_item(linecache.cache, str(file), (len(source), None, source.splitlines(True), str(file)))
    return module


class CacheAdapter:
    """The adapter of one pipeline instance: block lists, patterns, the patch functor."""

    def __init__(self, pipe, report: ArchReport, info: AdapterInfo, module, source: str):
        self.pipe = pipe
        self.report = report
        self.info = info
        self.module = module
        self.source = source

    @classmethod
    def refused(cls, pipe, report: ArchReport, model: str, reason: str,
                write_to: str | Path | None = None) -> "CacheAdapter":
        """An adapter with no block lists that records why none could be made."""
        info = AdapterInfo(model=model, transformer_class=type(pipe.transformer).__name__,
                           pipeline_class=type(pipe).__name__, refused=reason,
                           module_name=f"adapter_{model}".replace("-", "_").replace(".", "_"))
        source = refused_module_source(info)
        if write_to is not None:
            Path(write_to).mkdir(parents=True, exist_ok=True)
            (Path(write_to) / f"{info.module_name}.py").write_text(source)
        return cls(pipe, report, info, None, source)

    @classmethod
    def from_module(cls, pipe, report: ArchReport, module, used: str = "ditbook") -> "CacheAdapter":
        """An adapter from a module loaded by ``load_adapter_module``."""
        import inspect as _inspect

        from cache_dit import PatchFunctor

        folded = getattr(module, "FOLDED", {})
        functors = [n for n, v in vars(module).items() if _inspect.isclass(v) and issubclass(v, PatchFunctor)
                    and v.__module__ == module.__name__]
        info = AdapterInfo(model=module.__name__, transformer_class=module.TRANSFORMER_CLASS,
                           pipeline_class=module.PIPELINE_CLASS, has_separate_cfg=module.HAS_SEPARATE_CFG,
                           patch_functor=functors[0] if functors else None, used=used,
                           cache_dit_registered=cache_dit_registered(pipe), module_name=Path(module.__file__).stem,
                           owner=getattr(module, "OWNER", ""), containers=list(getattr(module, "CONTAINERS", ())))
        for path, pattern in module.BLOCK_LISTS:
            blocks = _get(pipe.transformer, path)
            rel = path[len(info.owner) + 1:] if info.owner else path  # FOLDED is keyed in the owner
            block_class = folded[rel].__name__ if rel in folded else type(blocks[0]).__name__
            info.block_lists.append(BlockListPlan(path, len(blocks), block_class, pattern, rel in folded))
        return cls(pipe, report, info, module, module_text(module))

    def owner_module(self):
        """The module whose forward runs the loops (``info.owner``)."""
        return _get(self.pipe.transformer, self.info.owner)

    def patch(self):
        """Fold the loop into the blocks (no-op without functor); a refused patch is an error, never a no-op."""
        if self.info.patch_functor:
            transformer = self.owner_module()
            getattr(self.module, self.info.patch_functor)().apply(transformer)
            if not getattr(transformer, "_ditbook_folded", False):
                raise FoldError(f"the loop fold of {type(transformer).__name__} was not applied: the instance is "
                                f"marked _is_patched by another patch functor, so its blocks would not match the "
                                f"declared forward patterns {[p.pattern for p in self.info.block_lists]}")
        return self

    def unpatch(self):
        if self.module is not None:
            self.module.unpatch(self.owner_module())
        return self

    @contextlib.contextmanager
    def patched(self):
        self.patch()
        try:
            yield self
        finally:
            self.unpatch()

    def block_lists(self) -> list[tuple[str, object, str]]:
        """(path, ModuleList, pattern) as the transformer holds them now."""
        return [(p.path, _get(self.pipe.transformer, p.path), p.pattern) for p in self.info.block_lists]

    def original_blocks(self) -> list:
        """Every original block module (inside loop-body wrappers when folded)."""
        out = []
        bodies = tuple(getattr(self.module, "FOLDED", {}).values())
        for _, blocks, _ in self.block_lists():
            out += [b.inner if isinstance(b, bodies) else b for b in blocks]
        return out

    def counted_blocks(self) -> list:
        """Every block of every list the forward runs (cached or not), each once: what a skipped share counts."""
        out = self.original_blocks()
        seen = {id(b) for b in out}
        cached = {p.path for p in self.info.block_lists}
        for bl in getattr(self.report, "block_lists", []) or []:
            if bl.path in cached:
                continue
            try:
                blocks = list(_get(self.pipe.transformer, bl.path))
            except (AttributeError, TypeError):
                continue
            out += [b for b in blocks if id(b) not in seen]
            seen |= {id(b) for b in blocks}
        return out

    def block_adapter(self, **kwargs):
        """A fresh cache-dit BlockAdapter: cache-dit's registered one when ``info.used`` says so, else ours."""
        if self.info.used == "cache-dit":
            import cache_dit

            return cache_dit.BlockAdapterRegister.get_adapter(self.pipe, **kwargs)
        return getattr(self.module, adapter_function_name(self.module.PIPELINE_CLASS))(self.pipe, **kwargs)

    def register_diffusers_blocks(self) -> list:
        """Register the block classes in diffusers' TransformerBlockRegistry; returns the handles."""
        from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

        TransformerBlockRegistry._register()
        status, handles = {}, []
        for path, blocks, pattern in self.block_lists():
            cls = type(blocks[0])
            if cls in TransformerBlockRegistry._registry:
                status.setdefault(cls.__name__, "registered by diffusers")
                continue
            hs, ehs = PATTERN_OUTPUT_INDEX[pattern]
            metadata = TransformerBlockMetadata(return_hidden_states_index=hs, return_encoder_hidden_states_index=ehs)
            metadata._cls = cls  # what TransformerBlockRegistry.register sets on the entry
            handles.append(hooks.set_item(TransformerBlockRegistry._registry, cls, metadata))
            status[cls.__name__] = f"registered by ditbook ({pattern}) while the strategy is on"
        self.info.diffusers_hooks = status
        return handles

    @contextlib.contextmanager
    def diffusers_identifiers(self, *modules):
        """Our top-level block list names added to diffusers' block identifiers while a hook is applied."""
        extra = tuple(p for p, _, _ in self.block_lists() if "." not in p)
        with contextlib.ExitStack() as stack:
            for mod in modules:
                attr = "_ALL_TRANSFORMER_BLOCK_IDENTIFIERS"
                if hasattr(mod, attr):
                    names = tuple(dict.fromkeys(getattr(mod, attr) + extra))
                    stack.enter_context(hooks.swap_attribute(mod, attr, names))
            yield

    def top_level_lists_only(self) -> bool:
        return all("." not in p.path for p in self.info.block_lists)


def cache_dit_registered(pipe) -> str | None:
    """The cache-dit registration whose prefix ``pipe``'s class name matches, or None."""
    import cache_dit

    name = type(pipe).__name__
    return next((p for p in cache_dit.BlockAdapterRegister._adapters if name.startswith(p)), None)


def cache_dit_adapter_builds(pipe) -> bool:
    """cache-dit's registered adapter matches ``pipe``'s name, builds on it and its patterns fit."""
    import cache_dit

    if cache_dit_registered(pipe) is None:
        return False
    try:
        theirs = cache_dit.BlockAdapterRegister.get_adapter(pipe, skip_post_init=True)
    except Exception:  # noqa: BLE001 - their factory assumes attributes this model does not have
        return False
    return theirs is not None and declared_patterns_fit(theirs)


def declared_patterns_fit(block_adapter) -> bool:
    """Every list of a cache-dit ``BlockAdapter`` takes the inputs its pattern passes by name."""
    import inspect as _inspect

    import torch

    if block_adapter.patch_functor is not None:
        return True
    blocks = block_adapter.blocks if isinstance(block_adapter.blocks, list) else [block_adapter.blocks]
    patterns = (block_adapter.forward_pattern if isinstance(block_adapter.forward_pattern, list)
                else [block_adapter.forward_pattern] * len(blocks))
    for group, pattern in zip(blocks, patterns):
        if isinstance(group, list) or isinstance(pattern, list) or group is None or not len(group):
            continue
        block = group[0]
        inner = getattr(block, "block", None)  # cache-dit checks a wrapped block's inner one
        block = inner if isinstance(inner, torch.nn.Module) else block
        try:
            params = set(_inspect.signature(block.forward).parameters)
        except (TypeError, ValueError):
            continue
        if not set(getattr(pattern, "In", ())) <= params:
            return False
    return True


def compare_with_registered(pipe, info: AdapterInfo) -> list[str]:
    """Where our block lists / patterns / CFG flag differ from cache-dit's registration."""
    import cache_dit

    try:
        theirs = cache_dit.BlockAdapterRegister.get_adapter(pipe, skip_post_init=True)
    except Exception as exc:  # their factory may assert on a class it does not expect
        return [f"cache-dit's registered adapter could not be built: {type(exc).__name__}: {exc}"]
    if theirs is None:
        return []
    names = [theirs.blocks_name] if isinstance(theirs.blocks_name, str) else theirs.blocks_name
    blocks = theirs.blocks if isinstance(theirs.blocks, list) else [theirs.blocks]
    pats = theirs.forward_pattern if isinstance(theirs.forward_pattern, list) else [theirs.forward_pattern]
    if names is None:
        names = [a for b in blocks for a, v in vars(pipe.transformer).get("_modules", {}).items() if v is b]
    theirs_lists = [(n, p.name) for n, p in zip(names, pats)]
    ours = [(p.path, p.pattern) for p in info.block_lists]
    diffs = []
    dummy = theirs.dummy_blocks_names or []
    if dummy:
        diffs.append(f"cache-dit runs {dummy} inside its first list (dummy blocks, one cache context); "
                     f"ditbook caches each block list with its own context")
    if theirs_lists != ours:
        diffs.append(f"block lists/patterns: cache-dit {theirs_lists}, ditbook {ours}")
    if bool(theirs.has_separate_cfg) != info.has_separate_cfg:
        diffs.append(f"has_separate_cfg: cache-dit {theirs.has_separate_cfg}, ditbook {info.has_separate_cfg}")
    if theirs.patch_functor is not None and not info.patch_functor:
        diffs.append(f"cache-dit applies {type(theirs.patch_functor).__name__}; ditbook needs no functor")
    if info.patch_functor and theirs.patch_functor is None:
        diffs.append(f"ditbook folds the loop ({info.patch_functor}); cache-dit has no functor")
    return diffs


def module_text(module) -> str:
    """The exact text an adapter module was imported from."""
    return getattr(module.__spec__.loader, "text", "") or Path(module.__file__).read_text()


def build_cache_adapter(pipe, report: ArchReport, model: str | None = None, *, write_to: str | Path | None = None,
                        prefer_registered: bool = True, force_fold: bool | None = None,
                        pattern_overrides: dict | None = None) -> CacheAdapter:
    """Write the adapter module of ``pipe`` (to ``write_to``, else a temporary folder) and import it."""
    model = model or type(pipe.transformer).__name__
    source, info = generate_adapter_source(pipe, report, model, force_fold=force_fold,
                                           pattern_overrides=pattern_overrides)
    info.cache_dit_registered = cache_dit_registered(pipe)
    path = Path(write_to) / f"{info.module_name}.py" if write_to else None
    module = import_adapter_module(source, path, info.module_name, transformer=_get(pipe.transformer, info.owner))
    if info.cache_dit_registered:
        info.differences = compare_with_registered(pipe, info)
        if prefer_registered and pattern_overrides is None and force_fold is None:
            # cache-dit matches pipeline names by prefix: a mere namesake its factory refuses gets ours
            info.used = "cache-dit" if cache_dit_adapter_builds(pipe) else "ditbook"
    return CacheAdapter(pipe, report, info, module, module_text(module))
