"""``ditbook parallel CARD --plan NAME --nproc N``: run plans under torchrun and print parity.

A plan the feasibility table rules out (given ``--arch inspect/arch.json`` or ``--run RUN_DIR``)
is reported with its reason and not launched (exit 3). A failing or stuck rank ends the run
with exit 1 and the rank's error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def refusal(card_path: str, plans: list[str], arch: str | None, overrides: dict) -> list[str]:
    """Reasons against these plans: ditbook's own refusals (``plans.refusal``), then the
    feasibility table's (when a report is given)."""
    from ..parallel.plans import PlanNameError, parse_plan as _parse, refusal as plan_refusal

    refused = []
    for p in plans:
        try:
            if plan_refusal(_parse(p)):
                refused.append(f"{p}: not run — {plan_refusal(_parse(p))}")
        except PlanNameError as exc:
            refused.append(str(exc))
    if refused or not arch:
        return refused
    from ..arch.report import ArchReport
    from ..card import load_card
    from ..parallel.feasibility import WORLD_SIZES, feasibility
    from ..parallel.plans import parse_plan, refusal

    sizes = sorted(set(WORLD_SIZES) | {parse_plan(p).world_size for p in plans})  # ring3 is judged too
    table = feasibility(ArchReport.load(arch), load_card(card_path, overrides), world_sizes=sizes)
    out = []
    for p in plans:
        spec = parse_plan(p)
        if spec.world_size == 1:
            continue
        row = table.check(p)
        if row is None:
            kind = ("cfg_x_ulysses" if spec.cfg > 1 and spec.uses_cp else "cfg" if spec.cfg > 1 else
                    "ulysses_x_ring" if spec.ulysses > 1 and spec.ring > 1 else "ulysses" if spec.ulysses > 1
                    else "ring" if spec.ring > 1 else "tp")
            try:
                row = table.get(kind, spec.world_size)
            except KeyError:
                out.append(f"{p}: world size {spec.world_size} is not in the feasibility table")
                continue
        if refusal(spec, table.facts.get("device")):
            out.append(f"{p}: not feasible — {refusal(spec, table.facts.get('device'))}")
        elif not row.feasible or not row.launchable:
            out.append(f"{p}: not feasible — {row.reason}" if not row.feasible else f"{p}: not launched by ditbook — {row.reason}")
    return out


def default_out(args) -> Path:
    """Without ``--out``: ``RUN/parallel/runs`` with ``--run``, else a fresh folder under the
    outputs root (``outputs/<card>/parallel-<time>``), never a stray folder in the cwd."""
    if args.run:
        return Path(args.run) / "parallel" / "runs"
    from ..runs import outputs_dir
    from ..runs import new_run_id

    return outputs_dir() / Path(args.card).stem / f"parallel-{new_run_id()}"


def traced_arch(card) -> str | None:
    """``inspect/arch.json`` of the newest inspected run of this model when it was traced at the
    card's height and width: its sequence lengths are this run's, so the token counts of a
    sequence split are checked before launch (None otherwise)."""
    from ..runs import outputs_dir
    from ..runs import RunError, latest_run

    try:
        run = latest_run(outputs_dir(), card.name, with_stage="inspect")
        traced = run.read_results("inspect").traced_size if run is not None else None
    except (RunError, OSError):
        return None
    arch = run.stage_dir("inspect", create=False) / "arch.json" if run is not None else None
    if traced == [card.generation.height, card.generation.width] and arch.is_file():
        return str(arch)
    return None


def static_refusal(card, plans: list[str]) -> list[str]:
    """Without an inspected run: what the model's config alone rules out — the head count split
    by Ulysses or TP (the transformer built on the meta device, no weights read)."""
    from ..arch.static import inspect_transformer
    from ..loading import build_meta_transformer
    from ..parallel.plans import parse_plan, refusal

    try:
        heads = inspect_transformer(build_meta_transformer(card), card.pipeline.cls, support=False).attention.heads
    except Exception as exc:  # the worker meets the same problem and names it; say why nothing was pre-checked
        print(f"ditbook parallel: no feasibility pre-check (static inspection failed: {type(exc).__name__}: {exc}); "
              f"pass --run RUN_DIR of an inspected run for the full check", file=sys.stderr)
        return []
    from ..loading import choose_placement

    out = []
    if any(parse_plan(p).uses_cp for p in plans):
        print("ditbook parallel: token counts not pre-checked (no inspected run traced at this size); "
              "pass --run RUN_DIR of an inspected run to check them before launch", file=sys.stderr)
    for p in plans:
        spec = parse_plan(p)
        if refusal(spec, choose_placement(card).device):
            out.append(f"{p}: not feasible — {refusal(spec, choose_placement(card).device)}")
        for kind, n in (("ulysses", spec.ulysses), ("tp", spec.tp)):
            if n > 1 and heads and heads % n:
                out.append(f"{p}: not feasible — {heads} attention heads are not divisible by {kind} {n}")
        if spec.vae > 1:  # the VAE's decoder, built on the meta device (accel.vae)
            from ..accel.vae import vae_facts

            problem, rows = vae_facts(card.path, card.generation.height)
            if problem or (rows and rows % spec.vae):
                out.append(f"{p}: not feasible — {problem or f'{rows} latent rows not divisible by vae {spec.vae}'}")
    return out


def cmd_parallel(args) -> int:
    from ..card import parse_overrides
    from ..loading import choose_placement
    from ..parallel.launch import Nodes, ParallelRunError, ranks_present, run_plans
    from ..parallel.plans import PlanNameError, parse_plan

    overrides = parse_overrides(args.param)
    run = None
    if args.run:  # writing into a run: what its own stages check (approval, weights, its overrides)
        from ..context import open_run_for
        from ..runs import RunFolder

        run = RunFolder(args.run)
        card, overrides = open_run_for("ditbook parallel --run", run, args.card, overrides)
    else:
        from ..preflight import start_check

        card = start_check(args.card, overrides)  # what a run checks at its start
    plans = [p for item in args.plan for p in item.split(",") if p]
    try:
        specs = {p: parse_plan(p) for p in plans}
    except PlanNameError as exc:
        print(f"ditbook parallel: {exc}", file=sys.stderr)
        return 2
    if args.nproc < 1:
        print(f"ditbook parallel: --nproc {args.nproc}: give at least 1 process", file=sys.stderr)
        return 2
    present = ranks_present(choose_placement(card).device)
    if present is not None and args.nproc > present:  # rank N would ask for a GPU that is not there
        print(f"ditbook parallel: --nproc {args.nproc} needs {args.nproc} GPUs, {present} present on this machine; "
              f"not launched", file=sys.stderr)
        return 2
    arch = args.arch or (str(Path(args.run) / "inspect" / "arch.json") if args.run else None)
    if arch and not Path(arch).is_file():
        arch = None
    arch = arch or traced_arch(card)  # the traced token counts, when an inspected run has them
    wrong = [f"{p}: needs {s.world_size} processes, --nproc {args.nproc} x --nnodes {args.nnodes} gives "
             f"{args.nproc * args.nnodes}" for p, s in specs.items()
             if s.world_size not in (1, args.nproc * args.nnodes)]
    reasons = wrong or refusal(args.card, plans, arch, overrides) or ([] if arch else static_refusal(card, plans))
    if reasons:
        print("ditbook parallel: not attempted:\n" + "\n".join(f"  - {r}" for r in reasons), file=sys.stderr)
        return 3
    if run is not None:
        with run.acquire("ditbook parallel"):
            return _launch(args, plans, overrides, Nodes, ParallelRunError, run_plans)
    return _launch(args, plans, overrides, Nodes, ParallelRunError, run_plans)


def _launch(args, plans, overrides, Nodes, ParallelRunError, run_plans) -> int:
    out = Path(args.out) if args.out else default_out(args)
    try:
        nodes = Nodes(args.nnodes, args.node_rank, args.master)
    except ValueError as exc:
        print(f"ditbook parallel: {exc}", file=sys.stderr)
        return 2
    try:
        results, launch = run_plans(args.card, plans, args.nproc, out, overrides=overrides, timeout=args.timeout,
                                    total_timeout=args.total_timeout, warmup=args.warmup, nodes=nodes)
    except ParallelRunError as exc:
        print(f"ditbook parallel: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a plan this machine cannot run (+graph without a GPU)
        print(f"ditbook parallel: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"plans": [r.to_dict() for r in results], "out": str(out), "node_rank": nodes.node_rank,
                      "launch_seconds": round(launch.seconds, 2)}, indent=2, default=str))
    return 0 if all(r.passed for r in results) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("parallel", help="run parallel plans under torchrun and check parity with one process")
    p.add_argument("card", help="model card (models/<name>.yaml)")
    p.add_argument("--plan", action="append", required=True,
                   help="plan name(s): ulysses2, ring2, usp2x2, cfg2, cfg2_ulysses2, ulysses2+cache, tp2, vae2, te2, "
                        "ulysses2_vae2_te2, ulysses2+compile+graph (GPU) (repeat or comma-separate)")
    p.add_argument("--nproc", type=int, required=True, help="processes (one per GPU; gloo on CPU)")
    p.add_argument("--run", help="run folder: reads inspect/arch.json for the feasibility check, writes parallel/runs")
    p.add_argument("--arch", help="inspect/arch.json to check feasibility against")
    p.add_argument("--out", help="output folder for images, logs and worker.json (default: RUN/parallel/runs with --run, "
                                      "else outputs/<card>/parallel-<time>)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective / no-progress timeout per rank (s)")
    p.add_argument("--total-timeout", type=float, default=None, help="wall-clock limit of the whole launch (s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed renders before the timed ones")
    p.add_argument("--nnodes", type=int, default=1, help="hosts taking part (run the same command on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 on the host of --master")
    p.add_argument("--master", help="HOST:PORT of node 0, for --nnodes > 1")
    p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE", help="override a card field")
    p.set_defaults(func=cmd_parallel)
