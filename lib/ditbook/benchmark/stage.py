"""The benchmark stage's steps, each one call from ``notebooks/05_benchmark.ipynb``.

``benchmark/results.json`` holds (scalars and relative paths only):

- ``device``, ``warmup``, ``repeats``, ``cases``: how it was measured;
- ``flops``: FLOPs per transformer call and per step (``FlopEstimate.to_dict``);
- ``baseline`` and ``configs``: per configuration its timing (end to end and per part: median,
  min, max, n), ``speedup`` and ``part_speedups`` against the same-process baseline,
  ``memory_ratio``, ``efficiency`` (achieved TFLOP/s, share of peak), ``psnr_min``, ``ssim_min``,
  ``worst_tile_psnr``, ``passed``, ``reasons``, ``error``;
- ``baseline_drift`` (baseline re-timed at the end / at the start) and ``noise_floor`` (the
  baseline rendered twice); ``timing`` (``measure.timing_record``: ``drift``, ``limit`` — the card's
  ``benchmark.timing_drift`` —, ``stable``, and the ``warmup`` / ``repeats`` the baseline and the
  ``verdict_rows`` got: at least ``settings.VERDICT_MIN_WARMUP`` / ``VERDICT_MIN_REPEATS``);
- ``intake_agreement``: the baseline rendered here against the intake stage's stored images;
- ``recorded``: ``{"cache": rows, "parallel": rows}`` — figures of the earlier stages;
- ``video``: for video cases ``{frames, reduce, meaning}`` (every frame compared, a video's figures
  are its worst frame's), else null;
- ``inputs``: which earlier results existed; ``residual_changes``: ``{name: [per step]}``;
- ``images``: ``{config: [{key, png, npy}]}``; ``plots``: ``{name: path}`` (``tradeoff_psnr``: the
  speed-vs-quality plot); ``grid``: the image grid (``grid_videos``: ``{frames}`` when the cases
  are videos, drawn as a row of frames each, else null); ``labels``: the plot's short key per
  configuration; ``holdout_worst``: the worst held-out image of the chosen configuration beside
  its reference (``{plot, key, psnr, ssim, name}``, from the cache stage's saved held-out images, or
  null); ``plot_points``: the rows the speed plot draws, ``parity_only``: the parallel plans
  run as CPU processes, left off it (``benchmark.shown``); ``sheets``: ``[]`` (no longer drawn);
  every path relative to ``benchmark/``;
- ``summary`` (rows of :func:`~ditbook.benchmark.summary.summary_rows`), ``recommendation`` (the
  fastest row passing its gates, kept for reference) and ``verdict``
  (:func:`~ditbook.benchmark.verdict.verdict`: the cache stage's choice, timed here, with its
  held-out quality — what the report and ``result.md`` say to ship).
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from .inputs import StageInputs, cache_rows, parallel_rows, residual_series
from ..quality import Gates, compare_sets
from .summary import family_gates, gates_dict, gates_for_family, recommend, summary_rows
from ..configuration import Config
from .measure import BenchmarkReport, benchmark
# the 05_benchmark notebook imports this module (and the display helpers) only: the other names it uses
from ..context import open_stage  # noqa: F401
from .figures import STAGE, make_figures  # noqa: F401 (STAGE: the folder name, written once)
from .inputs import discover_configs, read_inputs  # noqa: F401
from .report import build_report, table_html, write_result_md  # noqa: F401
from .variants import derived_configs, measured_table  # noqa: F401
from ..accel.attention_backend import BACKENDS_FILE  # noqa: F401
from .verdict import headline  # noqa: F401
from .shown import is_cpu_run, is_parallel


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "config"


def gate_overrides(card) -> dict:
    """Per-family gates from the card: ``cache.gates`` for cache and cache+parallel rows,
    ``parallel.gates`` for parallel rows (``summary.family_gates``)."""
    return family_gates(card)


def measure(ctx, pipe, configs: list[Config], *, warmup: int | None = None, repeats: int | None = None,
            peak_tflops: float | None = None, max_cases: int | None = None,
            progress: Callable | None = None, log: Callable[[str], None] = print) -> BenchmarkReport:
    """Render the card's prompts x seeds with the baseline and each configuration, timing each;
    ``warmup``, ``repeats``, ``peak_tflops``, ``max_cases``: None takes the card's ``benchmark`` value."""
    from ..render import call_kwargs, cases, make_generator, to_image

    b = ctx.card.benchmark
    warmup = b.warmup if warmup is None else warmup
    repeats = b.repeats if repeats is None else repeats
    peak_tflops = b.peak_tflops if peak_tflops is None else peak_tflops
    max_cases = b.max_cases if max_cases is None else max_cases
    todo = cases(ctx.card)
    if max_cases:
        todo = todo[:max_cases]
    kwargs = call_kwargs(pipe, ctx.card)

    def render(prompt: str, seed: int) -> np.ndarray:
        return to_image(pipe(prompt=prompt, generator=make_generator(seed), **kwargs))

    gate_map = gate_overrides(ctx.card)

    def gates_for(cfg: Config) -> Gates:
        family = gates_for_family(cfg.family, gate_map)
        return Gates.from_dict(cfg.gates, **family.to_dict()) if cfg.gates else family

    return benchmark(pipe, configs, render, todo, warmup=warmup, repeats=repeats, peak_tflops=peak_tflops,
                     steps=ctx.card.generation.steps, gates_for=gates_for, progress=progress, log=log,
                     verdict_rows=verdict_rows(ctx), drift_limit=ctx.card.benchmark.timing_drift)


def verdict_rows(ctx) -> set[str]:
    """The benchmark rows the verdict reads (the cache stage's chosen configuration, its fp8
    composition when ``cache.fp8`` found one, the other configurations that passed on held-out
    seeds — its possible runners-up, compared with it like for like — and their compiled twins):
    timed warm and repeated whatever the card's ``benchmark`` section says."""
    from .shown import chosen_row_name, fp8_row_name, holdout_records

    run = ctx.run
    cache = run.read_results("cache") if run.has_results("cache") else {}
    chosen = cache.get("chosen")
    if not chosen:
        return set()
    names = [chosen_row_name(chosen), fp8_row_name(cache)]
    names += [n for n, rec in holdout_records(cache).items() if rec.get("passed")]
    return {n + tail for n in names if n for tail in ("", "+compile")}


def measure_residuals(ctx, pipe, configs: list[Config] | None = None) -> dict[str, list[float]]:
    """Residual change per step at the first block, for the baseline (and each configuration)."""
    from ..render import call_kwargs, cases, make_generator
    from .residuals import residual_changes

    key, prompt, seed = cases(ctx.card)[0]
    kwargs = call_kwargs(pipe, ctx.card)
    call = lambda: pipe(prompt=prompt, generator=make_generator(seed), **kwargs)  # noqa: E731
    out = {"baseline": residual_changes(pipe, call)["changes"]}
    for cfg in configs or []:
        undo = cfg.apply(pipe)
        try:
            out[cfg.name] = residual_changes(pipe, call)["changes"]
        finally:
            if undo is not None:
                undo()
    return out


def save(ctx, report: BenchmarkReport, inputs: StageInputs,
         residuals: dict[str, list[float]] | None = None) -> dict:
    """Write images and ``benchmark/results.json``; returns the results mapping."""
    from ..render import Render, save_renders

    stage_dir = ctx.run.stage_dir(STAGE)
    images: dict[str, list[dict]] = {}
    for res in report.all():
        if not res.images:
            continue
        renders = [Render(prompt="", seed=0, image=img, seconds=0.0, key=k) for k, img in res.images.items()]
        rows = save_renders(renders, stage_dir / "images" / _slug(res.name))
        images[res.name] = [{"key": r["key"], "png": f"images/{r['png']}", "npy": f"images/{r['npy']}"} for r in rows]
    results = report.to_dict()
    results["cases"] = sorted(report.baseline.images)
    results["video"] = video_note(report.baseline.images)
    results["inputs"] = inputs.to_dict()
    intake = inputs.get("intake")
    if intake and intake.get("images"):
        from ..render import load_images

        stored = load_images(ctx.run.stage_dir("intake"), intake["images"])
        stored = {k: v for k, v in stored.items() if k in report.baseline.images}
        if stored:
            agree = compare_sets(report.baseline.images, stored, Gates()).to_dict()
            results["intake_agreement"] = {k: agree[k] for k in ("psnr_min", "ssim_min", "max_abs", "passed")}
    results["recorded"] = {"cache": cache_rows(inputs.get("cache")), "parallel": parallel_rows(inputs.get("parallel"))}
    series = dict(residual_series(inputs.get("cache")))
    series.update(residuals or {})
    results["residual_changes"] = series
    results["images"] = images
    results["summary"] = summary_rows(results)
    results["gates"] = gates_dict(gate_overrides(ctx.card))
    # parallel plans run as CPU processes have no speed-up to recommend them by (benchmark.shown)
    speed_rows = [r for r in results["summary"] if not (is_cpu_run(results) and is_parallel(r))]
    results["recommendation"] = recommend(speed_rows, gate_overrides(ctx.card)).to_dict()
    # the verdict is the cache stage's choice, timed here (one decision, made once: verdict.py)
    from .verdict import verdict

    results["verdict"] = verdict(results, inputs.get("cache"))
    ctx.run.write_results(STAGE, results)
    return results


def video_note(images: dict) -> dict | None:
    """For video cases: their frame count and how a video's frames make its PSNR/SSIM (every
    frame compared, the worst one counts: ``quality.FRAME_REDUCE``); None for images."""
    from ..quality import FRAME_REDUCE
    from ..render import is_video

    frames = sorted({int(v.shape[0]) for v in images.values() if is_video(v)})
    if not frames:
        return None
    return {"frames": frames[-1] if len(frames) == 1 else frames, "reduce": FRAME_REDUCE,
            "meaning": f"every frame compared; a video's PSNR, SSIM and worst tile are the {FRAME_REDUCE} over its frames"}


__all__ = ["STAGE", "gate_overrides", "measure", "measure_residuals", "save", "make_figures",
           "verdict_rows"]
