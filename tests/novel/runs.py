"""Run a novel model through ``ditbook run`` (the CLI, all five stages, the card's defaults) and
judge the run folder: ``run_model(name, root) -> Path`` (the run folder), ``problems(run) -> [str]``
(empty when every check holds). ``python -m tests.novel.runs [NAME ...] [--root DIR]`` runs them
(default: all) and prints each model's outcome per stage as one JSON line (docs/novel_models.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from . import suite

REPO = suite.HERE.parents[1]
STAGES = ("intake", "inspect", "cache", "parallel", "benchmark")


def _ditbook(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ditbook", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=900)


# make test's lighter cache search (two strategy families, three configurations each: their grids
# start at the most conservative thresholds, which skip nothing at 3 steps); `make novel` runs every
# model with the card's defaults (every strategy, its whole grid)
LIGHT = ("cache.strategies=[dbcache_taylorseer, diffusers_fbc]", "cache.max_configs=3")


def run_model(name: str, root: Path, env=None, params: tuple[str, ...] = ()) -> tuple[Path, list[str]]:
    """Build ``name`` and run it as a new user does: ``ditbook run`` (intake, inspect, then the cache
    stage stops at the approval gate), ``ditbook approve --yes`` (the user having read plan.md), and
    ``ditbook run --resume`` (cache, parallel, benchmark)."""
    card = suite.build(name, root)
    outputs = root / "outputs"
    log = []
    flags = [x for p in params for x in ("-p", p)]
    t0 = time.perf_counter()

    def step(what, *args, keep=3000):
        done = _ditbook(*args, env=env)
        log.append(done.stdout[-keep:] + done.stderr[-3000:])
        # progress on stderr: a run stopped from outside (a timeout) shows how far it got
        print(f"[novel {name}] {what}: exit {done.returncode} at {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        return done

    run = outputs / f"novel-{name}" / "novel"
    step("ditbook run (intake, inspect; stops at the approval gate)", "run", card, "--run-id", "novel",
         "--outputs", outputs, *flags)
    step("ditbook approve --yes", "approve", card, "--run", run, "--yes", keep=2000)
    step("ditbook run --resume (cache, parallel, benchmark)", "run", "--resume", run, keep=6000)
    return run, log


def _named(text) -> bool:
    return isinstance(text, str) and len(text.strip()) > 3


def _cache_problems(cache: dict) -> list[str]:
    if cache.get("refused") is not None:
        return [] if _named(cache["refused"]) else [f"cache refused without a reason: {cache['refused']!r}"]
    chosen = cache.get("chosen")
    if not chosen:
        return []  # no strategy met the gates: an honest outcome, every row says why
    rows = [r for r in cache.get("strategies", []) if r.get("name") == chosen.get("name")
            and r.get("config") == chosen.get("config")]
    out = []
    if not rows or not any(r.get("passed") for r in rows):
        out.append(f"cache chose {chosen.get('name')} but no row of it passed")
    for r in rows:
        if r.get("passed") and not (r.get("skipped_fraction") or 0) > 0:
            out.append(f"cache chose {r['name']} {r.get('config')} which skipped nothing")
        if r.get("passed") and (r.get("quality") or {}).get("passed") is False:
            out.append(f"cache chose {r['name']} whose images failed the gates")
    return out


def _plan_error(row: dict) -> str | None:
    details = row.get("details") or {}
    for text in (row.get("error"), row.get("reason"), details.get("error"),
                 (details.get("sharding") or {}).get("error"), (row.get("quality") or {}).get("reason")):
        if _named(text):
            return text
    return None


def _parallel_problems(par: dict) -> list[str]:
    out = []
    for row in par.get("plans", []):
        if not isinstance(row.get("passed"), bool):
            out.append(f"plan {row.get('name')}: no passed/failed record")
        elif not row["passed"] and not _plan_error(row):
            out.append(f"plan {row.get('name')} failed without a named error")
    for row in par.get("not_run", []):
        if not _named(row.get("reason")):
            out.append(f"plan {row.get('name')} refused without a reason")
    return out


def problems(run: Path) -> list[str]:
    """What is not true of a finished novel-model run (empty: every check of the suite holds)."""
    meta_file = run / "run.json"
    if not meta_file.is_file():
        return [f"no run folder at {run}"]
    meta = json.loads(meta_file.read_text())
    out = [] if meta.get("status") == "finished" else [f"run status {meta.get('status')!r}"]
    results = {}
    for stage in STAGES:
        f = run / stage / "results.json"
        if f.is_file():
            results[stage] = json.loads(f.read_text())
        else:
            out.append(f"{stage}: no results.json")
    if "cache" in results:
        out += _cache_problems(results["cache"])
    if "parallel" in results:
        out += _parallel_problems(results["parallel"])
    if not (run / "report.html").is_file():
        out.append("no report.html")
    return out


def outcome(run: Path) -> dict:
    """One line per model for docs/novel_models.md: each stage's status, the cache decision, the plans."""
    meta = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    stages = {s: (meta.get("stages", {}).get(s) or {}).get("status") for s in STAGES}
    read = lambda s: json.loads((run / s / "results.json").read_text()) if (run / s / "results.json").is_file() else {}  # noqa: E731
    cache, par = read("cache"), read("parallel")
    chosen = cache.get("chosen") or {}
    errors = {s: (meta.get("stages", {}).get(s) or {}).get("error") for s in STAGES}
    return {
        "stages": stages,
        "errors": {k: (v or "")[:300] for k, v in errors.items() if v},
        "cache": {"refused": cache.get("refused"), "chosen": chosen.get("name"), "config": chosen.get("config"),
                  "skipped": [r.get("skipped_fraction") for r in cache.get("strategies", [])
                              if r.get("name") == chosen.get("name") and r.get("config") == chosen.get("config")]},
        "plans": {r["name"]: ("passed" if r.get("passed") else f"failed: {(_plan_error(r) or '')[:160]}")
                  for r in par.get("plans", [])},
        "not_run": {r["name"]: (r.get("reason") or "")[:160] for r in par.get("not_run", [])},
        "problems": problems(run),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--root", default="/tmp/novel-models")
    ap.add_argument("--light", action="store_true", help="make test's lighter cache search")
    ap.add_argument("--device", default=None, help="runtime.device for every model (cpu, cuda, auto; "
                    "default: the card's, cpu); the GPU check passes cuda on a GPU host")
    args = ap.parse_args()
    root = Path(args.root)
    bad = 0
    for name in args.names or list(suite.MODELS):
        t = time.time()
        params = (LIGHT if args.light else ()) + ((f"device={args.device}",) if args.device else ())
        run, _log = run_model(name, root, params=params)
        row = {"model": name, "seconds": round(time.time() - t, 1), **outcome(run)}
        bad += bool(row["problems"])
        print(json.dumps(row), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
