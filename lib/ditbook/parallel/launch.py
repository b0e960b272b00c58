"""Launching plans under torchrun and judging them against the single-process baseline.

``launch`` runs ``ditbook.parallel.worker`` under torchrun in its own process group and kills the
group after ``total_timeout``; ``run_plans`` launches the baseline and the plans together and
returns one ``records.PlanRow`` per plan, judged with the card's gates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..processes import LAUNCHER_ENV, die_with_parent
from ..quality import Gates, compare_sets
from ..records import PlanRow, Sharding, decode
from .plans import parse_plan, refusal


class ParallelRunError(RuntimeError):
    """A parallel run failed or timed out; ``log`` holds the tail of its output."""

    def __init__(self, message: str, log: str = "", returncode: int | None = None):
        super().__init__(message)
        self.log = log
        self.returncode = returncode


@dataclass
class LaunchResult:
    out_dir: Path
    nproc: int
    seconds: float  # wall time of the whole launch
    worker: dict  # rank 0's worker.json
    command: list[str]
    attempts: list = field(default_factory=list)  # every launch: plans, the plan that failed in the ranks, its error

    def images(self, plan: str) -> dict[str, np.ndarray]:
        rows = self.worker["plans"][plan].get("images", [])
        return {r["key"]: np.load(self.out_dir / r["npy"]) for r in rows}

    def sharding(self, plan: str) -> Sharding | None:
        """The split the worker recorded for ``plan`` (None: the plan did not run or recorded none)."""
        rec = self.worker["plans"].get(plan, {}).get("sharding")
        return None if rec is None else decode(Sharding, rec, f"worker.json plans.{plan}.sharding")


@dataclass
class Nodes:
    """Where the ranks run: one host (standalone rendezvous), or ``count`` hosts each given its
    ``node_rank`` and node 0's ``host:port`` (node 0 holds global rank 0 and ``worker.json``)."""

    count: int = 1
    node_rank: int = 0
    master: str | None = None  # "host:port" of node 0

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.node_rank < self.count:
            raise ValueError(f"node rank {self.node_rank} is not in 0..{self.count - 1}")
        if self.count > 1 and (not self.master or ":" not in self.master):
            raise ValueError("several nodes need --master HOST:PORT (the address of node 0)")

    def torchrun_args(self) -> list[str]:
        if self.count == 1:
            return ["--standalone", "--nnodes", "1"]
        host, port = self.master.rsplit(":", 1)
        return ["--nnodes", str(self.count), "--node_rank", str(self.node_rank), "--master_addr", host,
                "--master_port", port]


TORCHRUN_LOGS = "torchrun-logs"  # torchrun's per-rank log files, inside the launch folder and removed after it


def torchrun_command(card: str | Path, plans: list[str], nproc: int, out_dir: Path, *, overrides: dict | None = None,
                     timeout: float = 300.0, warmup: int = 1, cfg_style: str | None = None,
                     cp_plan_file: str | None = None, attention_kind: str | None = None,
                     gqa_path: str = "enable_gqa", nodes: "Nodes | None" = None) -> list[str]:
    nodes = nodes or Nodes()
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(),
           "--nproc_per_node", str(nproc), "--max_restarts", "0", "--monitor_interval", "0.5",
           "--log-dir", str(out_dir / TORCHRUN_LOGS),  # not a torchelastic_* folder in /tmp per launch
           "--tee", "3",  # each rank's lines prefixed [default<local_rank>]: so a failure quotes its own rank
           "-m", "ditbook.parallel.worker", "--card", str(card), "--plans", ",".join(plans),
           "--out", str(out_dir), "--timeout", str(timeout), "--warmup", str(warmup), "--gqa-path", gqa_path]
    if overrides:
        cmd += ["--overrides", json.dumps(overrides)]
    if cfg_style:
        cmd += ["--cfg-style", cfg_style]
    if cp_plan_file:
        cmd += ["--cp-plan-file", str(cp_plan_file)]
    if attention_kind:
        cmd += ["--attention-kind", attention_kind]
    return cmd


_BLOCK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
_TQDM_RE = re.compile(r"\d+%\|")  # progress bars say nothing about a failure
_PREFIX_RE = re.compile(r"^\[[A-Za-z_]*(\d+)\]:(.*)$")  # torchrun --tee: "[default1]:text"


def _rank_lines(log: str, local_rank: int | None, last: int = 6) -> list[str]:
    """The last lines one local rank wrote (torchrun prefixes them with ``[default<local_rank>]:``)."""
    if local_rank is None:
        return []
    lines = []
    for line in log.splitlines():
        m = _PREFIX_RE.match(line)
        text = m.group(2).rstrip() if m else ""
        if m and int(m.group(1)) == local_rank and text.strip() and not _TQDM_RE.search(text):
            lines.append(text)
    return lines[-last:]


def _failure_message(log: str, rc: int | None) -> str:
    """Name the rank that caused the failure, with its last lines of output: a rank killed by a
    signal other than SIGTERM (torchrun's stop) first, then torchrun's "Root Cause", then any
    other rank that exited non-zero."""
    blocks: dict[str, tuple[int, int | None]] = {}  # global rank -> (exit code, local rank)
    for rank, local, code in _BLOCK_RE.findall(log):
        blocks.setdefault(rank, (int(code), int(local) if local else None))
    root = None
    if "Root Cause" in log:
        m = _BLOCK_RE.search(log, log.index("Root Cause"))
        root = m.group(1) if m else None
    sigterm = -int(signal.SIGTERM)
    stopped = [r for r, (code, _) in blocks.items() if code == sigterm]
    killed = [r for r, (code, _) in blocks.items() if code < 0 and code != sigterm]
    failed = [r for r, (code, _) in blocks.items() if code > 0]
    causes = list(dict.fromkeys(killed + ([root] if root in failed else []) + failed))
    worker_lines = re.findall(r"ditbook parallel: (rank (\d+) .*)", log)
    parts = []
    for r in causes:
        code, local = blocks[r]
        head = f"rank {r} ended (killed by signal {-code})" if code < 0 else f"rank {r} failed (exit code {code})"
        said = list(dict.fromkeys(text for text, who in worker_lines if who == r))
        tail = [ln for ln in _rank_lines(log, local) if not any(t in ln for t in said)]
        parts.append(head + ("".join(f"\n    {t}" for t in said)) + ("".join(f"\n    | {t}" for t in tail)))
    if not blocks:  # no torchrun summary: the worker's own lines, or the exit code
        said = list(dict.fromkeys(text for text, _ in worker_lines))
        return "; ".join(said) if said else f"torchrun exited with code {rc}"
    if not causes:
        return (f"every rank was stopped by SIGTERM ({', '.join(stopped)}) — the run was interrupted or "
                f"timed out, no rank failed by itself")
    msg = "\n  ".join(parts)
    if stopped:
        msg += f"\n  (rank{'s' if len(stopped) > 1 else ''} {', '.join(stopped)} stopped by torchrun after that)"
    return msg


class PlanRefused(ValueError):
    """A plan ditbook does not run (``plans.refusal`` says why); nothing was launched."""


def launch(card: str | Path, plans: list[str], nproc: int, out_dir: str | Path, *, overrides: dict | None = None,
           timeout: float = 300.0, total_timeout: float | None = None, env: dict | None = None, **worker_opts) -> LaunchResult:
    """Run plans (all of world size 1 or ``nproc``) in one torchrun; raise ``ParallelRunError`` on failure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nodes = worker_opts.get("nodes") or Nodes()
    world = nproc * nodes.count
    for p in plans:
        if refusal(parse_plan(p)):
            raise PlanRefused(f"plan {p}: {refusal(parse_plan(p))}")
        ws = parse_plan(p).world_size
        if ws not in (1, world):
            raise ParallelRunError(f"plan {p} needs {ws} processes; this launch has {world} "
                                   f"({nodes.count} node(s) x --nproc {nproc})")
    cmd = torchrun_command(card, plans, nproc, out_dir, overrides=overrides, timeout=timeout, **worker_opts)
    total_timeout = total_timeout or max(600.0, 4 * timeout)
    log_path = out_dir / "launch.log"
    full_env = {**os.environ, **(env or {})}
    src = str(Path(__file__).resolve().parents[2])  # lib/, so ranks import this ditbook
    full_env["PYTHONPATH"] = src + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env[LAUNCHER_ENV] = str(os.getpid())  # each rank ends when this process is gone
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # torchrun gets SIGTERM when this process dies, even by SIGKILL; its ranks watch torchrun
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                preexec_fn=die_with_parent())
        try:
            rc = proc.wait(timeout=total_timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            text = log_path.read_text(errors="replace")
            raise ParallelRunError(f"parallel run of {plans} did not finish within {total_timeout:.0f}s; "
                                   f"all ranks were ended", text[-4000:], None) from None
        except BaseException:  # Ctrl-C / SIGTERM on the caller: torchrun's own session is not told
            _kill_group(proc)
            raise
        finally:
            shutil.rmtree(out_dir / TORCHRUN_LOGS, ignore_errors=True)
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    if rc != 0:
        err = ParallelRunError(f"parallel run of {plans} failed after {seconds:.1f}s: {_failure_message(text, rc)} "
                               f"(log: {log_path})", text[-4000:], rc)
        err.seconds = seconds
        raise err
    if nodes.node_rank != 0:  # images, times and worker.json live with global rank 0, on node 0
        return LaunchResult(out_dir, nproc, seconds, {}, cmd)
    worker = json.loads((out_dir / "worker.json").read_text())
    return LaunchResult(out_dir, nproc, seconds, worker, cmd)


def _kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End torchrun's process group (and ranks that left it) — SIGTERM, then SIGKILL after ``grace``."""
    try:
        from ..processes import descendants

        ranks = descendants(proc.pid)
    except Exception:  # no psutil or torchrun already gone: the group signal alone
        ranks = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    if ranks:
        from ..processes import end_processes

        end_processes([r for r in ranks if r.is_running()], grace=grace)


def judge(result: LaunchResult, plans: list[str], gates: Gates | None = None,
          cache_gates: Gates | None = None) -> list[PlanRow]:
    """Compare each plan with its single-process reference from the same launch (``gates``); a
    +cache plan also with the uncached baseline (``cache_gates``). None: the settings' defaults."""
    from ..settings import CacheSettings, ParallelSettings

    gates = gates or ParallelSettings().gates
    cache_gates = cache_gates or CacheSettings().gates
    out = []
    base = result.images("single") if "single" in result.worker["plans"] else None
    base_s = result.worker["plans"].get("single", {}).get("median_seconds")
    for name in plans:
        spec = parse_plan(name)
        if spec.world_size == 1:
            continue
        ref_name = "single+cache" if spec.cache else "single"
        entry = result.worker["plans"][name]
        ref = result.images(ref_name)
        q = compare_sets(result.images(name), ref, gates)
        ref_s = result.worker["plans"][ref_name].get("median_seconds")
        s = entry.get("median_seconds")
        details = {k: v for k, v in entry.items() if k not in ("images", "seconds", "median_seconds", "world_size")}
        details["reference_seconds"] = ref_s
        details["baseline_seconds"] = base_s
        bq = compare_sets(result.images(name), base, cache_gates) if spec.cache and base is not None else None
        sharding, ref_sharding = result.sharding(name), result.sharding(ref_name)
        sharding_problem = sharding_failure(spec, sharding) or cfg_split_failure(spec, sharding, ref_sharding) \
            or cache_skip_failure(spec, entry)
        if sharding is not None:
            details["sharding"] = sharding
        if sharding_problem:  # parity cannot see a plan that splits nothing: this can
            q.reasons = [*q.reasons, sharding_problem]
        elif not q.passed:  # the plan ran and its output is not the reference's: a named error too
            sharding_problem = f"ParityError: against {ref_name}: " + "; ".join(
                (q.reasons or ["the quality gates failed"])[:2])
        out.append(PlanRow(name=name, world_size=spec.world_size, passed=q.passed and not sharding_problem,
                              quality=q, seconds=s, speedup=(ref_s / s) if ref_s and s else None, reference=ref_name,
                              baseline_quality=bq, details=details, error=sharding_problem,
                              gates={"quality": gates.to_dict(), "baseline_quality": cache_gates.to_dict()}))
    return out


def cache_skip_failure(spec, entry: dict) -> str | None:
    """Why a ``+cache`` plan's record shows its cache skipped nothing (no cached step, no skip agreed
    across the ranks); None when it skipped, and for plans without a cache."""
    if not spec.cache:
        return None
    steps = entry.get("cached_steps")
    skips = entry.get("cache_agreement", {}).get("skips", 0)
    if steps or skips:
        return None
    return (f"CacheSkippedNothing: the cache of {spec.name} skipped no step (cached_steps "
            f"{steps if steps is not None else 'not recorded'}, {skips} skips agreed across the ranks): it is the "
            f"plan without the cache under another name; raise parallel.cache's residual_diff_threshold or drop +cache")


def sharding_failure(spec, sharding: Sharding | None) -> str | None:
    """Why the plan's records show it did not split (None when they show it did; a CP plan without a
    record fails). Each kind that ``records`` on the ranks is judged by its own record."""
    for technique in spec.kinds():
        if not technique.records(spec):
            continue
        rec = sharding.kinds.get(technique.token) if sharding is not None else None
        if rec is None:
            return f"ShardingError: the run recorded nothing of {technique.family}, so its split is unproven"
        if rec.error or not rec.check:
            return rec.error or f"ShardingError: {technique.family} was not checked"
    if not spec.uses_cp:
        return None
    if sharding is None:
        return "ShardingError: the run recorded no block input lengths, so the split is unproven"
    if sharding.error:
        return sharding.error
    if not sharding.check:
        return "ShardingError: the block input lengths were not checked"
    return None


def cfg_split_failure(spec, sharding: Sharding | None, reference: Sharding | None) -> str | None:
    """Why the block rows show a CFG-parallel plan's ranks did not divide the branches (None when
    they did, or without CFG parallelism); the record goes into ``sharding.cfg_check``."""
    from ..cp.sharding import CfgSplitError, check_cfg_split

    if spec.cfg <= 1:
        return None
    if sharding is None or reference is None or not reference.ranks:
        return "CfgSplitError: the run recorded no block rows (plan or one-process reference), so the split is unproven"
    try:
        sharding.cfg_check = check_cfg_split([r.block_inputs for r in sharding.ranks],
                                             reference.ranks[0].block_inputs, spec.cfg)
    except CfgSplitError as exc:
        sharding.cfg_check = None
        return f"CfgSplitError: {exc}"
    return None


def ranks_present(device: str | None) -> int | None:
    """Ranks with a device of their own: ``$DITBOOK_GPUS``, else the CUDA devices; None on the CPU."""
    env = os.environ.get("DITBOOK_GPUS", "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(f"DITBOOK_GPUS={env!r} is not a whole number of GPUs") from None
    if device is None or not str(device).startswith("cuda"):
        return None
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_plans(card: str | Path, plans: list[str], nproc: int, out_dir: str | Path, *, gates: Gates | None = None,
              cache_gates: Gates | None = None, **launch_opts) -> tuple[list[PlanRow], LaunchResult]:
    """Launch the baseline(s) and ``plans`` together and judge each plan against its baseline, with
    the card's gates unless given. ``PlanRow.seconds``: median seconds per image after warm-up."""
    from ..card import load_card

    graphed = [p for p in plans if parse_plan(p).graph]
    cached_graphs = [p for p in graphed if parse_plan(p).cache]
    if cached_graphs:  # +cache+graph: only a static cache schedule has a fixed call pattern
        from ..accel.graphs import cache_graph_refusal

        c = load_card(card, launch_opts.get("overrides"))
        reason = cache_graph_refusal(c.parallel.cache.options() if c.parallel.cache else None, c.generation.steps)
        if reason:
            raise PlanRefused(f"plans {', '.join(cached_graphs)}: {reason}")
    if graphed and not _cuda_available():
        raise ValueError(f"plans {', '.join(graphed)} replay CUDA graphs and this machine has no CUDA GPU; "
                         "run them on a GPU host or drop +graph")
    if gates is None or cache_gates is None:
        c = load_card(card, launch_opts.get("overrides"))
        gates, cache_gates = gates or c.parallel.gates, cache_gates or c.cache.gates
    judged, result = launch_each_plan(card, plans, nproc, out_dir, gates, cache_gates, **launch_opts)
    order = {p: i for i, p in enumerate(plans)}
    return sorted(judged, key=lambda r: order.get(r.name, len(order))), result


def _refs(plans: list[str]) -> list[str]:
    return ["single"] + (["single+cache"] if any(parse_plan(p).cache for p in plans) else [])


def launch_each_plan(card, plans: list[str], nproc: int, out_dir: str | Path, gates: Gates, cache_gates: Gates,
                     **launch_opts) -> tuple[list[PlanRow], LaunchResult]:
    """Launch the references and ``plans`` in one torchrun. When a plan fails in the ranks, the
    finished plans are judged from rank 0's progress record, the failed one recorded with its
    named error, and the rest relaunched with their references; a reference failing raises."""
    out_dir = Path(out_dir)
    judged: list[PlanRow] = []
    attempts: list[dict] = []
    remaining = [p for p in plans if p not in _refs(plans)]
    total = 0.0
    while True:
        refs = _refs(remaining)
        todo = refs + remaining
        _clear_progress(out_dir)
        try:
            result = launch(card, todo, nproc, out_dir, **launch_opts)
        except ParallelRunError as exc:
            failed, partial = _failed_plan(out_dir, refs, todo)
            if failed is None:
                raise
            kept = _keep_log(out_dir, len(attempts))
            error = _rank_error(out_dir, failed) or f"ParallelRunError: {exc}".replace(
                str(out_dir / "launch.log"), str(kept))
            attempts.append({"plans": todo, "failed": failed, "error": error})
            done = [p for p in remaining if p in partial.worker["plans"]]
            judged += judge(partial, done, gates, cache_gates) + [failed_plan(failed, error, gates, cache_gates)]
            remaining = [p for p in remaining if p not in done and p != failed]
            total += exc_seconds(exc)
            if not remaining:
                partial.attempts, partial.seconds = attempts, total
                return judged, partial
            continue
        attempts.append({"plans": todo, "failed": None, "error": None})
        result.attempts, result.seconds = attempts, total + result.seconds
        if not result.worker:  # a node other than node 0: its ranks ran, node 0 judges
            return judged, result
        return judged + judge(result, remaining, gates, cache_gates), result


def exc_seconds(exc: ParallelRunError) -> float:
    return float(getattr(exc, "seconds", 0.0) or 0.0)


def failed_plan(name: str, error: str, gates: Gates, cache_gates: Gates) -> PlanRow:
    """The record of a plan that failed in the ranks: not passed, its named error, no figures."""
    spec = parse_plan(name)
    return PlanRow(name=name, world_size=spec.world_size, passed=False, quality=None, seconds=None, speedup=None,
                   reference="single+cache" if spec.cache else "single", details={"failed_in_ranks": True},
                   error=error, gates={"quality": gates.to_dict(), "baseline_quality": cache_gates.to_dict()})


def _clear_progress(out_dir: Path) -> None:
    from .worker import PROGRESS_FILE

    for f in [out_dir / PROGRESS_FILE, *out_dir.glob("worker.failed.rank*.json")]:
        f.unlink(missing_ok=True)


def _failed_plan(out_dir: Path, refs: list[str], todo: list[str]) -> tuple[str | None, LaunchResult | None]:
    """(the plan that was running when the launch failed, the launch's finished plans) from rank
    0's progress record; (None, None) when no plan other than a reference can be blamed."""
    from .worker import PROGRESS_FILE

    path = out_dir / PROGRESS_FILE
    if not path.is_file():
        return None, None
    try:
        worker = json.loads(path.read_text())
    except ValueError:
        return None, None
    running = worker.pop("running", None)
    if running is None or running in refs or running not in todo or any(r not in worker["plans"] for r in refs):
        return None, None
    return running, LaunchResult(out_dir, worker.get("world_size") or 0, 0.0, worker, [])


def _rank_error(out_dir: Path, plan: str) -> str | None:
    """The named error the first rank to fail recorded for ``plan`` (its peers fail after it), or None."""
    recs = []
    for f in out_dir.glob("worker.failed.rank*.json"):
        try:
            recs.append(json.loads(f.read_text()))
        except ValueError:
            continue
    recs = sorted((r for r in recs if r.get("plan") == plan and r.get("error")),
                  key=lambda r: (r.get("time") or 0.0, r.get("rank") or 0))
    return f"{recs[0]['error']} (rank {recs[0].get('rank')})" if recs else None


def _keep_log(out_dir: Path, attempt: int) -> Path:
    """The failed launch's log moved aside (``launch.<n>.log``), before the next launch writes its own."""
    log, kept = out_dir / "launch.log", out_dir / f"launch.{attempt + 1}.log"
    if log.is_file():
        log.replace(kept)
    return kept
