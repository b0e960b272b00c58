"""The ``ditbook`` command. Each stage package adds its own subcommands through a
``commands.py`` module with ``register(subparsers)``; this file holds the shared ones."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


from .card import CardError, GateError, gate_problems, parse_overrides
from .runs import RunError

from .benchmark import commands as benchmark_commands
from .cache import commands as cache_commands
from .inspect import commands as inspect_commands
from .parallel import commands as parallel_commands
from .zoo import commands as zoo_commands

# stage packages that contribute subcommands (each module defines register(subparsers))
COMMAND_MODULES = (zoo_commands, inspect_commands, cache_commands, parallel_commands, benchmark_commands)


def cmd_check(args) -> int:
    card, problems = gate_problems(args.card, parse_overrides(args.param))
    if problems:
        print(GateError(args.card, problems), file=sys.stderr)
        return 2
    print(f"{args.card}: gate check passed ({card.name}: {card.pipeline.cls} + {card.transformer.cls} at {card.path})")
    return 0


def cmd_run(args) -> int:
    from .runner import resume_run, start_run

    if args.resume:
        outcome = resume_run(args.resume, kernel_name=args.kernel)
    else:
        if not args.card:
            raise SystemExit("ditbook run: give a CARD, or --resume RUN_DIR")
        stages = [s for s in (args.stages or "").split(",") if s] or None
        outcome = start_run(args.card, stages=stages, overrides=parse_overrides(args.param),
                            run_id=args.run_id, kernel_name=args.kernel,
                            outputs_root=Path(args.outputs) if args.outputs else None)
    run = outcome.run
    print(f"run folder: {run.path} ({run.status})")
    for s in outcome.stages:
        nb = run.path / run.read_meta()["stages"][s.stage]["notebook"]
        print(f"  {s.stage:10s} {s.status:7s} {s.seconds:7.1f}s  {nb}")
    return 0 if outcome.ok else 1


def cmd_batch(args) -> int:
    from .runner import format_batch_table, run_batch

    stages = [s for s in (args.stages or "").split(",") if s] or None
    rows = run_batch(args.cards, stages=stages, overrides=parse_overrides(args.param), kernel_name=args.kernel,
                     outputs_root=Path(args.outputs) if args.outputs else None)
    print()
    print(format_batch_table(rows))
    return 0 if all(r.failure is None for r in rows) else 1


def cmd_stages(args) -> int:
    from .runner import discover_stages

    for s in discover_stages():
        print(f"{s.order:02d}  {s.name:10s} {s.notebook}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditbook", description=__doc__.splitlines()[0] if __doc__ else None)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"ditbook {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="run the gate check of a model card (exit 0 when it passes)")
    p.add_argument("card", help="model card (models/<name>.yaml)")
    p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE", help="override a card field")
    p.set_defaults(func=cmd_check)

    def run_options(p):
        p.add_argument("--stages", help="comma-separated stage names (default: all, in order)")
        p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE",
                       help="override a card field, e.g. -p generation.steps=4 -p device=cpu")
        p.add_argument("--kernel", help="Jupyter kernel name (default: the notebook's)")
        p.add_argument("--outputs", help="outputs root (default: $DITBOOK_OUTPUTS, else outputs/ in the current directory)")

    p = sub.add_parser("run", help="execute the stage notebooks into a new run folder")
    p.add_argument("card", nargs="?", help="model card (models/<name>.yaml); not needed with --resume")
    p.add_argument("--run-id", help="name of the new run folder (default: a timestamp)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an unfinished run from its first unfinished stage")
    run_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("batch", help="run several models one after another; ends with a table")
    p.add_argument("cards", nargs="+", help="model cards, run in the order given")
    run_options(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("stages", help="list the stage notebooks (shipped with the package, or $DITBOOK_NOTEBOOKS)")
    p.set_defaults(func=cmd_stages)

    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers' notices (e.g. an image processor falling back without torchvision) are not
    # about the user's model; the command shows its errors only unless the user set a level
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (GateError, CardError, RunError) as exc:
        print(f"ditbook: {exc}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"ditbook: unreadable JSON: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
