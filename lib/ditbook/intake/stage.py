"""Stage 01, intake: the environment, the model loaded offline, baseline images per prompt x seed."""

from __future__ import annotations

import time


import numpy as np

from ..display import Table, image_grid, save_figure
from ..quality import is_blank
from ..environment import environment_rows
from .reference import reference_facts, write_reference
from ..records import IntakeResults
from ..render import is_video, render_all, save_renders
from ..context import StageContext
# the 01_intake notebook imports this module (and the display helpers) only: the other names it uses
from ..card import GateError  # noqa: F401
from ..card import gate_problems as card_gate_problems
from ..context import open_stage, resolve_from_root  # noqa: F401
from .card_form import card_form as card_form_widget
from .reference import ReferenceFacts  # noqa: F401


def gate_problems(path, overrides=None):
    """The card's gate (``card.gate_problems``), its path resolved as ``open_stage`` resolves it:
    in a notebook opened from ``notebooks/``, ``models/<name>.yaml`` is the project root's."""
    return card_gate_problems(resolve_from_root(path) if path else path, overrides)


def card_form(card_path, problems):
    """The form asking for the card's missing items (``card_form.card_form``), the card's path
    resolved as :func:`gate_problems` resolves it."""
    return card_form_widget(resolve_from_root(card_path) if card_path else card_path, problems)


def environment_table() -> Table:
    return Table(environment_rows(), ["item", "value"], "environment")


def components(pipe) -> dict:
    """Component name -> class name, with parameter counts for modules."""
    out = {}
    for name, comp in getattr(pipe, "components", {}).items():
        if comp is None:
            continue
        label = type(comp).__name__
        if hasattr(comp, "parameters"):
            label += f" ({sum(p.numel() for p in comp.parameters()) / 1e6:.2f} M params)"
        out[name] = label
    return out


class BaselineError(RuntimeError):
    """A baseline image holds NaN/Inf or is blank: every later comparison would be meaningless."""


def baseline_problems(renders) -> list[str]:
    """Each baseline image that is not a usable reference, by key, with why."""
    problems = []
    for r in renders:
        img = np.asarray(r.image, dtype=np.float64)
        bad = int((~np.isfinite(img)).sum())
        if bad:
            problems.append(f"{r.key} ({r.prompt[:40]!r}, seed {r.seed}): {bad} of {img.size} values are NaN/Inf")
        elif is_blank(img):
            problems.append(f"{r.key} ({r.prompt[:40]!r}, seed {r.seed}): blank (one flat value, "
                            f"std {float(img.std()):.2g})")
    return problems


def check_baseline(renders) -> None:
    """``BaselineError`` naming every unusable baseline image."""
    problems = baseline_problems(renders)
    if problems:
        raise BaselineError(f"{len(problems)} of {len(renders)} baseline image(s) are unusable — the model or its "
                            f"settings produce no picture, so no stage can be judged against them:\n  "
                            + "\n  ".join(problems))


def baseline_sheet(renders):
    """The baseline's figure: images in a grid; videos (``render.is_video``) as a row of frames each."""
    labels = [f"{r.key}: {r.prompt[:40]}" for r in renders]
    if any(is_video(r.image) for r in renders):
        from ..render_sheet import video_sheet

        return video_sheet(list(zip(labels, [r.image for r in renders])), "baseline: a row of frames per video")
    return image_grid([r.image for r in renders], labels)


def run_intake(ctx: StageContext, progress=None) -> tuple[IntakeResults, object]:
    """Load the model and render the baseline; writes ``intake/results.json``. Returns the
    result and the loaded pipeline."""
    start = time.perf_counter()
    pipe = ctx.load_pipeline()
    load_seconds = time.perf_counter() - start
    start = time.perf_counter()
    renders = render_all(pipe, ctx.card, progress=progress)
    render_seconds = time.perf_counter() - start
    check_baseline(renders)  # before anything is written: no results.json for later stages to trust
    rows = save_renders(renders, ctx.dir / "images")
    fig = baseline_sheet(renders)
    grid = save_figure(fig, ctx.dir / "baseline_grid.png")
    facts = reference_facts(ctx, pipe)
    write_reference(ctx.dir, facts)
    result = IntakeResults(images=rows, placement=ctx.placement.to_dict(), load_seconds=round(load_seconds, 3),
                           render_seconds=round(render_seconds, 3), grid=str(grid.relative_to(ctx.dir)),
                           pipeline_components=components(pipe), reference=facts.to_dict())
    ctx.write_results(result)
    return result, pipe
