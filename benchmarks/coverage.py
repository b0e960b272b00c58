"""Coverage table: every transformer class the installed diffusers exports, through ditbook.

    python benchmarks/coverage.py [--classes A,B] [--fast] [--out docs/coverage.md] [--no-cp]
    python benchmarks/coverage.py --shard 1/2 --json a.json   # half the classes, rows saved as they come
    python benchmarks/coverage.py --merge a.json,b.json       # one table from shards

The logic lives in ``ditbook.coverage``; this script only picks classes, prints a line per
class and writes the markdown table (default ``docs/coverage.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# a handful of classes that exercise different mechanisms (joint two-stream blocks, single
# stream, cross attention, video latents), small enough for `make test`
FAST = ("FluxTransformer2DModel", "PixArtTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel",
        "LTXVideoTransformer3DModel")


def main(argv=None) -> int:
    from ditbook import coverage

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", help="comma-separated class names (default: every exported class)")
    ap.add_argument("--fast", action="store_true", help=f"only the fast subset {', '.join(FAST)}")
    ap.add_argument("--out", default=None, help="markdown file to write (default docs/coverage.md for a full run)")
    ap.add_argument("--no-cp", action="store_true", help="do not run the CP column (ditbook.coverage.cp)")
    ap.add_argument("--shard", help="K/N: run the K-th of N interleaved parts of the class list")
    ap.add_argument("--json", help="write the rows here after every class (for shards)")
    ap.add_argument("--merge", help="comma-separated --json files: write one table from them")
    args = ap.parse_args(argv)
    if args.merge:
        data = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        rows = sorted((coverage.ClassOutcome(**r) for d in data for r in d["rows"]), key=lambda r: r.name)
        seconds = max(d["seconds"] for d in data)
        out = args.out or "docs/coverage.md"
        how = (f"run as {len(data)} parallel shards (`--shard K/{len(data)} --json ...`), merged with `--merge`; "
               f"the wall time is the longest shard's")
        Path(out).write_text(coverage.markdown(rows, seconds, how))
        print(coverage.totals(rows), f"wrote {out}")
        return 0
    classes = coverage.transformer_classes()
    wanted = args.classes.split(",") if args.classes else (FAST if args.fast else None)
    if wanted:
        missing = sorted(set(wanted) - {c.__name__ for c in classes})
        if missing:
            print(f"not exported by this diffusers: {missing}", file=sys.stderr)
            return 2
        classes = [c for c in classes if c.__name__ in wanted]
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        classes = classes[k - 1::n]
    start = time.perf_counter()
    done: list = []

    def progress(r):
        done.append(r)
        print(f"{r.name:42s} {r.outcome:8s} {r.seconds:6.1f}s {r.stage} {r.reason[:150]}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"seconds": time.perf_counter() - start,
                                                   "rows": [x.to_dict() for x in done]}, indent=1))

    rows = coverage.run_coverage(classes, cp=not args.no_cp, progress=progress)
    seconds = time.perf_counter() - start
    print(coverage.totals(rows), f"{seconds:.0f} s")
    out = args.out or (None if (wanted or args.shard) else "docs/coverage.md")
    if out:
        cmd = "`python benchmarks/coverage.py " + " ".join(argv if argv is not None else sys.argv[1:]).strip() + "`"
        Path(out).write_text(coverage.markdown(rows, seconds, cmd))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
