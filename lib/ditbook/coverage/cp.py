"""``coverage_cp``: does context parallel really work on a bare transformer? For the coverage
table: the registered or derived plan (``cp.plan.resolve_cp_plan``), checked before launch
(``cp.dryrun.verify_before_launch``; a caller's plan runs as given), is EXECUTED on 2 gloo
processes on the CPU (from a fork server where CUDA is present, ``start_method``) (file rendezvous, CP attention only inside the split block lists), each rank
recording what its blocks received; rank 0's output is compared with the one-process output.
All-zero parameters are filled first, so zero-initialised gates cannot make the parity vacuous.

Outcome: ``correct`` (every main block list got ``S / degree`` tokens on every rank and the output
matches), ``refused`` (no plan, or it fails the checks before launch), ``wrong`` (it ran but did
not split, or the output differs), ``crash`` (a rank raised or did not finish: each rank's own
error first, a peer's lost connection last).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import shutil
import tempfile
import traceback

import torch

from ..cp.plan import _main_output


# what a rank says when its peer went away: never the cause, when the peer reported one
_LOST_PEER = re.compile(r"Connection reset|Connection closed|Broken pipe|pair\.cc|DistNetworkError", re.I)


def _output(out) -> torch.Tensor:
    """The first tensor of the output (a list of per-sample outputs: the first sample's)."""
    got = _main_output(out)
    if got is None:
        raise TypeError(f"the transformer's output ({type(out).__name__}) holds no tensor to compare")
    return got


def _failed(outcome: str, reason: str, **extra) -> dict:
    """The result of a run that produced no sharding record."""
    return {"outcome": outcome, "reason": reason, "seq_lens": None, "source": None, **extra}


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc`` as ``file:line``, to name where a rank failed."""
    tb = traceback.extract_tb(exc.__traceback__)
    return f"{tb[-1].filename.split('site-packages/')[-1].split('lib/')[-1]}:{tb[-1].lineno}" if tb else ""


def _received(transformer, world: int, replan: bool):
    """The rank's transformer: bytes when spawned (the instance as it was before any planner touched
    it: a planner's patches, local functions on the instance, do not survive pickling), then, with
    ``replan``, patched by the registered planner here (its instance and classes)."""
    if not isinstance(transformer, bytes):
        return transformer
    transformer = pickle.loads(transformer)  # noqa: S301 - our own bytes, from the parent
    if replan:
        from ..cp.plan import registered_cp_plan

        registered_cp_plan(transformer, world)
    return transformer


def _rank(rank, world, init_file, transformer, args, kwargs, plan, queue, scope=None, uneven=False,
          replan=False) -> None:
    reported = False
    try:
        transformer = _received(transformer, world, replan)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from ..cp.attention import route_attention
        from ..cp.scope import limit_cp_to
        from ..cp.sharding import BlockInputRecorder

        torch.set_num_threads(1)
        # a file rendezvous: no TCP port to pick, so no race with other processes for it
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from cache_dit.attention import _maybe_register_custom_attn_backends
        from cache_dit.distributed.core import _ContextParallelConfig, _enable_context_parallelism

        _maybe_register_custom_attn_backends()
        from ..cp.mask import install_mask_fit

        install_mask_fit()  # masks fitted to what each rank's Ulysses attention holds
        route = route_attention(transformer)
        recorder = BlockInputRecorder(transformer)  # before the plan's hooks: sees the split inputs
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
        cpc = _ContextParallelConfig(ulysses_degree=world, ring_degree=1, ulysses_anything=uneven)
        cpc.setup(rank, world, torch.device("cpu"), mesh=mesh)
        _enable_context_parallelism(transformer, config=cpc, cp_plan=plan)
        if hasattr(transformer, "set_attention_backend"):
            try:
                transformer.set_attention_backend("native")
            except Exception:  # noqa: BLE001 - models without diffusers attention
                pass
        limit_cp_to(transformer, scope, route)  # attention outside the split lists stays local
        from ..cp.uneven import gather_around_none

        gather_around_none(transformer)  # a gather at a block returning (tensor, None)
        if uneven:  # unequal shares: cache-dit's gather is NCCL's; on gloo, padded inside the collective
            from ..cp.uneven import gather_unevenly

            gather_unevenly(transformer)
        with torch.no_grad():
            out = _output(transformer(*args, **kwargs))
        queue.put((rank, "ok", recorder.to_dict(), out.detach().float().numpy().copy() if rank == 0 else None))
        reported = True
        dist.barrier()  # no rank tears the group down while a peer still talks to it
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        if not reported:
            queue.put((rank, "error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                                      f"({_where(exc)})", traceback.format_exc()[-2000:]))


def start_method() -> str:
    """How the probe starts its processes: ``forkserver`` where CUDA is present (a process forked after
    CUDA was initialised cannot use it: "Cannot re-initialize CUDA in forked subprocess"; the server
    starts clean, imports torch, diffusers and cache-dit once and forks each process from there:
    half of ``spawn``'s time, which re-imports them in every process), else ``fork`` (no re-import).
    ``DITBOOK_START_METHOD`` overrides."""
    method = os.environ.get("DITBOOK_START_METHOD") or ("forkserver" if torch.cuda.is_available() else "fork")
    if method == "forkserver":  # the server imports these once; each process forks from it
        mp.set_forkserver_preload(["torch", "diffusers", "cache_dit", "ditbook.coverage.cp"])
    return method


def _context():
    """The multiprocessing context of ``start_method``. A fork server is started with no GPU visible:
    the probe runs on the CPU, and a process forked from a server whose imports initialised CUDA
    cannot use CUDA at all: a model whose forward asks CUDA anything (torch.compile inside it does)
    then fails with "Cannot re-initialize CUDA in forked subprocess" (AnyFlowFARTransformer3DModel on
    an H100 host). The caller's own environment is as it was afterwards."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            forkserver.ensure_running()  # the server takes this environment; a running one is kept
        finally:
            if before is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
    return ctx


def execute_cp_plan(transformer, args, kwargs, plan: dict, expected: dict, degree: int = 2,
                    timeout: float = 120.0, reference: torch.Tensor | None = None, uneven: bool = False,
                    pristine: bytes | None = None, replan: bool = False) -> dict:
    """Run ``plan`` on ``degree`` gloo ranks (``start_method``); judge the split and the output.
    ``uneven``: the plan splits a token count the degree does not divide (``ulysses_anything``).
    ``pristine``/``replan``: what spawned ranks get, ``_received``; forked ranks share the instance."""
    from ..cp.sharding import ShardingError, check_sharding

    if reference is None:
        with torch.no_grad():
            reference = _output(transformer(*args, **kwargs)).detach().float().clone()
    ctx = _context()
    queue, folder = ctx.Queue(), tempfile.mkdtemp(prefix="ditbook-cp-")
    init_file = os.path.join(folder, "rendezvous")
    scope = list(expected)  # CP attention only inside the lists whose tokens are split
    sent = transformer if pristine is None else pristine  # the caller pickles it only where ranks are not forked
    procs = [ctx.Process(target=_rank, args=(r, degree, init_file, sent, args, kwargs, plan, queue, scope, uneven,
                                             replan and pristine is not None), daemon=True) for r in range(degree)]
    for p in procs:
        p.start()
    got = {}
    try:
        for i in range(degree):
            # after a first error the peers fail soon (their collective loses its partner)
            rank, status, a, b = queue.get(timeout=timeout if not any(s == "error" for s, _, _ in got.values())
                                           else 15)
            got[rank] = (status, a, b)
    except Exception:  # noqa: BLE001 - queue.Empty: a rank hung or died
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(folder, ignore_errors=True)
    # the cause first: a rank's own error before a peer's lost connection; a rank that died
    # without a word is named with its exit code
    errors = sorted((f"rank {r}: {a}" for r, (s, a, _) in got.items() if s == "error"),
                    key=lambda e: (_LOST_PEER.search(e) is not None, e))
    errors += [f"rank {r} ended with exit code {p.exitcode} without a report" for r, p in enumerate(procs)
               if r not in got and p.exitcode not in (0, None)]
    if errors or len(got) < degree:
        return {"outcome": "crash", "reason": "; ".join(errors) or f"a rank did not finish within {timeout:.0f}s",
                "seq_lens": None}
    ranks = [got[r][1] for r in range(degree)]
    seq = {name: [rec.get(name, {}).get("seq_lens") for rec in ranks] for name in expected}
    try:
        check_sharding(ranks, expected, degree)
    except ShardingError as exc:
        return {"outcome": "wrong", "reason": f"ShardingError: {exc}", "seq_lens": seq}
    out = torch.from_numpy(got[0][2])
    if out.shape != reference.shape:
        return {"outcome": "wrong", "reason": f"output shape {list(out.shape)} != {list(reference.shape)}",
                "seq_lens": seq}
    err = (out - reference).abs().max().item() / max(reference.abs().max().item(), 1e-6)
    if not torch.isfinite(out).all() or err > 1e-3:
        return {"outcome": "wrong", "reason": f"output differs from one process: max rel. error {err:.2e}",
                "seq_lens": seq}
    return {"outcome": "correct", "reason": f"split verified, max rel. error {err:.1e}", "seq_lens": seq}


def coverage_cp(transformer, args, kwargs, degree: int = 2, plan: dict | None = None,
                timeout: float = 120.0) -> dict:
    """Like ``_coverage_cp`` (below), run in a process of its own (``start_method``): registered
    planners may patch library classes process-wide (cache-dit's PixArt planner patches diffusers'
    ``AttnProcessor2_0.__call__``), which must not leak into the caller's next model."""
    ctx = _context()
    queue = ctx.Queue()
    # not forked: the instance travels as plain pickle bytes. multiprocessing's own pickler would pass
    # every tensor's storage as a file descriptor of its own, and a model of more than ~250 tensors
    # overflows one message ("too many fds"; OSError: Invalid argument, and the fork server died)
    sent = transformer if ctx.get_start_method() == "fork" else (_pickled(transformer) or transformer)
    proc = ctx.Process(target=_drive, args=(queue, sent, args, kwargs, degree, plan, timeout))
    proc.start()
    try:
        result = queue.get(timeout=timeout * 2 + 60)
    except Exception:  # noqa: BLE001 - queue.Empty
        result = _failed("crash", f"no result within {timeout * 2 + 60:.0f}s")
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return result


def _drive(queue, transformer, args, kwargs, degree, plan, timeout) -> None:
    try:
        torch.set_num_threads(1)  # an OpenMP pool inherited through fork must not be used
        transformer = _received(transformer, 0, replan=False)
        queue.put(_coverage_cp(transformer, args, kwargs, degree, plan, timeout))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(_failed("crash", f"{type(exc).__name__}: {exc}"))


def _coverage_cp(transformer, args, kwargs, degree: int = 2, plan: dict | None = None,
                 timeout: float = 120.0) -> dict:
    """Derive or look up the CP plan of ``transformer`` for ``(args, kwargs)`` (or check the given
    ``plan``'s sites) and execute it on ``degree`` gloo ranks: dict(outcome, reason, seq_lens, source)."""
    from ..cp.dryrun import verify_before_launch
    from ..cp.plan import (PlanDerivationError, RegisteredPlanError, check_plan_sites, expected_lengths, find_streams,
                           needs_ulysses_anything, resolve_cp_plan, trace_forward)

    filled = fill_zero_parameters(transformer)  # this is the driver's copy
    pristine = _pickled(transformer) if start_method() != "fork" else None  # before any planner patches it
    try:
        with torch.no_grad():  # before any planner touches the model
            reference = _output(transformer(*args, **kwargs)).detach().float().clone()
    except Exception as exc:  # noqa: BLE001
        return _failed("crash", f"the one-process forward failed: {type(exc).__name__}: {exc}")
    try:
        if plan is None:
            cp = resolve_cp_plan(transformer, capture=lambda: (args, kwargs), degree=degree,
                                 check=verify_before_launch, uneven=True)
            plan, source, expected = cp.plan, cp.source, cp.facts["sharding_expected"]
            uneven = needs_ulysses_anything(cp)
        else:
            tr = trace_forward(transformer, args, kwargs)
            st = find_streams(tr)
            check_plan_sites(plan, tr, st)
            source, expected, uneven = "given", expected_lengths(tr, st), False
    except (PlanDerivationError, RegisteredPlanError) as exc:
        return _failed("refused", f"{type(exc).__name__}: {exc}", filled_zero_parameters=len(filled))
    except Exception as exc:  # noqa: BLE001 - a crash of the derivation is a crash row
        return _failed("crash", f"{type(exc).__name__}: {exc}")
    result = execute_cp_plan(transformer, args, kwargs, plan, expected, degree, timeout, reference, uneven=uneven,
                             pristine=pristine, replan=str(source).startswith("cache-dit:"))
    result["source"] = source
    result["filled_zero_parameters"] = len(filled)
    return result


def _pickled(transformer) -> bytes | None:
    """The instance as bytes, or None where it does not pickle (the ranks then get it as it is)."""
    try:
        return pickle.dumps(transformer)
    except Exception:  # noqa: BLE001 - an unpicklable model: sending it fails with its own reason
        return None


def fill_zero_parameters(transformer, scale: float = 0.1) -> list[str]:
    """Give every all-zero parameter small seeded random values, so that zero-initialised gates
    cannot make the one-process/CP parity pass whatever the plan does; returns the names filled."""
    g = torch.Generator().manual_seed(0)
    filled = []
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if p.numel() and p.is_floating_point() and not p.any():
                p.copy_((torch.randn(p.shape, generator=g) * scale).to(p))
                filled.append(name)
    return filled
