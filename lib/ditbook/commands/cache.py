"""``ditbook cache``: run the cache stage (03_cache) on a run folder that has intake and
inspect results, or list the registered strategies."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_cache(args) -> int:
    from .. import accel

    if args.list:
        for name in accel.names("cache"):
            s = accel.get(name)
            print(f"{name:22s} {s.family}")
        return 0
    if not args.card:
        print("ditbook cache: give a model card (or --list)")
        return 2
    from ..card import gate_check
    from ..runs import outputs_dir
    from ..runs import RunFolder, latest_run

    wanted = [n.strip() for n in (args.strategies or "").split(",") if n.strip()]
    unknown = [n for n in wanted if n not in accel.names("cache")]
    if unknown or (args.strategies is not None and not wanted):
        print(f"ditbook cache: unknown strategy name(s) {unknown or [args.strategies]}; registered: "
              f"{', '.join(accel.names('cache'))} (ditbook cache --list)", file=sys.stderr)
        return 2
    card = gate_check(args.card)
    outputs = Path(args.outputs) if args.outputs else outputs_dir()
    run = RunFolder(args.run) if args.run else latest_run(outputs, card.name, with_stage="inspect")
    if run is None or not run.exists():
        print(f"no run folder of {card.name} with inspect results under {outputs}: run "
              f"'ditbook run {args.card} --stages intake,inspect' and 'ditbook approve {args.card}' first",
              file=sys.stderr)
        return 1
    from ..context import open_run_for

    # a finished run is never rewritten; the run's own overrides (its steps, sizes) apply
    card, run_overrides = open_run_for("ditbook cache", run, args.card, approval=False)
    with run.acquire("ditbook cache"):
        return _run_cache(args, card, run, wanted, run_overrides)


def _run_cache(args, card, run, wanted: list[str], run_overrides: dict | None = None) -> int:
    from ..runner import discover_stages, execute_stage

    stage = next((s for s in discover_stages() if s.name == "cache"), None)
    if stage is None:
        print("notebooks/03_cache.ipynb not found")
        return 1
    overrides = dict(run_overrides or {})
    if wanted:
        overrides["cache.strategies"] = wanted
    if args.max_configs:
        overrides["cache.max_configs"] = args.max_configs
    outcome = execute_stage(stage, run, card, overrides)
    if outcome.status != "passed":
        print(f"cache stage failed: {outcome.error}")
        if outcome.failing_cell:
            print(outcome.failing_cell)
        return 1
    res = run.read_results("cache")
    summary = {"run": str(run.path), "chosen": res.chosen.to_dict() if res.chosen else None,
               "why": res.decision["reason"] if res.decision else res.refused,
               "adapter_module": str(run.stage_dir("cache") / res.adapter_module),
               "reproduction_ok": res.reproduction.ok}
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("cache", help="run the cache stage (adapter, strategies, verification, tuning) on a run")
    p.add_argument("card", nargs="?", help="model card (models/<name>.yaml); not needed with --list")
    p.add_argument("--run", metavar="RUN_DIR", help="run folder (default: the newest one with inspect results)")
    p.add_argument("--strategies", help="comma-separated strategy names (default: the card's or all)")
    p.add_argument("--max-configs", type=int, help="configurations tried per strategy")
    p.add_argument("--outputs", help="outputs root (default: $DITBOOK_OUTPUTS, else outputs/ in the current directory)")
    p.add_argument("--list", action="store_true", help="list the registered strategies")
    p.set_defaults(func=cmd_cache)
