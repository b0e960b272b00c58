"""The ``ditbook`` command. Each stage's subcommands are a module of ``ditbook.commands`` with
``register(subparsers)``; this file holds the shared ones."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import traceback
from pathlib import Path

import yaml

from .card import CardError, GateError, parse_overrides
from .processes import Interrupted, signals_end_children
from .runs import RunError
from .commands import benchmark as benchmark_commands
from .commands import cache as cache_commands
from .commands import inspect as inspect_commands
from .commands import parallel as parallel_commands
from .commands import zoo as zoo_commands

# the subcommand modules (each defines register(subparsers))
COMMAND_MODULES = (zoo_commands, inspect_commands, cache_commands, parallel_commands, benchmark_commands)


def cmd_check(args) -> int:
    from .preflight import start_problems

    card, problems = start_problems(args.card, parse_overrides(args.param))  # what `ditbook run` refuses at its start
    if not problems:  # the card is complete: now what the stages will read from the model folder
        from .loading import model_folder_problems

        problems = model_folder_problems(card)
    if problems:
        print(GateError(args.card, problems), file=sys.stderr)
        return 2
    print(f"{args.card}: gate check passed ({card.name}: {card.pipeline.cls} + {card.transformer.cls} at {card.path})")
    return 0


def cmd_run(args) -> int:
    from .runner import resume_run, start_run

    if args.resume:
        ignored = [flag for flag, value in (("CARD", args.card), ("--stages", args.stages), ("-p", args.param),
                                            ("--run-id", args.run_id), ("--outputs", args.outputs)) if value]
        if ignored:
            raise RunError(f"--resume continues {args.resume} with its own card, stages and overrides; "
                           f"{', '.join(ignored)} would be ignored — drop {'it' if len(ignored) == 1 else 'them'}, "
                           f"or start a new run with them")
        outcome = resume_run(args.resume, kernel_name=args.kernel)
    else:
        if not args.card:  # what the user gave is incomplete: exit 2, like every such error
            raise RunError("run: give a CARD (models/<name>.yaml), or --resume RUN_DIR (see ditbook run --help)")
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


DESCRIPTION = ("ditbook takes a new diffusion transformer from a model card into caching (cache-dit / diffusers) "
               "and torch.distributed parallelism: each stage is a notebook run into a run folder, judged by "
               "PSNR/SSIM against the uncached model, and ends in a report (result.md, report.html) that says "
               "what to ship.")


def _stage_names() -> str:
    from .runner import discover_stages

    try:
        return ", ".join(s.name for s in discover_stages())
    except OSError:  # no notebooks folder: the help still prints
        return "see `ditbook stages`"


# what `ditbook COMMAND --help` ends with: a few command lines a user can copy
EXAMPLES = {
    "check": ["ditbook check models/reference.yaml", "ditbook check models/my-dit.yaml -p generation.steps=4"],
    "run": ["ditbook run models/my-dit.yaml                  # intake, inspect; stops at the plan's approval",
            "ditbook approve models/my-dit.yaml --run outputs/my-dit/<run-id>   # after reading inspect/plan.md",
            "ditbook run --resume outputs/my-dit/<run-id>    # cache, parallel, benchmark; result.md, report.html",
            "ditbook run models/reference.yaml                # the shipped card is approved: all five stages",
            "ditbook run models/my-dit.yaml --stages intake,inspect -p generation.steps=4"],
    "batch": ["ditbook batch models/reference.yaml models/video_reference.yaml"],
    "stages": ["ditbook stages"],
    "inspect": ["ditbook inspect models/my-dit.yaml", "ditbook inspect models/my-dit.yaml --json --no-save"],
    "approve": ["ditbook approve models/my-dit.yaml                  # the newest inspected run's plan",
                "ditbook approve models/my-dit.yaml --run outputs/my-dit/<run-id> --yes"],
    "cache": ["ditbook cache --list", "ditbook cache models/my-dit.yaml --run outputs/my-dit/<run-id> "
                                      "--strategies dbcache_taylorseer"],
    "parallel": ["ditbook parallel models/reference.yaml --plan ulysses2 --nproc 2",
                 "ditbook parallel models/my-dit.yaml --plan cfg2,ulysses2+cache --nproc 2 --run outputs/my-dit/<run-id>"],
    "report": ["ditbook report outputs/reference/<run-id>"],
    "compare": ["ditbook compare outputs/reference/<run-a> outputs/reference/<run-b>",
                "ditbook compare RUN_A RUN_B --json"],
    "screenshots": ["ditbook screenshots", "ditbook screenshots --run outputs/reference/<run-id> --rebuild"],
    "zoo": ["ditbook zoo list", "ditbook zoo build flux /tmp/zoo"],
}
DEBUG_HELP = "show the traceback of an error (accepted anywhere on the line)"
RUN_NOTE = ("A new card stops after inspect: the cache stage refuses to run until the integration plan is approved. "
            "Read <run>/inspect/plan.md, run `ditbook approve CARD --run <run>`, then `ditbook run --resume <run>`.")


def describe_subcommands(sub, path: tuple[str, ...] = ()) -> None:
    """Give every subcommand (and theirs, e.g. ``zoo list``) a description line (its help text
    when it has none, so ``ditbook COMMAND --help`` opens with what the command does), the
    ``--debug`` option in its help, and its examples (:data:`EXAMPLES`)."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        if not parser.description and helps.get(name):
            text = helps[name]
            parser.description = text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")
        if not any("--debug" in a.option_strings for a in parser._actions):
            parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)  # main() takes it off the line
        examples = EXAMPLES.get(" ".join(path + (name,)))
        if examples:  # raw text keeps the examples' lines; the description is wrapped here
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
            parser.description = "\n\n".join(textwrap.fill(p, 79) for p in (parser.description or "").split("\n\n"))
            parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                describe_subcommands(action, path + (name,))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ditbook", description=textwrap.fill(DESCRIPTION, 79),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="your own model, step by step:\n"
                                            "  ditbook check models/my-dit.yaml        # the card is complete\n"
                                            "  ditbook run models/my-dit.yaml          # intake, inspect; stops for approval\n"
                                            "  (read outputs/my-dit/<run-id>/inspect/plan.md)\n"
                                            "  ditbook approve models/my-dit.yaml --run outputs/my-dit/<run-id>\n"
                                            "  ditbook run --resume outputs/my-dit/<run-id>   # then open report.html\n\n"
                                            "--debug (anywhere on the line) shows the traceback of an error;\n"
                                            "`ditbook COMMAND --help` describes a command, with examples")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"ditbook {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)  # main() takes it off the line
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    stage_names = _stage_names()

    p = sub.add_parser("check", help="run the gate check of a model card (exit 0 when it passes)")
    p.add_argument("card", help="model card (models/<name>.yaml)")
    p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE", help="override a card field")
    p.set_defaults(func=cmd_check)

    def run_options(p):
        p.add_argument("--stages", help=f"comma-separated stage names, of: {stage_names} (default: all, in order)")
        p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE",
                       help="override a card field, e.g. -p generation.steps=4 -p device=cpu")
        p.add_argument("--kernel", help="Jupyter kernel name (default: the notebook's)")
        p.add_argument("--outputs", help="outputs root (default: $DITBOOK_OUTPUTS, else outputs/ in the current directory)")

    p = sub.add_parser("run", help="execute the stage notebooks into a new run folder (a new card stops at the "
                                    "plan's approval after inspect; then approve and --resume)",
                       description="Execute the stage notebooks into a new run folder: intake, inspect, cache, "
                                   "parallel, benchmark. " + RUN_NOTE)
    p.add_argument("card", nargs="?", help="model card (models/<name>.yaml); not needed with --resume")
    p.add_argument("--run-id", help="name of the new run folder (default: a timestamp)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an unfinished run from its first unfinished stage "
                                                       "(after `ditbook approve`), with the run's own card and overrides")
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
    describe_subcommands(sub)
    return parser


def _bad_param(args) -> str | None:
    """The first ``-p`` value that is not valid YAML, as a one-line message."""
    for item in getattr(args, "param", None) or []:
        if "=" not in item:
            continue
        value = item.split("=", 1)[1]
        try:
            yaml.safe_load(value)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            return f"-p {item!r}: the value is not valid YAML ({problem}); quote it to pass a string"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every error it can meet ends in a message and a non-zero exit, never a
    traceback (``--debug``, anywhere on the line, shows it): 2 for what the user gave (card, run
    folder, files), 1 for a stage or check that failed, 130 for Ctrl-C / SIGTERM, after every
    process the command started has been ended."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    # transformers' notices (e.g. an image processor falling back without torchvision) are not
    # about the user's model; the command shows its errors only unless the user set a level
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = _bad_param(args)
    if bad:
        print(f"ditbook: {bad}", file=sys.stderr)
        return 2
    try:
        with signals_end_children():
            return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:
        signame = getattr(exc, "signame", "SIGINT")
        detail = exc.message if isinstance(exc, Interrupted) and exc.message else "every process it started was ended"
        if debug:
            traceback.print_exc()
        print(f"ditbook {args.command}: interrupted by {signame}; {detail}", file=sys.stderr)
        return 130
    except (GateError, CardError, RunError) as exc:
        if debug:
            traceback.print_exc()
        print(f"ditbook: {exc}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:  # a JSON file read outside RunFolder (a plan, a report input)
        if debug:
            traceback.print_exc()
        print(f"ditbook {args.command}: unreadable JSON ({exc}); a file may be truncated", file=sys.stderr)
        return 2
    except OSError as exc:  # outputs folder read-only or a file, a model folder missing a part, ...
        if debug:
            traceback.print_exc()
        where = f"{exc.filename}: " if getattr(exc, "filename", None) and str(exc.filename) not in str(exc) else ""
        print(f"ditbook {args.command}: {where}{_one_line(exc)}", file=sys.stderr)
        return 2
    except SystemExit:
        raise
    except Exception as exc:
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"ditbook {args.command}: {type(exc).__name__}: {_one_line(exc)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
