"""The benchmark stage's figures, rebuilt from ``benchmark/results.json`` and the stored images
(``make_figures``: the notebook and ``ditbook report`` both draw them)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..records import BenchmarkResults
from .summary import gates_for_family, summary_rows

STAGE = "benchmark"


def plotted_rows(run, results: BenchmarkResults, rows: list[dict]) -> list[dict]:
    """The rows as the speed plot draws them (``benchmark.shown``): one quality figure each, no
    speed-up for a parallel plan run as CPU processes."""
    from .shown import shown_rows

    return [dict(r, speedup=r["speedup_shown"], psnr_min=r["psnr"], ssim_min=r["ssim"],
                 family=r.get("family_shown") or r.get("family"), family_key=r.get("family"))
            for r in shown_rows(rows, results, run.results_or_none("cache"), run.results_or_none("parallel"))]


def holdout_figure(run, d: Path) -> dict | None:
    """The worst held-out image of the chosen configuration beside its uncached reference, drawn to
    ``plots/holdout_worst.png``: ``{plot, key, psnr, ssim, name}``; None without held-out images."""
    from .plots import worst_image_figure
    from .verdict import chosen_row_name

    cache = run.results_or_none("cache")
    chosen = cache.chosen if cache is not None else None
    saved = chosen.holdout_images if chosen is not None and chosen.holdout_images else {}
    key = saved.get("worst")
    cdir = run.stage_dir("cache", create=False)
    paths = [cdir / saved.get(k, "") / f"{key}.npy" for k in ("baseline", "folder")] if key else []
    if not paths or not all(p.is_file() for p in paths):
        return None
    ref, img = (np.load(p) for p in paths)
    per = chosen.holdout_quality.per_image.get(key, {}) if chosen.holdout_quality else {}
    if ref.ndim == 4:  # a video: its worst frame
        f = int(per.get("frames", {}).get("worst_frame") or 0)
        ref, img = ref[f], img[f]
    name = chosen_row_name(chosen)
    path = worst_image_figure(ref, img, d / "plots" / "holdout_worst.png")
    return {"plot": str(Path(path).relative_to(d)), "key": key, "psnr": per.get("psnr"), "ssim": per.get("ssim"),
            "name": name}


def grid_cases(run, results: BenchmarkResults, d: Path) -> tuple[dict, dict, dict]:
    """The image grid's columns, one case per prompt: baseline images, each row's images, prompts."""
    images = results.images
    per_prompt: dict[str, dict] = {}
    for r in images.get("baseline", []):
        m = re.match(r"^(p\d+)_", r["key"])
        per_prompt.setdefault(m.group(1) if m else r["key"], r)
    prompt_list = run.read_meta().get("card", {}).get("generation", {}).get("prompts", [])
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
    return baseline, grid_images, prompts


def make_figures(run, results: BenchmarkResults | None = None) -> BenchmarkResults:
    """The speed-vs-quality plot, the image grid, residual and scaling plots from the record and the
    stored images; updates ``plots``, ``grid``, ``labels`` and ``holdout_worst`` in the record."""
    from ..render import is_video
    from .plots import image_grid, plot_residuals, plot_scaling, plot_tradeoff, row_id, short_labels
    from .shown import is_cpu_run
    from .verdict import verdict

    results = results if results is not None else run.read_results(STAGE)
    d = run.stage_dir(STAGE)
    rows = results.summary or summary_rows(results)
    if results.verdict is None:
        results.verdict = verdict(results, run.results_or_none("cache"))
    labels = short_labels(rows)
    plots = {}
    cache_gate = gates_for_family("cache", results.gates)
    drawn = plotted_rows(run, results, rows)
    plots["tradeoff_psnr"] = plot_tradeoff(drawn, "psnr_min", d / "plots" / "tradeoff_psnr.png",
                                           cache_gate.psnr, labels=labels, highlight=results.verdict.name)
    results.plot_points = [row_id(r) for r in drawn if r["speedup"] is not None and r["psnr_min"] is not None]
    results.parity_only = [row_id(r) for r in drawn if r.get("parity_only")]
    if results.residual_changes:
        plots["residuals"] = plot_residuals(results.residual_changes, d / "plots" / "residuals.png")
    par = [r for r in rows if str(r.get("family", "")).endswith("parallel")]
    if par and not is_cpu_run(results):  # CPU processes sharing cores: parity, not a speed-up
        plots["scaling"] = plot_scaling(par, d / "plots" / "scaling.png")
    baseline, grid_images, prompts = grid_cases(run, results, d)
    words = {r["name"]: r["words"] for r in drawn if r.get("words")}
    grid = (image_grid(baseline, grid_images, d / "plots" / "grid.png", prompts, labels, words=words)
            if baseline else None)
    results.plots = {k: str(Path(p).relative_to(d)) for k, p in plots.items()}
    results.grid = str(Path(grid).relative_to(d)) if grid else None
    frames = {int(v.shape[0]) for v in baseline.values() if is_video(v)}
    results.grid_videos = {"frames": max(frames)} if frames else None  # the grid shows rows of frames
    results.labels = labels
    results.holdout_worst = holdout_figure(run, d)
    run.write_results(STAGE, results)
    return results


__all__ = ["make_figures"]
