"""Verification of a cache strategy against baseline images, with counted savings: ``evaluate``
(one configuration's quality and skipped evaluations) and ``noise_floor`` (the baseline re-run,
and under another attention backend).
"""

from __future__ import annotations

import contextlib
import time
import traceback

import numpy as np

from ..quality import Gates, compare, compare_sets
from ..records import StrategyRow
from ..render import render_all
from .. import accel
from ..adapter.counting import EvalCounter


def render_set(pipe, card, prompts, seeds, **overrides) -> dict:
    return {r.key: r.image for r in render_all(pipe, card, prompts=prompts, seeds=seeds, **overrides)}


def save_images(folder, images: dict) -> None:
    """Each image as ``<folder>/<key>.npy`` (float32)."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, img in images.items():
        np.save(folder / f"{key}.npy", np.asarray(img, dtype=np.float32))


def counted_render(pipe, card, adapter, prompts, seeds, **overrides) -> tuple[dict, dict]:
    """Render with every original block and attention module counted."""
    counter = EvalCounter(pipe.transformer, adapter.counted_blocks())
    try:
        images = render_set(pipe, card, prompts, seeds, **overrides)
        return images, counter.snapshot()
    finally:
        counter.remove()


class _CaseFailed(Exception):
    pass


def render_until_failure(pipe, card, prompts, seeds, references: dict, gates: Gates) -> tuple[dict, str | None]:
    """Render the cases in order, stopping at the first that fails a gate (one failing case fails the
    set). Returns (images rendered, why it stopped or None)."""
    images: dict = {}

    def check(done: int, total: int, r) -> None:
        images[r.key] = r.image
        report = compare(r.image, references[r.key], gates)
        if not report.passed and done < total:
            raise _CaseFailed(f"stopped at {r.key}, which failed the gates ({done} of {total} cases rendered)")

    try:
        render_all(pipe, card, prompts=prompts, seeds=seeds, progress=check)
    except _CaseFailed as exc:
        return images, str(exc)
    return images, None


def _partial(baseline_counts: dict, rendered: int, total: int) -> dict:
    """The uncached count of the cases rendered: every case runs the same steps, so a share."""
    share = rendered / total if total else 1.0
    return {**baseline_counts, "block_evals": baseline_counts["block_evals"] * share,
            "attention_evals": baseline_counts["attention_evals"] * share}


def evaluate(pipe, card, adapter, name: str, config, references: dict, baseline_counts: dict,
             gates: Gates, prompts, seeds, split: str = "calibration", keep_images: dict | None = None,
             stop_at_failure: bool = False) -> StrategyRow:
    """One configuration applied, the cases rendered and compared, the configuration removed.
    ``stop_at_failure``: stop at the first case that fails a gate."""
    strat = accel.get(name)
    start = time.perf_counter()
    handle, stopped = None, None
    try:
        handle = strat.apply(pipe, config, adapter=adapter, steps=card.generation.steps)
        if stop_at_failure:
            images, stopped = render_until_failure(pipe, card, prompts, seeds, references, gates)
        else:
            images = render_set(pipe, card, prompts, seeds)
        record = handle.record()
    except Exception as exc:  # a strategy that cannot run on this model is reported, not hidden
        return StrategyRow(name, strat.family, strat.settings_dict(config), None, 0.0, 0.0, 0, False, split,
                           time.perf_counter() - start, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
    finally:
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.undo()
    q = compare_sets(images, {k: references[k] for k in images} if stopped else references, gates)
    r = record.against(_partial(baseline_counts, len(images), len(references)) if stopped else baseline_counts)
    if keep_images is not None:
        keep_images.update(images)
    return StrategyRow(name, strat.family, strat.settings_dict(config), q, r.skipped_fraction,
                       r.attention_skipped_fraction, r.cached_steps, bool(q.passed) and not stopped, split,
                       round(time.perf_counter() - start, 3),
                       counts={"attention_skipped_fraction": r.attention_skipped_fraction,
                               "transformer_calls": r.transformer_calls, "block_evals": r.block_evals,
                               "baseline_block_evals": r.baseline_block_evals},
                       stopped=stopped)


def max_abs(images: dict, references: dict) -> float:
    return float(max(np.max(np.abs(np.asarray(images[k], np.float64) - np.asarray(references[k], np.float64)))
                     for k in references))


def other_attention_backend(pipe) -> str:
    """The backend the noise floor compares with: memory-efficient on a GPU, math SDPA on the CPU."""
    device = next((p.device for p in pipe.transformer.parameters()), None)
    return "_native_efficient" if device is not None and device.type == "cuda" else "_native_math"


def other_backend_render(pipe, card, prompts, seeds, backend: str | None = None) -> tuple[dict | None, str]:
    """Render under another diffusers attention backend (``other_attention_backend`` by default)."""
    backend = backend or other_attention_backend(pipe)
    try:
        from diffusers.models.attention_dispatch import attention_backend
    except ImportError as exc:
        return None, f"diffusers has no attention_backend context: {exc}"
    try:
        with attention_backend(backend):
            return render_set(pipe, card, prompts, seeds), backend
    except Exception as exc:
        return None, f"{backend}: {type(exc).__name__}: {exc}"


def noise_floor(pipe, card, adapter, intake: dict, gates: Gates, other_backend: bool = True) -> tuple[dict, dict, dict]:
    """(noise-floor summary, re-rendered baseline images, their block counts)."""
    gen = card.generation
    rerun, counts = counted_render(pipe, card, adapter, gen.prompts, gen.seeds)
    out = {"rerun_vs_intake": compare_sets(rerun, intake, gates).to_dict(),
           "rerun_max_abs": max_abs(rerun, intake)}
    if not other_backend:
        out["other_backend"] = "not measured"
        return out, rerun, counts
    other, backend = other_backend_render(pipe, card, gen.prompts, gen.seeds)
    out["other_backend"] = backend
    if other is not None:
        out["backend_vs_rerun"] = compare_sets(other, rerun, gates).to_dict()
        out["backend_max_abs"] = max_abs(other, rerun)
    return out, rerun, counts


class OrderDependentCache(RuntimeError):
    """A cache configuration renders a case differently alone than after another case (its state
    outlives a generation); the cache stage stops."""


def order_check(pipe, card, adapter, name: str, config, in_order: dict, prompts, seeds,
                tolerance: float | None = None) -> dict:
    """The last of ``in_order``'s cases rendered again alone with the strategy applied afresh (with one
    case: after the next seed's): the two must agree within ``tolerance`` (default the card's
    ``cache.reproduce_tolerance``), else ``OrderDependentCache``. Returns the record."""
    from ..render import cases

    tolerance = card.cache.reproduce_tolerance if tolerance is None else tolerance
    strat = accel.get(name)
    todo = [c for c in cases(card, prompts, seeds) if c[0] in in_order]
    key, prompt, seed = todo[-1]
    before = todo[-2][0] if len(todo) > 1 else f"seed {seed + 1}"

    def render_one(s):
        return next(iter(render_set(pipe, card, [prompt], [s]).values()))

    undo = strat.apply(pipe, config, adapter=adapter, steps=card.generation.steps)
    try:
        alone = render_one(seed)
        if len(todo) > 1:
            after = in_order[key]
        else:
            render_one(seed + 1)
            after = render_one(seed)
    finally:
        undo()
    diff = float(np.max(np.abs(np.asarray(alone, np.float64) - np.asarray(after, np.float64))))
    record = {"name": name, "case": key, "rendered_after": before, "max_abs": diff, "tolerance": tolerance,
              "order_independent": diff <= tolerance}
    if diff > tolerance:
        raise OrderDependentCache(
            f"{name} {strat.settings_dict(config)} renders {key} differently alone than after "
            f"{record['rendered_after']} (max abs {diff:.3g} > {tolerance:g}): the cache keeps state from one "
            "generation into the next, so its quality and savings depend on the order of the renders")
    return record


def check_cases(prompts: list, seeds: list, n: int | None) -> tuple[list, list]:
    """The first ``n`` cases (None: all) as a (prompts, seeds) product that keeps the cases' keys."""
    if n is None or n >= len(prompts) * len(seeds):
        return list(prompts), list(seeds)
    b = min(len(seeds), n)
    return list(prompts[: -(-n // b)]), list(seeds[:b])


def disabled_check(pipe, card, adapter, name: str, references: dict, baseline_counts: dict, gates: Gates,
                   prompts, seeds, tolerance: float | None = None) -> dict:
    """The strategy with caching turned off must reproduce the baseline within ``tolerance`` (default
    the card's ``cache.reproduce_tolerance``) on the given cases, a subset of ``references``."""
    tolerance = card.cache.reproduce_tolerance if tolerance is None else tolerance
    strat = accel.get(name)
    cfg = strat.disabled(adapter, card.generation.steps)
    if cfg is None:
        return {"name": name, "checked": False}
    from ..render import render_key

    keys = [render_key(i, s) for i in range(len(prompts)) for s in seeds]
    refs = {k: references[k] for k in keys}
    counts = _partial(baseline_counts, len(refs), len(references)) if len(refs) < len(references) else baseline_counts
    images: dict = {}
    res = evaluate(pipe, card, adapter, name, cfg, refs, counts, gates, prompts, seeds,
                   split="disabled", keep_images=images)
    if res.error:
        return {"name": name, "checked": True, "reproduces": False, "error": res.error.splitlines()[0]}
    diff = max_abs(images, refs)
    return {"name": name, "checked": True, "max_abs": diff, "reproduces": diff <= tolerance,
            "skipped_fraction": res.skipped_fraction, "cases": len(refs)}
