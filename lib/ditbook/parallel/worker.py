"""One rank of a parallel run: ``python -m torch.distributed.run ... -m ditbook.parallel.worker``.

Each rank loads the model, applies the plan and renders every case; rank 0 saves the images and
``worker.json``. World-size-1 plans (the baseline) run replicated, rank 0's figures reported. A stall
watchdog and the process group's ``--timeout`` end a stuck rank; torchrun ends the rest.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .. import accel
from ..accel.technique import Handle
from ..records import KindCheck, RankSplit, Sharding


REUSE_LIMIT = 500_000_000  # transformer parameters; larger models are loaded per plan


class Watchdog:
    """Ends this rank when nothing has progressed for ``timeout`` seconds."""

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        self.last = time.monotonic()
        self.what = "start"
        t = threading.Thread(target=self._run, daemon=True)
        t.start()

    def beat(self, what: str = "") -> None:
        self.last = time.monotonic()
        if what:
            self.what = what

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                sys.stderr.write(f"ditbook parallel: rank {self.rank} made no progress for {idle:.0f}s "
                                 f"(last: {self.what}); ending the run\n")
                sys.stderr.flush()
                os._exit(124)


class InjectedFault(RuntimeError):
    """Raised in one rank by ``DITBOOK_PARALLEL_RAISE`` (the tests' plan that fails in the ranks)."""


def _fault_hook(transformer, rank: int, plan: str = ""):
    """``DITBOOK_PARALLEL_FAULT=RANK:CALL[:PLAN]`` kills rank RANK at its CALL-th transformer call
    (of plan PLAN only, when named); ``DITBOOK_PARALLEL_RAISE`` raises ``InjectedFault`` there."""
    for var, kill in (("DITBOOK_PARALLEL_FAULT", True), ("DITBOOK_PARALLEL_RAISE", False)):
        spec = os.environ.get(var)
        if not spec:
            continue
        r, call, *only = spec.split(":", 2)
        if int(r) != rank or (only and only[0] != plan):
            continue
        transformer.register_forward_pre_hook(_fault(rank, int(call), kill), with_kwargs=True)


def _fault(rank: int, call: int, kill: bool):
    count = {"n": 0}

    def hook(module, args, kwargs):
        count["n"] += 1
        if count["n"] < call:
            return
        if not kill:
            raise InjectedFault(f"fault injection in rank {rank} at transformer call {count['n']}")
        sys.stderr.write(f"ditbook parallel: fault injection kills rank {rank} at call {count['n']}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return hook


def _cfg_groups(tr, spec):
    """(the CFG process group, the CP device mesh or None) of a plan."""
    cfg_group = cp_mesh = None
    if spec.cfg > 1 and spec.uses_cp:
        from torch.distributed.device_mesh import init_device_mesh

        dev_type = "cuda" if torch.cuda.is_available() and str(tr.device).startswith("cuda") else "cpu"
        mesh = init_device_mesh(dev_type, (2, spec.ring, spec.ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
        cfg_group = mesh["cfg"].get_group()
        cp_mesh = mesh["ring", "ulysses"]
    elif spec.cfg > 1:
        cfg_group = dist.group.WORLD
    return cfg_group, cp_mesh


def _resolve_plan(pipe, card, spec, *, attention_kind, cp_plan_file, out_dir, info: dict, check=None):
    """The CP plan for this transformer, recorded in ``info`` and (rank 0) written as code to
    ``out_dir``. Ulysses alone may split token counts unevenly (``ulysses_anything``)."""
    from ..cp.plan import capture_transformer_call, resolve_cp_plan, write_plan_code

    tr = pipe.transformer
    cp = resolve_cp_plan(tr, capture=lambda: capture_transformer_call(pipe, card), attention_kind=attention_kind,
                         degree=spec.cp, plan_file=cp_plan_file, check=check,
                         uneven=check is not None and spec.ring == 1)
    info["cp_plan"] = cp.to_dict()
    if out_dir is not None and dist.get_rank() == 0:
        info["cp_plan_file"] = str(write_plan_code(cp, out_dir, card.name, type(tr).__name__))
    return cp


def _enable_cp_on_mesh(tr, spec, cp, cache_cfg, target, cp_mesh, info: dict) -> None:
    """cfg x CP (a mesh slice cache-dit's ParallelismConfig cannot take) or ditbook's cache adapter:
    the cache first, then cache-dit's runtime CP entry on an explicit mesh (splits moved onto the
    cached units, ``cp.cache_sync``)."""
    import cache_dit
    from cache_dit.attention import _maybe_register_custom_attn_backends
    from cache_dit.distributed.core import _ContextParallelConfig, _enable_context_parallelism
    from cache_dit.distributed.core._context_parallel import _apply_context_parallel

    from ..accel.dbcache import cfg_from_adapter
    from ..cp.cache_sync import split_at_cached_units
    from ..cp.plan import needs_ulysses_anything

    plan, units, unit_plans = cp.plan, {}, {}
    if cache_cfg is not None:
        cache_dit.enable_cache(target, cache_config=cfg_from_adapter(cache_cfg, target))
        plan, units, unit_plans = split_at_cached_units(tr, cp.plan, cp.facts)
        info["cp_split_at_cached_units"] = sorted(unit_plans)
    if cp_mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        dev_type = "cuda" if str(tr.device).startswith("cuda") else "cpu"
        cp_mesh = init_device_mesh(dev_type, (spec.ring, spec.ulysses), mesh_dim_names=("ring", "ulysses"))
    _maybe_register_custom_attn_backends()
    cpc = _ContextParallelConfig(ulysses_degree=spec.ulysses, ring_degree=spec.ring,
                                 ulysses_anything=needs_ulysses_anything(cp))
    cpc.setup(dist.get_rank(), dist.get_world_size(), tr.device, mesh=cp_mesh)
    _enable_context_parallelism(tr, config=cpc, cp_plan=plan)
    for name, unit_plan in unit_plans.items():
        _apply_context_parallel(units[name], cpc, unit_plan)
    if hasattr(tr, "set_attention_backend"):
        try:
            tr.set_attention_backend("native")
        except Exception:  # noqa: BLE001 - models without diffusers attention
            pass


def _pipeline_entry_fits(pipe) -> bool:
    """cache-dit's pipeline-level entry matches registrations by class-name prefix: it fits where
    none matches or the matching one builds on this pipeline."""
    from ..adapter.build import cache_dit_adapter_builds, cache_dit_registered

    return cache_dit_registered(pipe) is None or cache_dit_adapter_builds(pipe)


def _apply_library_cp(pipe, card, spec, cp, cp_mesh, route, info: dict) -> None:
    """Context parallelism through cache-dit (with the plan's cache, if any); attention outside the
    split block lists stays local; cache decisions agreed across ranks."""
    import cache_dit

    from ..accel.dbcache import dbcache_config
    from ..cp.cache_sync import agree_cache_decisions
    from ..cp.plan import needs_ulysses_anything
    from ..cp.scope import limit_cp_to
    from ..cp.uneven import gather_around_none, gather_unevenly

    tr = pipe.transformer
    cache_cfg = dbcache_config(spec.options.get("cache")) if spec.cache else None
    target, info["cache_adapter"] = cache_target(pipe, card) if spec.cache else (pipe, None)
    if cp_mesh is None and target is pipe and _pipeline_entry_fits(pipe):
        from cache_dit import ParallelismConfig

        pc = ParallelismConfig(ulysses_size=spec.ulysses if spec.ulysses > 1 else None,
                               ring_size=spec.ring if spec.ring > 1 else None, cp_plan=cp.plan,
                               ulysses_anything=needs_ulysses_anything(cp))
        cache_dit.enable_cache(pipe, cache_config=cache_cfg, parallelism_config=pc)
    else:
        _enable_cp_on_mesh(tr, spec, cp, cache_cfg, target, cp_mesh, info)
    if needs_ulysses_anything(cp):  # uneven shares: cache-dit's gather needs NCCL; padded elsewhere (gloo)
        info["cp_uneven_gathers"] = gather_unevenly(tr)
    info["cp_gathers_around_none"] = gather_around_none(tr)  # a gather at a block returning (tensor, None)
    if spec.ring == 1:  # masks fitted to what each rank's Ulysses attention holds (heads, rows, keys)
        from ..cp.mask import install_mask_fit

        install_mask_fit()
    info["cp_local_attention"] = limit_cp_to(tr, cp.facts.get("block_lists"), route)
    if spec.cache:
        info["cache_agreement"] = agree_cache_decisions(pipe)


def _apply_graphs(pipe, card, spec, info: dict) -> None:
    """CUDA graphs of the transformer's steps (with a cache: of the computed steps' block work)."""
    if spec.graph:
        from ..accel.graphs import CudaGraphs, GraphsSettings

        info["graphs"] = CudaGraphs.apply(pipe, GraphsSettings(cache=spec.options.get("cache") if spec.cache else None,
                                                               steps=card.generation.steps))


def apply_plan(pipe, card, spec, *, cfg_style: str | None, cp_plan_file: str | None, attention_kind: str | None,
               gqa_path: str, out_dir: Path | None, heartbeat=None) -> dict:
    """Apply one plan to a freshly loaded pipeline on this rank; returns what was applied."""
    from ..accel.dbcache import dbcache_config
    from ..accel.gqa import GqaPath, GqaSettings
    from ..accel.cfg import apply_cfg_parallel, detect_cfg_style
    from ..accel.ring import Ring, apply_own_ring
    from ..cp.dryrun import verify_before_launch

    info: dict = {"plan": spec.name}
    tr = pipe.transformer
    routed = GqaPath.apply(pipe, GqaSettings(gqa_path))
    route = routed.state
    cfg_group, cp_mesh = _cfg_groups(tr, spec)
    if spec.cfg > 1:
        style = cfg_style or detect_cfg_style(pipe, card)
        info["cfg_style"] = style
        if style not in ("separate", "batched"):
            raise RuntimeError(f"plan {spec.name}: the pipeline shows CFG style '{style}' — no second branch")
    plan_args = {"attention_kind": attention_kind, "cp_plan_file": cp_plan_file, "out_dir": out_dir, "info": info}
    handles: dict = {}
    own_ring = Ring.own(spec)
    if own_ring:  # ditbook's ring: the CP plan's split/gather hooks, attention sent round the ring
        cp = _resolve_plan(pipe, card, spec, check=verify_before_launch, **plan_args)
        info["ring_modules"], recorder = apply_own_ring(tr, cp.plan, spec, noop=Ring.token in noop_kinds())
        handles[Ring.token] = Handle(recorder.remove, recorder.record)
    if spec.uses_cp and not own_ring:
        cp = _resolve_plan(pipe, card, spec, check=verify_before_launch, **plan_args)
        _apply_library_cp(pipe, card, spec, cp, cp_mesh, route, info)
    elif spec.cache:
        import cache_dit

        from ..accel.dbcache import cfg_from_adapter

        target, info["cache_adapter"] = cache_target(pipe, card)
        cache_dit.enable_cache(target, cache_config=cfg_from_adapter(dbcache_config(spec.options.get("cache")), target))
    if spec.compile:
        from ..accel.compile import CompileSettings, compile_settings

        info["compiled"] = compile_repeated_blocks(tr, (compile_settings(card.runtime.compile) or CompileSettings()).backend)
    _apply_graphs(pipe, card, spec, info)
    if spec.cfg > 1:
        info["cfg_stats"] = apply_cfg_parallel(tr, info["cfg_style"], group=cfg_group, heartbeat=heartbeat,
                                               cached=spec.cache)
    noop = noop_kinds()
    for technique in spec.kinds():  # the kinds each rank applies itself (tensor, VAE, text encoders), in order
        if technique.runs_on_rank(spec):
            handles[technique.token] = technique.apply_on_rank(pipe, card, spec, spec.degree(technique.token),
                                                               noop=technique.token in noop)
    info["kinds"] = handles  # token -> Handle: record() this rank's record, undo() the recorder off
    info["route"] = routed
    return info


def noop_kinds() -> set[str]:
    """``DITBOOK_PARALLEL_NOOP=tp,vae,te,ring`` (test fault injection): kinds recorded but not
    applied, which the per-rank record must then fail."""
    return {k for k in os.environ.get("DITBOOK_PARALLEL_NOOP", "").split(",") if k}


class CacheRefused(RuntimeError):
    """A +cache plan on a model with no cache adapter (neither cache-dit's nor ditbook's)."""


def cache_target(pipe, card):
    """(target, which) for ``cache_dit.enable_cache``: the pipeline where cache-dit's adapter builds
    on it, else ditbook's generated adapter as a ``BlockAdapter``."""
    from ..adapter.build import build_cache_adapter, cache_dit_adapter_builds

    if cache_dit_adapter_builds(pipe):
        return pipe, "cache-dit"
    from ..arch import inspect_pipeline

    report = inspect_pipeline(pipe, card)
    adapter = build_cache_adapter(pipe, report, card.name, prefer_registered=False)
    if not adapter.info.block_lists:
        raise CacheRefused(f"+cache: cache-dit has no adapter for {type(pipe).__name__} and the inspection found "
                           f"no block list for ditbook's own adapter to cache")
    return adapter.block_adapter(), f"ditbook ({adapter.info.module_name})"


def compile_repeated_blocks(tr, backend: str = "inductor") -> str:
    """Regional torch.compile of the repeated blocks, after the parallel hooks; the method used."""
    from ..accel.compile import compile_regions

    try:
        _, method, _ = compile_regions(tr, backend=backend)  # the blocks stay compiled for the process
    except ValueError as exc:
        raise RuntimeError(f"+compile: {exc}") from exc
    return method + ("" if backend == "inductor" else f" ({backend})")


def _init_group(card, args, local: int):
    """This rank's placement (its own GPU under CUDA) and the process group (nccl, else gloo)."""
    from ..loading import Placement, choose_placement

    placement = choose_placement(card)
    if placement.device.startswith("cuda"):
        torch.cuda.set_device(local)
        placement = Placement(f"cuda:{local}", placement.dtype)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    return placement, backend


def _checked_spec(name: str, card, world: int):
    """The plan named ``name`` with the card's cache settings; RuntimeError when it cannot run here."""
    from .plans import parse_plan, refusal

    spec = parse_plan(name)
    if refusal(spec):
        raise RuntimeError(f"plan {name}: {refusal(spec)}")
    if spec.cache and "cache" not in spec.options and card.parallel.cache:
        spec = type(spec)(**{**spec.__dict__, "options": {"cache": card.parallel.cache.options()}})
    if spec.cache and spec.graph:
        from ..accel.graphs import cache_graph_refusal

        why = cache_graph_refusal(spec.options.get("cache"), card.generation.steps)
        if why:
            raise RuntimeError(f"plan {name}: {why}")
    if spec.world_size not in (1, world):
        raise RuntimeError(f"plan {name} needs {spec.world_size} processes, this run has {world}")
    return spec


def _fresh_pipeline(card, placement, pristine):
    """(an untouched pipeline, the new ``pristine``): loaded once and copied per plan, or reloaded
    for models above REUSE_LIMIT parameters (``pristine`` then False)."""
    from ..loading import load_pipeline

    if pristine is None:
        pristine = load_pipeline(card, placement)
        if sum(p.numel() for p in pristine.transformer.parameters()) > REUSE_LIMIT:
            return pristine, False
    elif pristine is False:
        return load_pipeline(card, placement), False
    return _copied(pristine), pristine


def _copied(pipe):
    """A deep copy of ``pipe`` whose transformer's entry routes call the copy."""
    from ..loading import route_entries

    out = copy.deepcopy(pipe)
    route_entries(out.transformer)
    return out


def _finish_info(info: dict, pipe, spec) -> dict:
    """Make ``info`` JSON-ready after the renders (graphs removed); returns the kind recorders."""
    kinds = info.pop("kinds", {})
    info["attention"] = info.pop("route").record().to_dict()
    graphs = info.get("graphs")
    for k in ("cfg_stats", "cache_agreement"):
        if k in info:
            info[k] = info[k].to_dict()
    if graphs is not None:
        info["graphs"] = graphs.record().to_dict()
        graphs.undo()  # captured NCCL work goes before the communicator does
    if spec.cache:
        info["cached_steps"] = [int(s) for s in (getattr(pipe.transformer, "_cached_steps", None) or [])]
    return kinds


def _run_plan(pipe, card, spec, name: str, args, rank: int, dog: Watchdog, out_dir: Path, entry: dict) -> None:
    """Apply one plan, render every case, fill ``entry`` (times, what was applied, sharding, images)."""
    from ..render import render_all, save_renders
    from ..cp.sharding import BlockInputRecorder

    # installed before the plan's hooks, so it sees what each block gets after any split
    recorder = BlockInputRecorder(pipe.transformer)
    info = apply_plan(pipe, card, spec, cfg_style=args.cfg_style, cp_plan_file=args.cp_plan_file,
                      attention_kind=args.attention_kind, gqa_path=args.gqa_path,
                      out_dir=out_dir, heartbeat=dog.beat)
    recorder.reset()  # the plan's own traced call ran the blocks whole
    _fault_hook(pipe.transformer, rank, name)
    pipe.transformer.register_forward_pre_hook(lambda *a, **k: dog.beat(f"plan {name}: transformer call"))
    for _ in range(args.warmup):
        render_all(pipe, card, prompts=card.generation.prompts[:1], seeds=card.generation.seeds[:1])
        dog.beat()
    renders = render_all(pipe, card, progress=lambda *a: dog.beat())
    secs = [r.seconds for r in renders]
    entry.update({"seconds": secs, "median_seconds": statistics.median(secs)})
    kinds = _finish_info(info, pipe, spec)
    entry.update(info)
    entry["sharding"] = sharding_record(pipe.transformer, recorder, spec, info.get("cp_plan"),
                                        {k: h.record() for k, h in kinds.items()}).to_dict()
    recorder.remove()
    for h in kinds.values():
        h.undo()
    if rank == 0:
        entry["images"] = [r.to_dict() for r in save_renders(renders, out_dir / _folder(name))]


def run(args) -> int:
    """This rank's whole run: join the process group, then per plan a fresh pipeline, the plan
    applied, every case rendered; rank 0 writes ``worker.json``. A failing rank exits at once."""
    from ..card import load_card

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dog = Watchdog(args.timeout, rank)
    overrides = json.loads(args.overrides) if args.overrides else {}
    card = load_card(args.card, overrides)
    placement, backend = _init_group(card, args, local)
    out_dir = Path(args.out)
    results: dict = {"world_size": world, "backend": backend, "placement": placement.to_dict(), "plans": {}}
    torch.set_grad_enabled(False)
    pristine = None
    name = None
    try:
        for name in args.plans.split(","):
            if rank == 0:  # which plan runs now, and what finished: the launcher relaunches the rest
                write_progress(out_dir, results, name)
            spec = _checked_spec(name, card, world)
            dog.beat(f"plan {name}")
            entry: dict = {"world_size": spec.world_size}
            pipe, pristine = _fresh_pipeline(card, placement, pristine)
            _run_plan(pipe, card, spec, name, args, rank, dog, out_dir, entry)
            del pipe
            gc.collect()
            results["plans"][name] = entry
            dog.beat(f"barrier after {name}")
            dist.barrier()
    except BaseException as exc:
        sys.stderr.write(f"ditbook parallel: rank {rank} failed: {type(exc).__name__}: {exc}\n")
        traceback.print_exc()
        sys.stderr.flush()
        write_failure(out_dir, rank, name, exc)
        os._exit(1)  # no destroy_process_group: peers blocked in a collective are ended by torchrun
    if rank == 0:
        write_progress(out_dir, results, None)
        (out_dir / "worker.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    dist.destroy_process_group()
    return 0


PROGRESS_FILE = "worker.progress.json"  # rank 0: the plans finished so far and the one running
FAILURE_FILE = "worker.failed.rank{rank}.json"  # a rank that failed: its plan and its named error


def write_progress(out_dir: Path, results: dict, running: str | None) -> None:
    """Rank 0's record of the plans finished and the one running, for the launcher to relaunch the rest."""
    text = json.dumps({**results, "running": running}, indent=2, default=str) + "\n"
    tmp = out_dir / (PROGRESS_FILE + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out_dir / PROGRESS_FILE)


def write_failure(out_dir: Path, rank: int, plan: str | None, exc: BaseException) -> None:
    """A failing rank's plan, named error and time (the first rank to fail is the cause)."""
    try:
        (out_dir / FAILURE_FILE.format(rank=rank)).write_text(
            json.dumps({"rank": rank, "plan": plan, "error": f"{type(exc).__name__}: {exc}", "time": time.time()})
            + "\n")
    except Exception:  # noqa: BLE001 - the exit must happen whatever the disk says
        pass


def sharding_record(transformer, recorder, spec, cp_plan: dict | None, kinds: dict[str, object]) -> Sharding:
    """Every rank's block input lengths and sharded parameters, gathered; checked for a CP plan and
    for each kind recorded on the ranks (``error`` names the ``ShardingError``)."""
    from ..cp.sharding import ShardingError, check_sharding

    mine = RankSplit(recorder.to_dict(), [n for n, p in transformer.named_parameters()
                                          if type(p.data).__name__ == "DTensor"], kinds)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    out = Sharding(ranks, spec.cp, split_cfg=spec.cfg > 1)
    if spec.uses_cp:
        expected = cp_plan["facts"].get("sharding_expected", {}) if cp_plan else {}
        try:
            out.check = check_sharding([r.block_inputs for r in ranks], expected, spec.cp)
        except ShardingError as exc:
            out.error = f"ShardingError: {exc}"
    for token in kinds:
        try:
            out.kinds[token] = KindCheck(accel.by_token(token).check([r.kinds.get(token) for r in ranks],
                                                                     spec.degree(token)))
        except ShardingError as exc:
            out.kinds[token] = KindCheck(error=f"{type(exc).__name__}: {exc}")
    return out


def _folder(plan: str) -> str:
    return plan.replace("+", "_plus_")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ditbook.parallel.worker")
    p.add_argument("--card", required=True)
    p.add_argument("--plans", required=True, help="comma-separated plan names")
    p.add_argument("--out", required=True)
    p.add_argument("--overrides", default="", help="card overrides as JSON")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cfg-style", default=None)
    p.add_argument("--cp-plan-file", default=None)
    p.add_argument("--attention-kind", default=None)
    p.add_argument("--gqa-path", default="enable_gqa")
    args = p.parse_args(argv)
    from ..processes import watch_parent

    watch_parent()  # a rank never outlives torchrun (which dies with ditbook)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
