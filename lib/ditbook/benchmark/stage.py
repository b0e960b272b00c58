"""The benchmark stage's steps, each one call from ``notebooks/05_benchmark.ipynb``: every
configuration the earlier stages hand over (``inputs``, ``variants``) timed beside the baseline in
this process and judged against its images; ``save`` writes ``benchmark/results.json`` with the verdict.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from .inputs import StageInputs, cache_rows, parallel_rows
from ..quality import Gates, compare_sets
from ..records import BenchmarkResults, ConfigRow, TimingState, decode
from .summary import family_gates, gates_for_family, summary_rows
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


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "config"


def gate_overrides(card) -> dict:
    """Per-family gates from the card (``summary.family_gates``)."""
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
    """The benchmark rows the verdict reads (every candidate and its compiled twin): timed warm and
    repeated whatever the card's ``benchmark`` section says."""
    from .verdict import candidates

    cache = ctx.run.results_or_none("cache")
    names = [c.name for c in candidates(None, cache)] if cache is not None else []
    return {n + tail for n in names for tail in ("", "+compile")}


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
         residuals: dict[str, list[float]] | None = None) -> BenchmarkResults:
    """Write images and ``benchmark/results.json`` (``records.BenchmarkResults``); returns the record."""
    from ..render import Render, load_images, save_renders

    stage_dir = ctx.run.stage_dir(STAGE)
    images: dict[str, list[dict]] = {}
    for res in report.all():
        if not res.images:
            continue
        renders = [Render(prompt="", seed=0, image=img, seconds=0.0, key=k) for k, img in res.images.items()]
        rows = save_renders(renders, stage_dir / "images" / _slug(res.name))
        images[res.name] = [{"key": r.key, "png": f"images/{r.png}", "npy": f"images/{r.npy}"} for r in rows]
    data = report.to_dict()
    results = BenchmarkResults(
        device=data["device"], warmup=data["warmup"], repeats=data["repeats"],
        baseline=decode(ConfigRow, data["baseline"], "baseline"),
        configs=[decode(ConfigRow, c, "configs") for c in data["configs"]], flops=data["flops"],
        baseline_drift=data["baseline_drift"], noise_floor=data["noise_floor"],
        timing=decode(TimingState, data["timing"], "timing") if data["timing"] else None,
        cases=sorted(report.baseline.images), video=video_note(report.baseline.images), inputs=inputs.to_dict(),
        recorded={"cache": cache_rows(inputs.cache), "parallel": parallel_rows(inputs.parallel)},
        residual_changes=dict(residuals or {}), images=images,
        gates=family_gates(ctx.card))
    if inputs.intake is not None:
        stored = load_images(ctx.run.stage_dir("intake"), inputs.intake.images)
        stored = {k: v for k, v in stored.items() if k in report.baseline.images}
        if stored:
            agree = compare_sets(report.baseline.images, stored, Gates()).to_dict()
            results.intake_agreement = {k: agree[k] for k in ("psnr_min", "ssim_min", "max_abs", "passed")}
    results.summary = summary_rows(results)
    from .verdict import verdict

    results.verdict = verdict(results, inputs.cache)
    ctx.run.write_results(STAGE, results)
    return results


def summary_table(ctx, results: BenchmarkResults) -> str:
    """The summary table as the report shows it, as HTML."""
    from .report import summary_html
    from .shown import shown_rows

    parallel = ctx.run.results_or_none("parallel")
    return summary_html(shown_rows(results.summary, results, ctx.run.results_or_none("cache"), parallel), parallel)


def video_note(images: dict) -> dict | None:
    """For video cases: their frame count and how a video's frames make its PSNR/SSIM; None for images."""
    from ..quality import FRAME_REDUCE
    from ..render import is_video

    frames = sorted({int(v.shape[0]) for v in images.values() if is_video(v)})
    if not frames:
        return None
    return {"frames": frames[-1] if len(frames) == 1 else frames, "reduce": FRAME_REDUCE,
            "meaning": f"every frame compared; a video's PSNR, SSIM and worst tile are the {FRAME_REDUCE} over its frames"}


__all__ = ["STAGE", "gate_overrides", "measure", "measure_residuals", "save", "make_figures", "summary_table",
           "verdict_rows"]
