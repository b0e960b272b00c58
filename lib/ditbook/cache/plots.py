"""Figures of the cache stage (matplotlib): the trade-off between compute saved and quality, and
baseline / cached image grids with difference maps."""

from __future__ import annotations

import numpy as np


def tradeoff_plot(strategy_rows: list[dict], gates, frontier: list[dict] | None = None, path=None):
    """Skipped block evaluations vs worst-image PSNR, one colour per strategy."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = sorted({r["name"] for r in strategy_rows})
    for i, name in enumerate(names):
        for split, marker in (("calibration", "o"), ("holdout", "*")):
            pts = [r for r in strategy_rows if r["name"] == name and r.get("split") == split and r.get("quality")]
            if pts:
                ax.scatter([p["skipped_fraction"] for p in pts], [min(p["quality"]["psnr_min"] or 0, 80) for p in pts],
                           color=f"C{i % 10}", marker=marker, s=60 if marker == "*" else 22,
                           label=name if split == "calibration" else None, alpha=0.85)
    if frontier:
        f = sorted(frontier, key=lambda p: p["skipped_fraction"])
        ax.plot([p["skipped_fraction"] for p in f], [min(p["psnr_min"], 80) for p in f], color="k", lw=0.8, ls=":")
    ax.axhline(gates.psnr, color="r", lw=0.8, ls="--", label=f"gate {gates.psnr} dB")
    ax.set_xlabel("fraction of block evaluations skipped")
    ax.set_ylabel("worst-image PSNR (dB, capped 80)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("compute saved vs quality (o calibration, * held-out)")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def image_grid(baseline: dict, cached: dict, title: str = "", path=None, max_images: int = 4):
    """Rows: baseline, cached, |difference| x 10; videos: those three rows of frames per case."""
    import matplotlib.pyplot as plt

    from ..render import is_video

    keys = sorted(k for k in baseline if k in cached)[:max_images]
    if not keys:
        return None
    if any(is_video(baseline[k]) for k in keys):
        from ..render_sheet import diff_frames, pick_frames, sheet_frames, video_sheet

        shown = sheet_frames([baseline[k] for k in keys])
        b = {k: pick_frames(baseline[k], shown) for k in keys}
        c = {k: pick_frames(cached[k], shown) for k in keys}
        rows = [row for k in keys for row in ((f"{k} baseline", b[k]), (f"{k} cached", c[k]),
                                               (f"{k} |diff| x10", diff_frames(c[k], b[k])))]
        return video_sheet(rows, title, path, frame_numbers=shown)
    fig, axes = plt.subplots(3, len(keys), figsize=(2.2 * len(keys), 6.4), squeeze=False)
    for j, k in enumerate(keys):
        diff = np.clip(np.abs(cached[k].astype(np.float64) - baseline[k]) * 10, 0, 1)
        for i, (img, label) in enumerate(((baseline[k], "baseline"), (cached[k], "cached"), (diff, "|diff| x10"))):
            axes[i, j].imshow(np.clip(img, 0, 1))
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
            if j == 0:
                axes[i, j].set_ylabel(label)
        axes[0, j].set_title(k, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig
