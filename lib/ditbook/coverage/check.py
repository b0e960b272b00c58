"""The per-class check of the coverage probe (``check_class``): build and inputs, traced
inspection, the cache adapter with caching off and on, and the CP column (``coverage.cp``);
``run_coverage``, ``totals`` and the markdown table."""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import asdict, dataclass, field

import torch

from .build import Refused, _summary, transformer_classes
from .inputs import first_tensor, tiny_with_inputs

STEPS = 6
TOLERANCE = 1e-5


@dataclass
class ClassOutcome:
    name: str
    outcome: str  # correct / refused / crash / wrong
    reason: str = ""
    stage: str = ""  # where it stopped: build / inputs / inspect / adapter / cache-off / cache-on
    factor: int | None = None
    block_lists: list[str] = field(default_factory=list)
    folded: bool = False
    used: str = ""
    off_max_abs: float | None = None
    skipped: str = ""  # "k of n block evaluations"
    cp: str = "not run"
    cp_reason: str = ""
    seconds: float = 0.0
    setup: str = ""  # what the probe set beyond the class's defaults and the shrink rules (a setting, a state input)

    def to_dict(self) -> dict:
        return asdict(self)


def _perturbed(kwargs: dict, step: int, hidden_name: str) -> dict:
    """Step ``step`` of a slowly changing sequence: the image stream drifts by 0.1% a step and
    the timestep decreases."""
    out = dict(kwargs)
    h = kwargs[hidden_name]
    out[hidden_name] = [x * (1.0 - 0.001 * step) for x in h] if isinstance(h, list) else h * (1.0 - 0.001 * step)
    for k, v in kwargs.items():
        if "timestep" in k.lower() and isinstance(v, torch.Tensor) and v.is_floating_point():
            out[k] = v - 5.0 * step
    return out


def _steps_pipeline(transformer, kwargs: dict, hidden_name: str):
    """A minimal pipeline object for cache-dit: ``pipe(num_inference_steps=n)`` calls the
    transformer ``n`` times with slowly changing inputs and returns every step's main output."""

    class CoveragePipeline:  # a class per call: cache-dit patches the pipeline class's __call__
        def __init__(self, transformer):
            self.transformer = transformer

        def __call__(self, num_inference_steps: int = STEPS, **_):
            outs = []
            with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
                for i in range(num_inference_steps):
                    outs.append(first_tensor(self.transformer(**_perturbed(kwargs, i, hidden_name))).clone())
            return outs

    return CoveragePipeline(transformer)


def _refusal_types() -> tuple:
    from ..adapter.build import CacheRefused, run_time_refusals
    from ..adapter.loopfold import FoldError

    return (Refused, CacheRefused, FoldError, *run_time_refusals())


def check_class(cls: type, steps: int = STEPS, cp: bool = True) -> ClassOutcome:
    """Run the stages' checks on a tiny instance of ``cls`` (see the module docstring)."""
    row = ClassOutcome(cls.__name__, "crash")
    start = time.perf_counter()
    try:
        model, kwargs = _check_cache(cls, steps, row)
    except _refusal_types() as exc:
        row.outcome, row.reason = "refused", str(exc).splitlines()[0][:300]
        return row
    except Exception as exc:
        row.outcome, row.reason = "crash", _summary(exc)
        return row
    finally:
        row.seconds = round(time.perf_counter() - start, 2)
    if row.outcome != "correct":
        return row
    if cp:
        row.cp, row.cp_reason = run_cp(model, kwargs)
    row.seconds = round(time.perf_counter() - start, 2)
    return row


def _check_cache(cls: type, steps: int, row: ClassOutcome):
    """Build, inspect, adapt and run caching off and on, filling ``row`` (``row.stage`` names the
    stage a refusal or crash happens in; "wrong" keeps it); returns (model, inputs)."""
    from .. import accel
    from ..adapter.build import build_cache_adapter

    model, kwargs, report, pipe = _inspected_pipeline(cls, row)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        plain = pipe(steps)
    row.stage = "adapter"
    adapter = build_cache_adapter(pipe, report, f"coverage_{cls.__name__}")
    row.folded = bool(adapter.info.patch_functor)
    row.used = adapter.info.used
    strat = accel.get("dbcache")
    row.stage = "cache-off"
    off = _run_cached(pipe, adapter, strat, strat.disabled(adapter, steps), steps)
    diff = max(float((a - b).abs().max()) for a, b in zip(off[0], plain))
    row.off_max_abs = diff
    if not diff <= TOLERANCE:
        row.outcome = "wrong"
        row.reason = f"caching off differs from the plain forward: max abs {diff:.3g} > {TOLERANCE:g}"
        return model, kwargs
    row.stage = "cache-on"
    on_cfg = strat.Settings(Fn=1, Bn=0, threshold=1.0, max_warmup_steps=1)
    outs, record = _run_cached(pipe, adapter, strat, on_cfg, steps)
    total, ran = off[1].block_evals, record.block_evals
    row.skipped = f"{total - ran} of {total}"
    if not all(torch.isfinite(o).all() for o in outs):
        row.outcome, row.reason = "wrong", "caching on gave non-finite outputs"
    elif ran >= total:
        row.outcome, row.reason = "wrong", f"caching on skipped no block evaluation ({ran} of {total} ran)"
    else:
        row.outcome, row.stage = "correct", ""
    return model, kwargs


def _inspected_pipeline(cls: type, row: ClassOutcome):
    """The build+inputs and inspect stages: (model, inputs, traced report, steps pipeline)."""
    from ..arch.static import inspect_transformer
    from ..arch.trace import trace_calls

    row.stage = "build+inputs"
    model, row.factor, kwargs = tiny_with_inputs(cls)
    row.setup = getattr(model, "coverage_setup", "")
    # the image stream: the first floating tensor input (a first parameter may be a list of conditioning pairs)
    hidden_name = next((k for k, v in kwargs.items() if _float_tensors(v)), next(iter(kwargs)))
    row.stage = "inspect"
    report = inspect_transformer(model, None, support=False)
    with contextlib.redirect_stdout(io.StringIO()):
        report = trace_calls(model, lambda: model(**kwargs), report=report)
    row.block_lists = [f"{b.path} x{b.length}" for b in report.block_lists]
    if report.block_lists and max(b.length for b in report.block_lists) < 2:
        raise Refused("every block list has a single block: a block cache always computes it, nothing to skip")
    return model, kwargs, report, _steps_pipeline(model, kwargs, hidden_name)


def _float_tensors(v) -> bool:
    """A float tensor, or a list of them (one per sample)."""
    if isinstance(v, list):
        return bool(v) and all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _run_cached(pipe, adapter, strat, cfg, steps: int):
    """The outputs of ``steps`` calls with the cache on, and its record (block evaluations that ran)."""
    handle = strat.apply(pipe, cfg, adapter=adapter, steps=steps)
    try:
        return pipe(steps), handle.record()
    finally:
        handle.undo()


def run_cp(model, kwargs) -> tuple[str, str]:
    """The CP column: ``coverage.cp.coverage_cp`` (imported on use: it forks gloo processes)."""
    try:
        from . import cp
    except Exception as exc:
        return "not run", f"ditbook.coverage.cp does not import: {exc}"
    try:
        res = cp.coverage_cp(model, (), dict(kwargs))
        return str(res.get("outcome", "?")), str(res.get("reason", ""))
    except Exception as exc:
        return "crash", _summary(exc)


def run_coverage(classes: list[type] | None = None, progress=None, cp: bool = True) -> list[ClassOutcome]:
    rows = []
    for cls in classes if classes is not None else transformer_classes():
        row = check_class(cls, cp=cp)
        rows.append(row)
        if progress:
            progress(row)
    return rows


def totals(rows: list[ClassOutcome]) -> dict:
    out = {k: 0 for k in ("correct", "refused", "crash", "wrong")}
    for r in rows:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def _versions() -> dict:
    import cache_dit
    import diffusers

    from .. import __version__

    return {"ditbook": __version__, "diffusers": diffusers.__version__,
            "cache-dit": getattr(cache_dit, "__version__", "?"), "torch": torch.__version__}


def markdown(rows: list[ClassOutcome], seconds: float | None = None, command: str = "") -> str:
    t = totals(rows)
    n = len(rows) or 1
    v = _versions()
    lines = ["# Coverage: diffusers transformer classes through ditbook", "",
             "Generated by `python benchmarks/coverage.py`" + (f" ({command})" if command else "") + "; "
             "do not edit by hand. Every transformer class the installed diffusers exports, built tiny "
             "and random (fp32, CPU), run through traced inspection, the automatic cache adapter with caching "
             f"off (max abs diff <= {TOLERANCE:g} against the plain forward, {STEPS} steps) and on (same "
             "steps with slowly changing inputs: finite, block evaluations skipped). See "
             "`lib/ditbook/coverage/` for the rules.", "",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
             f"Totals ({len(rows)} classes): " + ", ".join(f"**{k}** {c} ({c / n:.0%})" for k, c in t.items()) + "."]
    probe = sum(1 for r in rows if r.outcome == "refused" and r.stage == "build+inputs")
    if t["refused"]:
        lines.append(f"Of the refused, {probe} are refusals of this probe (it could not build the class small or "
                     f"make inputs that run its forward: stage `build+inputs`), {t['refused'] - probe} are "
                     f"refusals by ditbook's integration (inspection/adapter found no safe way to cache).")
    if seconds is not None:
        lines.append(f"Wall time of this run: {seconds:.0f} s.")
    lines += ["", "| class | outcome | stage | reason | block lists | folded | caching off max abs | skipped | cp | s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reason = (r.reason or (f"probe setup: {r.setup}" if r.setup else "")).replace("|", "\\|").replace("\n", " ")
        cp = r.cp + (f": {r.cp_reason}" if r.cp_reason and r.cp != "not run" else "")
        off = "" if r.off_max_abs is None else f"{r.off_max_abs:.1e}"
        lines.append(f"| {r.name} | {r.outcome} | {r.stage} | {reason} | {', '.join(r.block_lists)} | "
                     f"{'yes' if r.folded else ''} | {off} | {r.skipped} | {cp.replace('|', '/')} | {r.seconds} |")
    return "\n".join(lines) + "\n"


