"""The GPU part of the equal-quality comparison: every peer point and every dominating ditbook point
of ``docs/pareto_quality.json`` (its ``to_time`` list) timed at the FLUX.1-dev shape in ONE process,
eager and optionally compiled (regional), against the eager pipeline of the same process.

    python3 benchmarks/pareto_gpu.py --out OUT [--compile]              # one H200: 1024², 28 steps, bf16
    python3 benchmarks/pareto_gpu.py --out OUT --tiny --device cpu      # the same code on a CPU, for checking

Random weights decide differently from the reference model, so each point is timed in its *timing
form* (``speedsuite.pareto.timing_form``, recorded in the quality file with ``how``): cache-dit's
dynamic SCM as cache-dit's DBCache with the steps it fully computed on the reference model as a
static mask; FirstBlockCache with diffusers' real hooks and the head hook's decision forced to the
recorded one (its residual test still runs); MagCache as configured (its decisions depend on the
ratios and the step only); ditbook's static masks as they are. Before a point is timed, one call
runs with every block counted (``EvalCounter``, installed before the cache): the pattern of
full / partial / skipped transformer calls must equal the one recorded on the reference model
(``pattern_ok``), so the timed work is the work whose quality was measured (checked in the eager
pass; the compiled pass applies the same configurations). That counted call is the warm-up; then ``--repeats`` timed calls (median, min, max). Compiled: the repeated blocks are
compiled once (``compile_repeated_blocks`` through ``ditbook.accel.compile.compile_regions``,
fullgraph False: diffusers' cache hooks have ``torch.compiler.disable``d parts — MagCache's whole
hook forward, FirstBlockCache's decision — so with them the blocks may run partly outside the
compiled regions; measured as it is), then each point: first call timed apart (recompiles), then
the timed calls. A time budget
(``--budget-s``) marks the rows it leaves out as ``skipped`` rather than running past it.

Writes ``OUT/pareto_speed.json`` and ``OUT/pareto_speed.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .fullsize import flux_pipeline
from .pareto import apply_point, pattern_of, transformer_blocks, work_of
from .suite import _dump, _log, environment
from ditbook.timing import time_pipeline

REPO = Path(__file__).resolve().parents[2]
EAGER = {"name": "eager", "owner": "baseline", "kind": "none", "params": {}, "how": "the pipeline as built"}


def _apply(pipe, point: dict):
    return (lambda: None) if point["kind"] == "none" else apply_point(pipe, point)


def counted_call(fp, point: dict, steps: int) -> dict:
    """One call with every block counted (the counter goes on before the cache); the pattern."""
    from ditbook.adapter.counting import EvalCounter

    tr = fp.pipe.transformer
    blocks = transformer_blocks(tr)
    counter = EvalCounter(tr, blocks)
    try:
        undo = _apply(fp.pipe, point)
        try:
            with torch.inference_mode():
                fp()
        finally:
            undo()
    finally:
        counter.remove()
    got = pattern_of(counter.calls, len(blocks))
    expected = point.get("expected_pattern", "F" * steps)
    return {"pattern": got, "expected_pattern": expected, "pattern_ok": got == expected,
            "work": round(work_of(counter.calls, len(blocks)), 4), "blocks": len(blocks)}


def timed(fp, point: dict, repeats: int, first_apart: bool) -> dict:
    undo = _apply(fp.pipe, point)
    row: dict = {}
    try:
        if first_apart:
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                fp()
            sync()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
        t = time_pipeline(fp.pipe, fp, warmup=0, repeats=repeats)
    finally:
        undo()
    row["timing"] = t.to_dict()
    row["median_s"] = t.end_to_end.median
    return row


def pair_order(points: list[dict], pairs: list[dict]) -> list[dict]:
    """Each peer followed by its ditbook point, so a budget cut leaves whole pairs measured."""
    by_name = {p["name"]: p for p in points}
    names: list[str] = []
    for pair in pairs:
        names += [n for n in (pair.get("peer"), pair.get("ditbook")) if n in by_name and n not in names]
    return [by_name[n] for n in names] + [p for p in points if p["name"] not in names]


def _dynamo_stats() -> dict:
    """dynamo's global counters (frames compiled, graph breaks, ...), to show recompiles per row."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {f"{group}.{k}": v for group in ("stats", "frames") for k, v in counters.get(group, {}).items()}


def _row(point: dict, mode: str) -> dict:
    return {"name": point["name"], "owner": point["owner"], "kind": point["kind"], "mode": mode,
            "how": point.get("how", ""), "params": {k: v for k, v in point["params"].items() if k != "mag_ratios"}}


def run(out: Path, *, quality_file: Path, tiny: bool = False, device: str = "cuda", size: int | None = None,
        repeats: int = 3, compile: bool = False, compile_backend: str = "inductor", budget_s: float = 480.0,
        names: list[str] | None = None) -> dict:
    q = json.loads(Path(quality_file).read_text())
    steps = q["steps"]
    points = [p for p in q["to_time"] if not names or p["name"] in names]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    size = size or (64 if tiny else 1024)
    scale = "tiny" if tiny else "full"
    t_start = time.perf_counter()
    result: dict = {"command": "pareto_gpu", "quality_file": str(quality_file), "shape": f"flux-{scale}",
                    "size": size, "steps": steps, "device": device, "dtype": str(dtype), "repeats": repeats,
                    "compile": compile, "compile_backend": compile_backend, "budget_s": budget_s,
                    "env": environment(), "rows": []}
    _log(f"pareto: FLUX shape {scale}, {size}², {steps} steps, {device}, {dtype}; {len(points)} points")
    fp = flux_pipeline(scale, device, dtype, height=size, width=size, steps=steps,
                       **({"text_tokens": 32} if tiny else {}))
    result["transformer_params"] = fp.transformer_params

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget_s

    for point in [EAGER] + pair_order(points, q.get("pairs") or []) + [{**EAGER, "name": "eager-again"}]:
        row = _row(point, "eager")
        if over_budget() and point["name"] != "eager":
            row.update(status="skipped", reason=f"time budget {budget_s:.0f} s spent")
        else:
            try:
                row.update(counted_call(fp, point, steps))  # also the warm-up of this point
                row.update(timed(fp, point, repeats, first_apart=False), status="measured")
                _log(f"  {point['name']:52s} {row['median_s']:8.3f}s  pattern "
                     f"{'ok' if row['pattern_ok'] else 'DIFFERS'} {row['pattern']}")
            except Exception as exc:  # one point that cannot run is a row with its reason, not a lost run
                row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
                _log(f"  {point['name']} failed: {row['reason']}")
        result["rows"].append(row)
        _dump(out / "pareto_speed.json", result)
    if compile:
        from ditbook.accel.compile import compile_regions

        _log("compiling the repeated blocks (regional torch.compile)")
        t0 = time.perf_counter()
        undo_compile, method, regions = compile_regions(fp.pipe.transformer, backend=compile_backend, fullgraph=False)
        result["compile_method"] = {"method": method, "regions": regions}
        order = [EAGER] + pair_order(points, q.get("pairs") or [])
        for point in order:
            row = _row(point, "compiled")
            if over_budget():
                row.update(status="skipped", reason=f"time budget {budget_s:.0f} s spent")
            else:
                try:
                    before = _dynamo_stats()
                    row.update(timed(fp, point, repeats, first_apart=True), status="measured")
                    row["dynamo"] = {k: v - before.get(k, 0) for k, v in _dynamo_stats().items() if v != before.get(k, 0)}
                    _log(f"  {point['name'] + ' (compiled)':52s} {row['median_s']:8.3f}s  first call "
                         f"{row['first_call_s']:.1f}s")
                except Exception as exc:  # a compile failure is a row with its reason, not a lost run
                    row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
                    _log(f"  {point['name']} (compiled) failed: {row['reason']}")
            if point is EAGER:
                result["compile_s"] = round(time.perf_counter() - t0, 1)
            result["rows"].append(row)
            _dump(out / "pareto_speed.json", result)
        undo_compile()
    for mode in ("eager", "compiled"):
        base = next((r for r in result["rows"] if r["mode"] == mode and r["name"] == "eager"
                     and r["status"] == "measured"), None)
        for r in result["rows"]:
            if r["mode"] == mode and r["status"] == "measured" and base:
                r["speedup_vs_eager"] = round(base["median_s"] / r["median_s"], 3)
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    _dump(out / "pareto_speed.json", result)
    (out / "pareto_speed.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = [f"# Peers and ditbook, timed — {result['shape']}, {result['size']}², {result['steps']} steps, "
             f"{result['device']}, {result['dtype']}", "",
             f"{result['repeats']} timed calls per row after a counted warm-up call; versions "
             f"{result['env'].get('versions')}; GPUs {result['env'].get('gpus', 'none')}; total "
             f"{result.get('total_seconds')} s.", "",
             "| point | mode | median s (min–max) | vs eager | first call s | pattern on this shape = reference | how timed |",
             "| --- | --- | --- | ---: | ---: | --- | --- |"]
    for r in result["rows"]:
        if r["status"] != "measured":
            lines.append(f"| {r['name']} | {r['mode']} | {r['status']}: {r.get('reason', '')} | | | | |")
            continue
        e = r["timing"]["end_to_end"]
        pat = "" if r["mode"] == "compiled" else ("yes" if r.get("pattern_ok") else f"NO: {r.get('pattern')}")
        first = f"{r['first_call_s']:.1f}" if "first_call_s" in r else ""
        lines.append(f"| {r['name']} | {r['mode']} | {e['median']:.3f} ({e['min']:.3f}–{e['max']:.3f}) | "
                     f"{r.get('speedup_vs_eager', 0):.2f}× | {first} | {pat} | {r['how']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quality", type=Path, default=REPO / "docs" / "pareto_quality.json",
                    help="benchmarks/pareto.py's output: the points to time (to_time)")
    ap.add_argument("--tiny", action="store_true", help="tiny FLUX shape (1+2 blocks, 4 heads), 64² unless --size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time every point with regional compile")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--budget-s", type=float, default=480.0, help="rows left when this is spent are marked skipped")
    ap.add_argument("--points", default="", help="comma-separated names of to_time (default: all)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    res = run(a.out, quality_file=a.quality, tiny=a.tiny, device=a.device, size=a.size, repeats=a.repeats,
              compile=a.compile, compile_backend=a.compile_backend, budget_s=a.budget_s,
              names=[n for n in a.points.split(",") if n] or None)
    print((a.out / "pareto_speed.md").read_text())
    bad = [r["name"] for r in res["rows"] if r["mode"] == "eager" and r["status"] == "measured" and not r["pattern_ok"]]
    if bad:
        print(f"patterns differ from the reference model's for {bad}: their times are not the measured work")
    failed = [f"{r['name']} ({r['mode']})" for r in res["rows"] if r["status"] == "failed"]
    if failed:
        print(f"failed: {failed}")
    return 1 if bad or failed else 0
