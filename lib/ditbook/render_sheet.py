"""Contact sheets of videos: one row of frames per video, frame numbers on top, a label on the
left. The intake stage's baseline sheet, the cache stage's chosen-configuration sheet and the
benchmark's image grid draw videos through here (images keep their grids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .render import frame_strip, is_video, preview_frames

GAP = 1  # white pixel columns between frames
# a sheet draws each frame at most this many pixels wide (every n-th pixel of a larger one): the
# figure's size stays bounded at any resolution (481x833 frames drawn whole made a sheet take minutes)
SHEET_FRAME_PX = 256


def diff_frames(video, reference, gain: float = 10.0) -> np.ndarray:
    """|video - reference| per frame, averaged over colour, ×``gain`` and clipped to [0, 1], as
    RGB frames of the ``magma`` colour map (NaN shows as full scale)."""
    import matplotlib

    d = np.abs(np.asarray(video, dtype=np.float64) - np.asarray(reference, dtype=np.float64))
    d = d.mean(axis=-1) if d.shape[-1] in (1, 3) else d
    d = np.clip(np.nan_to_num(d * gain, nan=1.0, posinf=1.0), 0, 1)
    return matplotlib.colormaps["magma"](d)[..., :3].astype(np.float32)


def sheet_frames(videos, extra: list[int] | tuple = ()) -> list[int] | None:
    """The frame indices a sheet of these videos shows: ``render.preview_frames`` of the longest,
    with ``extra`` ones (e.g. a row's worst frame) added; None when none is a video."""
    counts = [len(v) for v in videos if is_video(v)]
    if not counts:
        return None
    most = max(counts)
    return sorted(set(preview_frames(most)) | {int(i) for i in extra if 0 <= int(i) < most})


def pick_frames(video, frames: list[int] | None):
    """``video``'s frames at ``frames`` (those it has); an image, or ``frames`` None, as it is."""
    v = np.asarray(video)
    return v[[i for i in frames if i < len(v)]] if is_video(v) and frames is not None else v


def _sheet_strip(video) -> np.ndarray:
    v = np.asarray(video)
    step = max(1, -(-v.shape[-2] // SHEET_FRAME_PX))
    return np.clip(np.nan_to_num(frame_strip(v[..., ::step, ::step, :].astype(np.float32), GAP), nan=0.0), 0, 1)


def video_sheet(rows: list[tuple[str, np.ndarray]], title: str = "", path: str | Path | None = None,
                px: float = 0.025, frame_numbers: list[int] | None = None):
    """A figure with one row per (label, video): frames side by side, each at most
    ``SHEET_FRAME_PX`` wide (a 3-d image is drawn as one picture). The frames shown are
    ``sheet_frames`` of the rows (at most ``render.PREVIEW_FRAMES``, evenly spaced), or, with
    ``frame_numbers``, the rows are those frames already (``pick_frames``) and the numbers label
    them. ``px`` inches per pixel. Saved to ``path`` when given; the figure is returned (open, so a
    notebook shows it, like the image grids)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if frame_numbers is None:
        frame_numbers = sheet_frames([v for _, v in rows])
        rows = [(label, pick_frames(v, frame_numbers)) for label, v in rows]
    strips = [_sheet_strip(v) for _, v in rows]
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
        if is_video(video) and i == 0:  # the numbers of the frames shown, once, above the first row
            shown = list(frame_numbers or range(len(video)))[:len(video)]
            w = (strip.shape[1] + GAP) // len(video) - GAP
            ax.xaxis.set_ticks_position("top")
            ax.set_xticks([k * (w + GAP) + (w - 1) / 2 for k in range(len(shown))], [str(j) for j in shown],
                          fontsize=6)
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


__all__ = ["diff_frames", "pick_frames", "sheet_frames", "video_sheet"]
