"""``ditbook inspect CARD [--json]`` and ``ditbook approve CARD [--run RUN_DIR] [--yes]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_inspect(args) -> int:
    from ..card import parse_overrides
    from ..loading import choose_placement, load_pipeline
    from ..runs import RunFolder
    from ..inspect.stage import run_inspection, save_inspection
    from ..display import Table
    from ..inspect.tables import block_rows, fact_rows

    from ..card import CardError
    from ..settings import InspectSettings, parse_section

    overrides = parse_overrides(args.param)
    # --steps and --size are the inspect section's trace_steps and trace_size: the same checks
    _, bad = parse_section(InspectSettings, {"trace_steps": args.steps, "trace_size": args.size}, "inspect")
    if bad:
        flag = {"inspect.trace_steps": "--steps", "inspect.trace_size": "--size"}
        raise CardError("; ".join(f"{flag.get(k, k)}: {m}" for k, m in bad))
    from ..preflight import start_check

    card = start_check(args.card, overrides)  # what a run checks at its start
    pipe = load_pipeline(card, choose_placement(card))
    result = run_inspection(pipe, card, steps=args.steps, size=args.size)
    saved = None
    if not args.no_save:
        from ..runs import outputs_dir

        run = RunFolder.create(card, Path(args.outputs) if args.outputs else outputs_dir(), overrides=overrides)
        results = save_inspection(run.stage_dir("inspect"), result)
        run.write_results("inspect", results)
        run.update_stage("inspect", status="passed", source="ditbook inspect")
        run.set_status("inspected")
        saved = run.path
    if args.json:
        out = result.to_dict()
        out["run_dir"] = str(saved) if saved else None
        print(json.dumps(out, indent=2, default=str))
        return 0
    r = result.report
    print(f"{card.name}: {r.transformer_class} in {r.pipeline_class}, {r.param_count:,} parameters")
    print()
    print(repr(Table.from_dicts([{k: v for k, v in row.items() if k != "why"} for row in block_rows(r)])))
    print()
    print(repr(Table.from_dicts(fact_rows(r))))
    if r.loop_extra_work_reasons:
        print("\nloop extra work:\n  " + "\n  ".join(r.loop_extra_work_reasons))
    print("\nrisks:")
    for risk in result.plan["risks"]:
        print(f"  [{risk['severity']}] {risk['id']}: {risk['text']}")
    print(f"\nplan hash {result.plan['hash']}")
    if saved:
        print(f"written to {saved}/inspect/ — approve with: ditbook approve {args.card}")
    return 0


def cmd_approve(args) -> int:
    from ..card import GateError, gate_problems
    from ..approval import approve, find_plan_file, not_this_models_plan, read_plan

    card, problems = gate_problems(args.card)
    if problems or card is None:  # an approval is for a card that can run
        raise GateError(args.card, problems)
    path = find_plan_file(card, args.run, Path(args.outputs) if args.outputs else None)
    if args.run and path is not None and not str(path).startswith(str(Path(args.run).resolve())):
        print(f"ditbook approve: {args.run} has no inspect/plan.json", file=sys.stderr)
        return 2
    if path is None:
        print(f"ditbook approve: no inspected run of {card.name} found; run `ditbook inspect {args.card}` "
              f"or the inspect stage first", file=sys.stderr)
        return 2
    plan = read_plan(path)
    other = not_this_models_plan(card, plan, path)
    if other:
        print(f"ditbook approve: the plan {path} is not {args.card}'s: {other}; nothing written", file=sys.stderr)
        return 2
    md = path.with_name("plan.md")
    print(md.read_text() if md.is_file() else json.dumps(plan, indent=2))
    print(f"plan: {path}\nhash: {plan['hash']}")
    if card.approved_plan == plan["hash"]:
        print(f"{args.card} already approves this plan")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            print("ditbook approve: not a terminal; pass --yes to approve", file=sys.stderr)
            return 2
        if input(f"approve plan {plan['hash']} for {card.name}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not approved")
            return 1
    h = approve(card, path)
    print(f"approved: wrote approved_plan: {h} into {args.card}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="inspect and trace a model; print its architecture facts and plan")
    p.add_argument("card", help="model card (models/<name>.yaml)")
    p.add_argument("--json", action="store_true", help="print the report, code surface and plan as JSON")
    p.add_argument("--steps", type=int, help="denoising steps of the traced run (default 2, or card inspect.trace_steps)")
    p.add_argument("--size", type=int, help="height and width of the traced run (default: the card's)")
    p.add_argument("--no-save", action="store_true", help="do not write a run folder")
    p.add_argument("--outputs", help="outputs root (default: $DITBOOK_OUTPUTS, else outputs/ in the current directory)")
    p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE", help="override a card field")
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser("approve", help="show the newest integration plan and write its hash into the card")
    p.add_argument("card", help="model card to write the approved plan hash into")
    p.add_argument("--run", metavar="RUN_DIR", help="approve the plan of this run (default: the newest inspected run)")
    p.add_argument("--yes", action="store_true", help="approve without asking")
    p.add_argument("--outputs", help="outputs root (default: $DITBOOK_OUTPUTS, else outputs/ in the current directory)")
    p.set_defaults(func=cmd_approve)
