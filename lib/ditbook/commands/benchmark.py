"""``ditbook report RUN_DIR``, ``ditbook compare RUN_A RUN_B`` and ``ditbook screenshots [--run RUN_DIR]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def cmd_report(args) -> int:
    from ..runs import RunFolder
    from ..benchmark.report import rebuild

    run = RunFolder(args.run_dir)
    if not run.exists():
        print(f"ditbook report: {args.run_dir} is not a run folder (no run.json)", file=sys.stderr)
        return 2
    md, html = rebuild(run.path, figures=not args.no_figures)
    print(f"result: {md}")
    print(f"report: {html}")
    return 0


def cmd_compare(args) -> int:
    from ..runs import RunFolder
    from ..benchmark.compare_runs import compare_runs

    for d in (args.run_a, args.run_b):
        if not RunFolder(d).exists():
            print(f"ditbook compare: {d} is not a run folder (no run.json)", file=sys.stderr)
            return 2
    if args.outputs_deprecated:
        print("ditbook compare: --outputs is deprecated (other commands use it for the outputs folder); "
              "use --cell-outputs", file=sys.stderr)
    cmp = compare_runs(args.run_a, args.run_b, outputs=args.cell_outputs or args.outputs_deprecated)
    if args.json:
        print(json.dumps(cmp.to_dict(), indent=2))
    else:
        print(cmp.format(), end="")
    return 0


def cmd_screenshots(args) -> int:
    from ..runs import RunFolder, outputs_dir
    from ..benchmark.report import rebuild
    from ..benchmark.screenshots import ScreenshotError, newest_finished_run, take

    try:
        run = RunFolder(args.run) if args.run else newest_finished_run(args.outputs or outputs_dir())
        if not run.exists():
            print(f"ditbook screenshots: {args.run} is not a run folder (no run.json)", file=sys.stderr)
            return 2
        if args.rebuild:
            rebuild(run.path)
        manifest = take(run.path, args.docs)
    except ScreenshotError as exc:
        print(f"ditbook screenshots: {exc}", file=sys.stderr)
        return 2
    print(f"run: {run.path}")
    for name in manifest["files"]:
        print(f"wrote: {Path(args.docs) / name}")
    print(f"manifest: {Path(args.docs) / 'screenshots.json'} (name run {manifest['run']} in the README's caption)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="rebuild result.md and report.html of a run folder")
    p.add_argument("run_dir", help="run folder (outputs/<model>/<run-id>)")
    p.add_argument("--no-figures", action="store_true", help="keep the existing plot and image grid (do not redraw them)")
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser("compare", help="what changed between two runs: card, versions, stages, metrics, verdict, notebook sources")
    p.add_argument("run_a", help="the earlier run folder (A)")
    p.add_argument("run_b", help="the later run folder (B); deltas are B - A")
    p.add_argument("--cell-outputs", action="store_true", help="diff the notebooks' cell outputs too (left out by default)")
    # the old name, kept working: --outputs is every other command's outputs folder
    p.add_argument("--outputs", dest="outputs_deprecated", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=cmd_compare)

    p = subparsers.add_parser("screenshots", help="the README's screenshots of report.html (headless Chromium, 1280x800 and 1024x768) "
                                                  "and docs/screenshots.json, from the newest finished run")
    p.add_argument("--run", help="run folder (default: the newest finished run under the outputs root)")
    p.add_argument("--outputs", help="outputs root (default: $DITBOOK_OUTPUTS, else outputs/ in the current directory)")
    p.add_argument("--docs", default="docs", help="where the PNGs and screenshots.json go (default: docs)")
    p.add_argument("--rebuild", action="store_true", help="rebuild report.html with the current code first")
    p.set_defaults(func=cmd_screenshots)
