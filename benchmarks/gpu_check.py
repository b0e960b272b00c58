"""The GPU check (issue 24): the five stages on both shipped cards and a short composed benchmark
at the FLUX.1-dev shape, on one GPU, written to ``docs/gpu-check.json``.

Every change to ``lib/`` lands with this record: ``tree_digest`` is a hash of the files that make
a run (``lib/``, ``notebooks/``, ``models/``), so ``tests/test_gpu_check.py`` can tell on a CPU
machine whether the record was made on the code being submitted.

On a GPU host with the wheel bundle (``../shared/gpu/README.md``), from the repository root::

    . .gpu-wheels/install.sh && make gpu-check                 # ~12 minutes on one GPU
    . .gpu-wheels/install.sh && python3 benchmarks/gpu_check.py --record docs/gpu-check.json \\
        --revision <commit>                                    # a host without the git folder

The two cards run one after the other, each on an idle GPU as a user runs a card, so each card's
time is the one a user waits for (``--side-by-side``: both at once, separate processes sharing the
GPU, shorter in all but slower per card); then the benchmark runs alone. Per card the record keeps
each stage's seconds, its notebook's slowest cells, the wait for its kernel and the time outside
the stages (``phases``: the command's start before the first stage, the gaps between stages, the
report after the last). A card that fails or runs past
``--card-timeout`` is recorded with its status and the run's error; the check goes on.

``--novel all`` (``make gpu-check`` passes it) runs the novel-model suite (``tests/novel/``, each model
as ``make novel`` runs it: ``ditbook run`` → ``approve`` → ``run --resume`` with the card's defaults)
after the cards (their times stay those of a user's run) and before the benchmark, ``--novel-jobs``
at once, on the GPU (``--novel-device``); the record's ``novel`` keeps each model's status per stage,
cache decision, plans and problems, and the check passes only if every model finished clean.
``--novel-beside-cards`` starts them with the cards (shorter; the cards then share the host's CPUs);
``--novel-only`` runs the suite alone and adds its part to a record made on the same code.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lib"))  # this checkout's ditbook, the code the record is about

from ditbook.environment import environment as run_environment  # noqa: E402
from ditbook.runs import source_revision  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from cell_times import run_cells  # noqa: E402
CARDS = ("models/reference.yaml", "models/video_reference.yaml")
DIGEST_PARTS = ("lib", "notebooks", "models")
BENCH_ROWS = "eager,cache,cache+compile,cache+compile+decoder"
SKIP_SUFFIXES = (".pyc",)


def _skipped_dir(name: str) -> bool:
    return name in ("__pycache__", ".ipynb_checkpoints") or name.endswith(".egg-info")


DIGEST_METHOD = "python files as their source lines without comments and comment-only lines, other files as bytes"


def code_bytes(path: Path) -> bytes:
    """What of a file the digest covers: a Python file's source lines without its comments, its
    comment-only and blank lines, and trailing spaces (a comment changes nothing that runs, so it
    needs no new GPU check; a docstring, a name or a number does); any other file, or a Python file
    that does not tokenize, byte for byte. The comments are found by ``tokenize`` and cut from the
    text by their positions, so the result is the same under every Python version (3.12 splits an
    f-string into several tokens where 3.11 has one; the text they cover is the same)."""
    import io
    import tokenize

    data = path.read_bytes()
    if path.suffix != ".py":
        return data
    try:
        toks = list(tokenize.tokenize(io.BytesIO(data).readline))
        lines = data.decode("utf-8").splitlines()
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return data
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENCODING, tokenize.ENDMARKER)
    cut, rows = {}, set()  # where each line's comment starts; the lines holding code (strings included)
    for t in toks:
        if t.type == tokenize.COMMENT:
            cut[t.start[0]] = t.start[1]
        elif t.type not in layout:
            rows.update(range(t.start[0], t.end[0] + 1))
    return "\n".join(line[:cut.get(i, len(line))].rstrip() for i, line in enumerate(lines, 1) if i in rows).encode()


def tree_digest(root: Path = REPO) -> str:
    """sha256 over the relative path and content (``code_bytes``) of every file under
    ``DIGEST_PARTS`` (links and build or cache folders skipped, as git ignores them), in sorted
    order: the same on any machine for the same checkout, with or without its git folder."""
    h = hashlib.sha256()
    files = []
    for part in DIGEST_PARTS:
        for folder, dirs, names in os.walk(root / part, followlinks=False):
            dirs[:] = [d for d in dirs if not _skipped_dir(d)]
            files += [Path(folder) / n for n in names if not n.endswith(SKIP_SUFFIXES)]
    for p in sorted(files, key=lambda q: q.relative_to(root).as_posix()):
        if p.is_symlink():
            continue
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + code_bytes(p) + b"\0")
    return h.hexdigest()


def git_revision(root: Path = REPO) -> tuple[str | None, bool | None]:
    """(HEAD, dirty) of the checkout, or (None, None) without git: ``ditbook.runs.source_revision``,
    the revision every run records."""
    rev = source_revision(root)
    return rev["revision"], rev["dirty"]


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch here: no GPU either
        return False


def environment() -> dict:
    """The run's environment record (``ditbook.environment.environment``: versions and
    hardware), with the GPU named as the record's ``device`` and counted as ``gpus``."""
    env = run_environment()
    gpus = env["hardware"].get("gpus") or []
    return {"device": gpus[0] if gpus else "cpu", "gpus": len(gpus), "versions": env["versions"],
            "hardware": env["hardware"]}


def start_card(card: str, outputs: Path, log_dir: Path) -> tuple[subprocess.Popen, float, object]:
    run_id = "gpucheck-" + Path(card).stem
    log = open(log_dir / f"{Path(card).stem}.log", "w")  # noqa: SIM115 - closed in finish_card
    proc = subprocess.Popen([sys.executable, "-m", "ditbook", "run", card, "--outputs", str(outputs),
                             "--run-id", run_id], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, time.perf_counter(), log


def finish_card(card: str, proc: subprocess.Popen, t0: float, log, outputs: Path, timeout: float) -> dict:
    try:
        rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        rc = proc.wait()
        rc = f"timeout after {timeout:.0f} s"
    log.close()
    wall = round(time.perf_counter() - t0, 1)
    began = time.time() - wall  # the card's command started (wall clock)
    runs = sorted((outputs).glob(f"*/gpucheck-{Path(card).stem}/run.json"))
    rec = {"card": card, "exit": rc, "seconds": wall, "status": "not started", "stages": {}}
    if runs:
        run = json.loads(runs[-1].read_text())
        rec["status"] = run.get("status")
        rec["stages"] = {name: {"status": s.get("status"), "seconds": s.get("seconds"), "error": s.get("error")}
                         for name, s in run.get("stages", {}).items()}
        # where each stage's time went: the executed notebook's cells of a second or more
        for name, cells in run_cells(runs[-1].parent, min_seconds=1.0).items():
            if name in rec["stages"]:
                rec["stages"][name]["cells"] = cells
        rec["phases"] = phases(run.get("stages", {}), began, began + wall)
    return rec


def phases(stages: dict, began: float, ended: float) -> dict:
    """The card's time outside its stages: from the command's start to the first stage's, the gaps
    between one stage's end and the next one's start, and from the last stage's end to the command's."""
    spans = sorted((s["started"], s["started"] + s["seconds"]) for s in stages.values()
                   if s.get("started") is not None and s.get("seconds") is not None)
    if not spans:
        return {}
    return {"before_first_stage_s": round(spans[0][0] - began, 1),
            "between_stages_s": round(sum(b[0] - a[1] for a, b in zip(spans, spans[1:])), 1),
            "after_last_stage_s": round(ended - spans[-1][1], 1)}


def run_cards(cards, outputs: Path, log_dir: Path, timeout: float, one_at_a_time: bool = False) -> list[dict]:
    if one_at_a_time:
        return [finish_card(c, *start_card(c, outputs, log_dir), outputs, timeout) for c in cards]
    started = [(c, *start_card(c, outputs, log_dir)) for c in cards]
    return [finish_card(c, p, t0, log, outputs, timeout) for c, p, t0, log in started]


def run_benchmark(out: Path, repeats: int, timeout: float, tiny: bool) -> dict:
    """The composed rows at the FLUX.1-dev shape (``speedsuite.compose``), quality pass skipped."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "compose_gpu.py"), "--out", str(out), "--rows", BENCH_ROWS,
           "--repeats", str(repeats), "--no-quality"] + (["--tiny"] if tiny else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f} s", "command": " ".join(cmd[1:])}
    (out / "compose.log").write_text(proc.stdout + proc.stderr)
    rec = {"status": "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})",
           "seconds": round(time.perf_counter() - t0, 1), "command": "python3 " + " ".join(
               str(Path(c).relative_to(REPO)) if c.startswith(str(REPO)) else c for c in cmd[1:])}
    found = out / "compose.json"
    if found.is_file():
        data = json.loads(found.read_text())
        rec["schedule"] = (data.get("schedule") or {}).get("name")
        rec["rows"] = benchmark_rows(data)
        rec["peaks"] = data.get("peaks")
        fl = data.get("flops") or {}
        rec["flops_per_call"] = {k: fl.get(k) for k in ("total", "gemm", "attention", "other")} if fl else None
    else:
        rec["tail"] = (proc.stdout + proc.stderr)[-2000:]
    return rec


def novel_command(name: str, root: Path, device: str | None = None) -> list[str]:
    """One novel model as ``make novel`` runs it (the card's defaults, on ``device`` when one is
    named: the GPU check runs them on the GPU), its outcome one JSON line."""
    return [sys.executable, "-m", "tests.novel.runs", name, "--root", str(root / name),
            *(["--device", device] if device else [])]


def start_novel(names, root: Path, log_dir: Path, jobs: int, timeout: float, command=None,
                device: str | None = None):
    """A generator-free scheduler: returns ``poll()``, which starts up to ``jobs`` models at once and,
    called until it returns the rows, one row per model: its outcome line (``tests/novel/runs.py``:
    status per stage, cache decision, plans, problems), or its status when it failed or ran past
    ``timeout`` seconds. CPU threads are capped at 2 per model (they may share the host with the cards)."""
    waiting, running, rows = list(names), {}, {}
    command = command or novel_command
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "lib"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}

    def poll(block: bool = False) -> list[dict] | None:
        while True:
            for name, (proc, t0, log) in list(running.items()):
                rc = proc.poll()
                late = time.perf_counter() - t0 > timeout
                if rc is None and not late:
                    continue
                if rc is None:
                    os.killpg(proc.pid, 15)
                    proc.wait()
                log.close()
                text = (log_dir / f"novel-{name}.log").read_text(errors="replace")
                line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("{")), None)
                row = {"model": name, "seconds": round(time.perf_counter() - t0, 1)}
                if late:
                    progress = [ln for ln in text.splitlines() if ln.startswith("[novel ")]
                    row["status"] = f"timeout after {timeout:.0f} s"
                    row["reached"] = progress[-1] if progress else "nothing finished"
                elif line is None:
                    row.update(status=f"failed (exit {rc})", tail=text[-1500:])
                else:
                    out = json.loads(line)
                    row.update(status="finished" if set(out.get("stages", {}).values()) == {"passed"}
                               else "not finished", **{k: out.get(k) for k in ("stages", "errors", "cache", "plans",
                                                                               "not_run", "problems")})
                rows[name] = row
                del running[name]
            while waiting and len(running) < jobs:
                name = waiting.pop(0)
                log = open(log_dir / f"novel-{name}.log", "w")  # noqa: SIM115 - closed above
                proc = subprocess.Popen(command(name, root, device), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
                running[name] = (proc, time.perf_counter(), log)
            if not running:
                return [rows[n] for n in names]
            if not block:
                return None
            time.sleep(1.0)
    return poll


def novel_names(ap, spec: str) -> list[str]:
    sys.path.insert(0, str(REPO / "tests"))
    from novel import suite

    names = list(suite.MODELS) if spec == "all" else spec.split(",")
    unknown = [n for n in names if n not in suite.MODELS]
    if unknown:
        ap.error(f"--novel: no novel model {', '.join(unknown)} (tests/novel/ has {', '.join(suite.MODELS)})")
    return names


def novel_runner(args, names: list[str], work: Path):
    """``start_novel`` for the models ``names`` with the command line's settings."""
    return start_novel(names, work / "novel", work / "logs", args.novel_jobs, args.novel_timeout,
                       device=args.novel_device)


def record_passed(record: dict) -> bool:
    """Every card finished, the benchmark passed, and the novel suite (where run) finished clean."""
    return (all(c["status"] == "finished" for c in record.get("cards", []))
            and (record.get("benchmark") or {}).get("status") == "passed"
            and (record.get("novel") or {}).get("passed", True))


def print_novel(rows: list[dict]) -> None:
    for r in rows:
        print("novel", r["model"], r["status"], r["seconds"], r.get("reached") or r.get("problems") or "")


def novel_part(args, rows: list[dict]) -> dict:
    return {"command": f"--novel {args.novel} --novel-jobs {args.novel_jobs} --novel-timeout "
                       f"{args.novel_timeout:.0f}" + (f" --novel-device {args.novel_device}" if args.novel_device else "")
                       + (" --novel-beside-cards" if args.novel_beside_cards else "")
                       + " (python -m tests.novel.runs NAME)",
            "device": args.novel_device or "the cards' own (cpu)",
            "models": rows, "passed": all(r["status"] == "finished" and not r.get("problems") for r in rows)}


def novel_only(ap, args, rev) -> int:
    """``--novel-only``: the novel suite alone on the machine (all its cores), its outcomes added to a
    record made on this same code. A record of other code is refused: the parts would not agree."""
    if not args.novel:
        ap.error("--novel-only needs --novel (all, or names)")
    if not args.record.is_file():
        ap.error(f"--novel-only adds to a record: there is none at {args.record}; run the check first")
    record = json.loads(args.record.read_text())
    if record.get("tree_digest") != tree_digest():
        ap.error(f"{args.record} was made on other code than this tree (its digest differs): run the whole "
                 "check here, with --novel, instead")
    names = novel_names(ap, args.novel)
    work = args.work or args.record.parent / "gpu-check-work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = novel_runner(args, names, work)(block=True)
    env = environment()
    record["novel"] = {**novel_part(args, rows), "run": "alone, after the cards and the benchmark (--novel-only)",
                       "revision": args.revision or rev,
                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "machine": env.get("device"), "seconds": round(time.perf_counter() - t0, 1)}
    record["passed"] = record_passed(record)
    write_record(args.record, record)
    print_novel(rows)
    return 0 if record["novel"]["passed"] else 1


GAP_KEYS = ("computed_step_s", "at_bf16_peak_s", "of_bf16_peak", "at_fp8_peak_s", "of_fp8_peak")


def benchmark_rows(result: dict) -> list[dict]:
    """Per row: the median end-to-end seconds, their spread, the computed transformer step, peak
    memory, the speed-up against the eager row of the same process, and the gap to the measured
    peak (``speedsuite.gap``: the computed step's time beside its FLOPs at the bf16 / fp8 peak)."""
    rows = []
    for r in result.get("rows", []):
        t = r.get("timing") or {}
        e2e, step = t.get("end_to_end") or {}, (t.get("parts") or {}).get("transformer_step") or {}
        rows.append({"row": r.get("row"), "status": r.get("status"), "end_to_end_s": e2e.get("median"),
                     "min_s": e2e.get("min"), "max_s": e2e.get("max"), "n": e2e.get("n"),
                     "transformer_step_s": step.get("median"), "speedup": r.get("speedup"),
                     "first_call_s": r.get("first_call_s"), "peak_memory_mb": t.get("peak_memory_mb"),
                     **{k: (r.get("gap") or {}).get(k) for k in GAP_KEYS}})
    return rows


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", type=Path, default=REPO / "docs" / "gpu-check.json", help="where the record goes")
    ap.add_argument("--work", type=Path, default=None, help="run folders and logs (default: a folder beside the record)")
    ap.add_argument("--revision", default=os.environ.get("DITBOOK_REVISION"),
                    help="the commit checked, for a copy without its git folder (default: git HEAD, clean tree)")
    ap.add_argument("--cards", default=",".join(CARDS))
    ap.add_argument("--card-timeout", type=float, default=420.0)
    ap.add_argument("--side-by-side", action="store_true",
                    help="run the cards at once (sharing the GPU), not one after the other")
    ap.add_argument("--one-at-a-time", action="store_true", help="one after the other (the default)")
    ap.add_argument("--bench-timeout", type=float, default=240.0)
    ap.add_argument("--no-bench", action="store_true", help="the cards only (a profile of the stages, not a record to commit)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the benchmark at a tiny FLUX shape (for a CPU try-out)")
    ap.add_argument("--bench-beside-cards", action="store_true",
                    help="start the benchmark with the cards, not after them (a shorter check on little device "
                         "time; its timings share the GPU with the cards' tiny models and are marked so)")
    ap.add_argument("--novel", default="", help="the novel-model suite, after the cards: 'all' or names "
                    "(tests/novel/; each as `make novel` runs it); their outcomes go in the record")
    ap.add_argument("--novel-jobs", type=int, default=4, help="novel models run at once")
    ap.add_argument("--novel-beside-cards", action="store_true",
                    help="start the novel models with the cards, not after them (shorter; the cards' times then "
                         "include the shared CPUs: at 13 jobs on 16 cores the models ran past 250 s)")
    ap.add_argument("--novel-timeout", type=float, default=420.0, help="seconds per novel model")
    ap.add_argument("--novel-device", default="cuda" if _cuda() else None,
                    help="runtime.device of the novel models (default: cuda where torch sees a GPU, else the "
                         "cards' own, cpu)")
    ap.add_argument("--novel-only", action="store_true",
                    help="run only the novel suite and add its outcomes to the record at --record, which must "
                         "have been made on this same code (its tree digest); the cards' and the benchmark's "
                         "parts stay as they were")
    args = ap.parse_args(argv)
    rev, dirty = git_revision()
    if args.revision is None:
        if rev is None:
            ap.error("no git folder here: name the commit checked with --revision (or DITBOOK_REVISION)")
        if dirty:
            ap.error(f"the tree has uncommitted changes to tracked files: commit them first (HEAD {rev})")
    if args.novel_only:
        return novel_only(ap, args, rev)
    work = args.work or args.record.parent / "gpu-check-work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    record = {"revision": args.revision or rev, "tree_digest": tree_digest(), "digest_of": list(DIGEST_PARTS),
              "digest_method": DIGEST_METHOD,
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **environment(),
              "command": "make gpu-check"}
    if args.side_by_side and args.one_at_a_time:
        ap.error("--side-by-side or --one-at-a-time, not both")
    record["cards_run"] = "side by side" if args.side_by_side else "one at a time"
    novel = None
    if args.novel:
        names = novel_names(ap, args.novel)
        if args.novel_beside_cards:
            novel = novel_runner(args, names, work)
            novel()  # the first models start beside the cards
    bench = None
    if args.bench_beside_cards and not args.no_bench:
        import concurrent.futures as cf

        bench = cf.ThreadPoolExecutor(1).submit(run_benchmark, work / "compose", args.repeats, args.bench_timeout,
                                                args.tiny)
    record["cards"] = run_cards(args.cards.split(","), work / "outputs", work / "logs", args.card_timeout,
                                not args.side_by_side)
    if args.novel:
        # after the cards (unless beside them): their times are not shared with the suite's
        rows = (novel or novel_runner(args, names, work))(block=True)
        record["novel"] = {**novel_part(args, rows),
                           "run": "beside the cards" if args.novel_beside_cards else "after the cards"}
    write_record(args.record, record)  # the cards' part kept even if the benchmark never returns
    if args.no_bench:  # a profile of the stages: never a record that passes
        record["benchmark"] = {"status": "not run (--no-bench)"}
    else:
        record["benchmark"] = {"shape": "FLUX.1-dev, 1024x1024, 28 steps, bf16, random weights" if not args.tiny else "tiny",
                               "repeats": args.repeats, **({"beside_cards": "timed while the cards ran on the same GPU"}
                                                           if bench is not None else {}),
                               **(bench.result() if bench is not None else
                                  run_benchmark(work / "compose", args.repeats, args.bench_timeout, args.tiny))}
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["passed"] = record_passed(record)
    write_record(args.record, record)
    print(json.dumps({k: record[k] for k in ("revision", "device", "seconds", "passed")}))
    for c in record["cards"]:
        print(c["card"], c["status"], c["seconds"], {k: (v["status"], v["seconds"]) for k, v in c["stages"].items()})
    print_novel((record.get("novel") or {}).get("models", []))
    return 0 if record["passed"] or args.no_bench else 1


if __name__ == "__main__":
    raise SystemExit(main())
