"""The cache stage's checks on a small model class written in a test, without the coverage probe
(``ditbook.coverage`` builds and feeds every diffusers class; a stage test names its own inputs):
build ``cls()``, trace it, build the cache adapter, run DBCache with caching off (every step equal to
the plain forward) and on (block evaluations really skipped)."""

from __future__ import annotations

import contextlib
import io
import traceback
from dataclasses import dataclass, field

import torch

from ditbook import accel
from ditbook.adapter.build import CacheRefused, build_cache_adapter, run_time_refusals
from ditbook.adapter.loopfold import FoldError
from ditbook.arch.static import inspect_transformer
from ditbook.arch.trace import trace_calls

STEPS = 6
TOLERANCE = 1e-5


@dataclass
class Row:
    outcome: str = "crash"  # correct / refused / crash / wrong
    reason: str = ""
    stage: str = "inspect"
    block_lists: list[str] = field(default_factory=list)
    folded: bool = False
    off_max_abs: float | None = None
    skipped: str = ""  # "k of n block evaluations"


def default_inputs(model) -> dict:
    """A latent sequence of the model's ``in_channels`` and a timestep (the tests' models' signature)."""
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(1, 8, model.config.in_channels, generator=g), "timestep": torch.tensor([500.0])}


class StepsPipeline:
    """``pipe(num_inference_steps=n)``: ``n`` transformer calls with slowly changing inputs, every
    step's output returned (a class per model: cache-dit patches the pipeline class's ``__call__``)."""

    def __init__(self, transformer, kwargs: dict):
        self.transformer, self.kwargs = transformer, kwargs

    def __call__(self, num_inference_steps: int = STEPS, **_):
        outs = []
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            for i in range(num_inference_steps):
                kw = dict(self.kwargs, hidden_states=self.kwargs["hidden_states"] * (1.0 - 0.001 * i),
                          timestep=self.kwargs["timestep"] - 5.0 * i)
                out = self.transformer(**kw)
                outs.append((out[0] if isinstance(out, (tuple, list)) else out).clone())
        return outs


def _cached(pipe, adapter, cfg, steps: int):
    handle = accel.get("dbcache").apply(pipe, cfg, adapter=adapter, steps=steps)
    try:
        return pipe(steps), handle.record().block_evals
    finally:
        handle.undo()


def _check(cls, row: Row, inputs: dict | None, steps: int) -> None:
    torch.manual_seed(0)
    model = cls().float().eval()
    kwargs = inputs or default_inputs(model)
    report = inspect_transformer(model, None, support=False)
    with contextlib.redirect_stdout(io.StringIO()):
        report = trace_calls(model, lambda: model(**kwargs), report=report)
    row.block_lists = [f"{b.path} x{b.length}" for b in report.block_lists]
    pipe = type(f"Steps{cls.__name__}", (StepsPipeline,), {})(model, kwargs)
    plain = pipe(steps)
    row.stage = "adapter"
    adapter = build_cache_adapter(pipe, report, f"harness_{cls.__name__}")
    row.folded = bool(adapter.info.patch_functor)
    strat = accel.get("dbcache")
    row.stage = "cache-off"
    off, total = _cached(pipe, adapter, strat.disabled(adapter, steps), steps)
    row.off_max_abs = max(float((a - b).abs().max()) for a, b in zip(off, plain))
    if not row.off_max_abs <= TOLERANCE:
        row.outcome, row.reason = "wrong", f"caching off differs from the plain forward: max abs {row.off_max_abs:.3g}"
        return
    row.stage = "cache-on"
    outs, ran = _cached(pipe, adapter, strat.Settings(Fn=1, Bn=0, threshold=1.0, max_warmup_steps=1), steps)
    row.skipped = f"{total - ran} of {total}"
    if not all(torch.isfinite(o).all() for o in outs) or ran >= total:
        row.outcome, row.reason = "wrong", f"caching on: finite {all(torch.isfinite(o).all() for o in outs)}, ran {ran} of {total}"
    else:
        row.outcome, row.stage = "correct", ""


def cache_check(cls, inputs: dict | None = None, steps: int = STEPS) -> Row:
    """The row of ``cls`` (see the module docstring): a named refusal (``CacheRefused``,
    ``FoldError``) is ``refused``, any other exception ``crash`` with its type, message and place."""
    row = Row()
    try:
        _check(cls, row, inputs, steps)
    except (CacheRefused, FoldError, *run_time_refusals()) as exc:
        row.outcome, row.reason = "refused", str(exc).splitlines()[0][:300]
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        row.outcome, row.reason = "crash", f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})"
    return row
