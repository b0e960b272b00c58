"""Contact sheets of videos: one row of frames per video, frame numbers on top, a label on the
left. The intake stage's baseline sheet, the cache stage's chosen-configuration sheet and the
benchmark's image grid draw videos through here (images keep their grids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .render import frame_strip, is_video

GAP = 1  # white pixel columns between frames


def diff_frames(video, reference, gain: float = 10.0) -> np.ndarray:
    """|video - reference| per frame, averaged over colour, ×``gain`` and clipped to [0, 1], as
    RGB frames of the ``magma`` colour map (NaN shows as full scale)."""
    import matplotlib

    d = np.abs(np.asarray(video, dtype=np.float64) - np.asarray(reference, dtype=np.float64))
    d = d.mean(axis=-1) if d.shape[-1] in (1, 3) else d
    d = np.clip(np.nan_to_num(d * gain, nan=1.0, posinf=1.0), 0, 1)
    return matplotlib.colormaps["magma"](d)[..., :3].astype(np.float32)


def video_sheet(rows: list[tuple[str, np.ndarray]], title: str = "", path: str | Path | None = None,
                px: float = 0.025):
    """A figure with one row per (label, video): the video's frames side by side (a 3-d image is
    drawn as one picture). ``px`` inches per pixel. Saved to ``path`` when given; the figure is
    returned (open, so a notebook shows it, like the image grids)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    strips = [np.clip(np.nan_to_num(frame_strip(np.asarray(v, dtype=np.float32), GAP), nan=0.0), 0, 1)
              for _, v in rows]
    if not strips:
        return None
    width = max(s.shape[1] for s in strips)
    heights = [s.shape[0] for s in strips]
    fig, axes = plt.subplots(len(strips), 1, squeeze=False, gridspec_kw={"height_ratios": heights},
                             figsize=(width * px + 2.4, sum(heights) * px + 0.35 * len(strips) + 0.4))
    for i, ((label, video), strip) in enumerate(zip(rows, strips)):
        ax = axes[i][0]
        ax.imshow(strip, interpolation="nearest", aspect="equal")
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
        if is_video(video) and i == 0:  # frame numbers once, above the first row
            f, w = video.shape[0], video.shape[2]
            ax.xaxis.set_ticks_position("top")
            ax.set_xticks([j * (w + GAP) + (w - 1) / 2 for j in range(f)], [str(j) for j in range(f)], fontsize=6)
            ax.tick_params(length=0)
        else:
            ax.set_xticks([])
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.08)
    return fig


__all__ = ["diff_frames", "video_sheet"]
