"""The benchmark stage's steps, each one call from ``notebooks/05_benchmark.ipynb``.

``benchmark/results.json`` holds (scalars and relative paths only):

- ``device``, ``warmup``, ``repeats``, ``cases``: how it was measured;
- ``flops``: FLOPs per transformer call and per step (``FlopEstimate.to_dict``);
- ``baseline`` and ``configs``: per configuration its timing (end to end and per part: median,
  min, max, n), ``speedup`` and ``part_speedups`` against the same-process baseline,
  ``memory_ratio``, ``efficiency`` (achieved TFLOP/s, share of peak), ``psnr_min``, ``ssim_min``,
  ``worst_tile_psnr``, ``passed``, ``reasons``, ``error``;
- ``baseline_drift`` (baseline re-timed at the end / at the start) and ``noise_floor`` (the
  baseline rendered twice);
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
from pathlib import Path
from typing import Callable

import numpy as np

from .inputs import StageInputs, cache_rows, parallel_rows, residual_series
from ..quality import Gates, compare_sets
from .summary import family_gates, gates_dict, gates_for_family, recommend, summary_rows
from ..configuration import Config
from .measure import BenchmarkReport, benchmark
from .shown import is_cpu_run, is_parallel

STAGE = "benchmark"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "config"


def resolve_knobs(card, warmup=None, repeats=None, peak_tflops=None, max_cases=None, compile=None,
                  attention_backend=None) -> dict:
    """The notebook's knobs, falling back to the card's typed ``benchmark`` section (whose
    defaults are in ``ditbook.settings.BenchmarkSettings``); ``compile`` and ``attention_backend``
    are read by :mod:`ditbook.benchmark.variants`."""
    b = card.benchmark
    pick = lambda v, default: v if v is not None else default  # noqa: E731
    return {"warmup": int(pick(warmup, b.warmup)), "repeats": int(pick(repeats, b.repeats)),
            "peak_tflops": pick(peak_tflops, b.peak_tflops), "max_cases": pick(max_cases, b.max_cases),
            "configs": list(b.configs), "compile": pick(compile, b.compile),
            "attention_backend": pick(attention_backend, b.attention_backend)}


def gate_overrides(card) -> dict:
    """Per-family gates from the card: ``cache.gates`` for cache and cache+parallel rows,
    ``parallel.gates`` for parallel rows (``summary.family_gates``)."""
    return family_gates(card)


def measure(ctx, pipe, configs: list[Config], *, warmup: int = 1, repeats: int = 3,
            peak_tflops: float | None = None, max_cases: int | None = None,
            progress: Callable | None = None, log: Callable[[str], None] = print) -> BenchmarkReport:
    """Render the card's prompts x seeds with the baseline and each configuration, timing each."""
    from ..render import call_kwargs, cases, make_generator, to_image

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
                     steps=ctx.card.generation.steps, gates_for=gates_for, progress=progress, log=log)


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


def plotted_rows(run, results: dict, rows: list[dict]) -> list[dict]:
    """The rows as the speed plot draws them (``benchmark.shown``): each configuration's one
    quality figure (held-out where the cache stage confirmed it), and no speed-up for a parallel
    plan run as CPU processes (so it is not drawn)."""
    from .shown import shown_rows

    cache = run.read_results("cache") if run.has_results("cache") else None
    return [dict(r, speedup=r["speedup_shown"], psnr_min=r["psnr"], ssim_min=r["ssim"])
            for r in shown_rows(rows, results, cache)]


def holdout_figure(run, d: Path) -> dict | None:
    """The worst held-out image of the cache stage's chosen configuration beside its uncached
    reference (``cache/images/holdout``, saved by the cache stage), drawn to
    ``plots/holdout_worst.png``: ``{plot, key, psnr, ssim, name}``; None when the cache stage
    saved no held-out images."""
    from .plots import worst_image_figure
    from .verdict import chosen_row_name

    cache = run.read_results("cache") if run.has_results("cache") else None
    detail = (cache or {}).get("chosen_detail") or {}
    saved = detail.get("holdout_images") or {}
    key = saved.get("worst")
    cdir = run.stage_dir("cache", create=False)
    paths = [cdir / saved.get(k, "") / f"{key}.npy" for k in ("baseline", "folder")] if key else []
    if not paths or not all(p.is_file() for p in paths):
        return None
    ref, img = (np.load(p) for p in paths)
    per = ((detail.get("holdout_quality") or {}).get("per_image") or {}).get(key) or {}
    if ref.ndim == 4:  # a video: its worst frame
        f = int(((per.get("frames") or {}).get("worst_frame")) or 0)
        ref, img = ref[f], img[f]
    name = chosen_row_name(cache["chosen"])
    title = (f"worst held-out image of {name}: {key}, PSNR {per.get('psnr', float('nan')):.2f} dB, "
             f"SSIM {per.get('ssim', float('nan')):.4f}")
    path = worst_image_figure(ref, img, d / "plots" / "holdout_worst.png", title)
    return {"plot": str(Path(path).relative_to(d)), "key": key, "psnr": per.get("psnr"), "ssim": per.get("ssim"),
            "name": name}


def make_figures(run, results: dict | None = None) -> dict:
    """The speed-vs-quality plot and the image grid (plus residual and scaling plots) from
    ``benchmark/results.json`` and the stored images; updates ``plots``, ``grid``, ``labels`` and
    ``sheets`` (no longer drawn: ``[]``) in the results. Rebuildable at any time
    (``ditbook report``)."""
    from ..render import is_video
    from .plots import image_grid, plot_residuals, plot_scaling, plot_tradeoff, row_id, short_labels
    from .verdict import verdict

    results = results if results is not None else run.read_results(STAGE)
    d = run.stage_dir(STAGE)
    rows = results.get("summary") or summary_rows(results)
    if "verdict" not in results:
        results["verdict"] = verdict(results, run.read_results("cache") if run.has_results("cache") else None)
    labels = short_labels(rows)
    plots = {}
    cache_gate = gates_for_family("cache", results.get("gates"))
    drawn = plotted_rows(run, results, rows)
    plots["tradeoff_psnr"] = plot_tradeoff(drawn, "psnr_min", d / "plots" / "tradeoff_psnr.png",
                                           cache_gate.psnr, labels=labels, highlight=results["verdict"].get("name"))
    # what the speed axis carries, and the parity results left off it (CPU processes)
    results["plot_points"] = [row_id(r) for r in drawn if r["speedup"] is not None and r["psnr_min"] is not None]
    results["parity_only"] = [row_id(r) for r in drawn if r.get("parity_only")]
    if results.get("residual_changes"):
        plots["residuals"] = plot_residuals(results["residual_changes"], d / "plots" / "residuals.png")
    par = [r for r in rows if str(r.get("family", "")).endswith("parallel")]
    if par and not is_cpu_run(results):  # CPU processes sharing cores: parity, not a speed-up
        plots["scaling"] = plot_scaling(par, d / "plots" / "scaling.png")
    images = results.get("images") or {}
    base_rows = images.get("baseline", [])
    # one case per prompt (its first seed): the columns of the grid
    per_prompt: dict[str, dict] = {}
    for r in base_rows:
        m = re.match(r"^(p\d+)_", r["key"])
        per_prompt.setdefault(m.group(1) if m else r["key"], r)
    meta = run.read_meta()
    prompt_list = (((meta.get("card") or {}).get("generation") or {}).get("prompts")) or []
    prompts = {}
    for pk, r in per_prompt.items():
        m = re.match(r"^p(\d+)$", pk)
        if m and int(m.group(1)) < len(prompt_list):
            prompts[r["key"]] = str(prompt_list[int(m.group(1))])
    baseline = {r["key"]: np.load(d / r["npy"]) for r in per_prompt.values()}
    grid_images: dict[str, dict] = {}
    for name, rows_ in images.items():
        if name == "baseline":
            continue
        by_key = {r["key"]: r for r in rows_}
        grid_images[name] = {k: np.load(d / by_key[k]["npy"]) for k in baseline if k in by_key}
    grid = image_grid(baseline, grid_images, d / "plots" / "grid.png", prompts, labels) if baseline else None
    results["plots"] = {k: str(Path(p).relative_to(d)) for k, p in plots.items()}
    results["grid"] = str(Path(grid).relative_to(d)) if grid else None
    frames = {int(v.shape[0]) for v in baseline.values() if is_video(v)}
    results["grid_videos"] = {"frames": max(frames)} if frames else None  # the grid shows rows of frames
    results["labels"] = labels
    results["holdout_worst"] = holdout_figure(run, d)
    results["sheets"] = []
    run.write_results(STAGE, results)
    return results


__all__ = ["STAGE", "resolve_knobs", "gate_overrides", "measure", "measure_residuals", "save", "make_figures"]
