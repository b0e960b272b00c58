"""Image quality against a reference: PSNR in floating point, SSIM, and corruption checks.

PSNR is computed on float images in [0, 1] (a uint8 difference wraps around and makes garbage
look fine). SSIM comes from scikit-image. PSNR alone misses NaNs, blank images and one bad
tile, so every comparison checks those too.

A video (frames, H, W, C) is compared frame by frame: each frame is judged like an image against
the reference's frame of the same index, and the video's PSNR, SSIM and worst tile are its worst
frame's (the minimum over frames; ``FRAME_REDUCE``), with every frame's PSNR and SSIM and their
means in ``QualityReport.frames``. A video with a different number of frames fails with that
reason; a reversed, shifted or swapped frame fails where its frame differs, which a comparison
of the first frame alone would not see.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from .settings import BLANK_STD, Gates  # the gate type; its numbers are written in settings only

PSNR_CAP = 100.0  # identical images: reported as this value rather than infinity
FRAME_REDUCE = "min"  # a video's PSNR/SSIM/worst tile: its worst frame's (stated in every video report)


def _as_float(img) -> np.ndarray:
    arr = np.asarray(img)
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    return arr.astype(np.float64)


def psnr(image, reference) -> float:
    """Peak signal-to-noise ratio in dB for float images in [0, 1]; NaN if either holds NaN/Inf."""
    a, b = _as_float(image), _as_float(reference)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    mse = float(np.mean((a - b) ** 2))
    if mse == 0.0:
        return PSNR_CAP
    return min(PSNR_CAP, 10.0 * math.log10(1.0 / mse))


def ssim(image, reference) -> float:
    """Structural similarity (scikit-image), data range 1, over colour channels."""
    from skimage.metrics import structural_similarity

    a, b = _as_float(image), _as_float(reference)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    win = min(7, a.shape[0], a.shape[1])
    if win % 2 == 0:
        win -= 1
    return float(structural_similarity(a, b, data_range=1.0, channel_axis=-1 if a.ndim == 3 else None,
                                       win_size=max(win, 3)))


def tile_psnrs(image, reference, tiles: int = 4) -> np.ndarray:
    """PSNR of each cell of a ``tiles`` x ``tiles`` grid (catches one corrupted region)."""
    a, b = _as_float(image), _as_float(reference)
    h, w = a.shape[:2]
    out = np.empty((tiles, tiles))
    for i in range(tiles):
        for j in range(tiles):
            ys = slice(i * h // tiles, (i + 1) * h // tiles)
            xs = slice(j * w // tiles, (j + 1) * w // tiles)
            out[i, j] = psnr(a[ys, xs], b[ys, xs])
    return out


@dataclass
class QualityReport:
    """One image against its reference."""

    psnr: float
    ssim: float
    max_abs: float
    worst_tile_psnr: float
    finite: bool
    blank: bool
    passed: bool
    reasons: list[str] = field(default_factory=list)
    frames: dict | None = None  # videos only: count, reduce, per-frame psnr/ssim, their means, worst frame

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("psnr", "ssim", "max_abs", "worst_tile_psnr"):
            v = d[k]
            d[k] = None if v is None or not math.isfinite(v) else round(float(v), 5)
        if d["frames"] is None:
            del d["frames"]
        return d


def is_blank(image, tol: float = BLANK_STD) -> bool:
    a = _as_float(image)
    return bool(np.isfinite(a).all() and float(a.std()) < tol)


def compare(image, reference, gates: Gates | None = None) -> QualityReport:
    """Every check of an image against its reference, with the gate verdict and its reasons; a
    video (4-d) frame by frame (``compare_video``)."""
    gates = gates or Gates()
    a, b = _as_float(image), _as_float(reference)
    if a.ndim == 4 or b.ndim == 4:
        return compare_video(a, b, gates)
    finite = bool(np.isfinite(a).all())
    blank = is_blank(a) and not is_blank(b)
    p = psnr(a, b)
    s = ssim(a, b) if finite else float("nan")
    max_abs = float(np.max(np.abs(a - b))) if finite else float("nan")
    worst = float(np.nanmin(tile_psnrs(a, b))) if finite else float("nan")
    reasons = []
    if not finite:
        reasons.append("image holds NaN or Inf")
    if blank:
        reasons.append("image is blank where the reference is not")
    if finite and not p > gates.psnr:
        reasons.append(f"PSNR {p:.2f} dB is not above {gates.psnr} dB")
    if finite and not s > gates.ssim:
        reasons.append(f"SSIM {s:.4f} is not above {gates.ssim}")
    if finite and not worst > gates.psnr - gates.tile_margin_db:
        reasons.append(f"worst tile PSNR {worst:.2f} dB is below {gates.psnr - gates.tile_margin_db} dB "
                       f"(localized corruption)")
    return QualityReport(psnr=p, ssim=s, max_abs=max_abs, worst_tile_psnr=worst, finite=finite,
                         blank=blank, passed=not reasons, reasons=reasons)


def _rounded(xs) -> list:
    return [None if not math.isfinite(x) else round(float(x), 5) for x in xs]


def _frame_list(frames: list[int]) -> str:
    return f"frame {frames[0]}" if len(frames) == 1 else f"frames {frames}"


def compare_video(video, reference, gates: Gates | None = None) -> QualityReport:
    """A video (frames, H, W, C) against its reference, every frame against the reference's frame
    of the same index with :func:`compare`; the video's figures are its worst frame's
    (``FRAME_REDUCE``), and each failing check names its frames."""
    gates = gates or Gates()
    a, b = _as_float(video), _as_float(reference)
    if a.ndim != 4 or b.ndim != 4 or a.shape != b.shape:
        what = (f"{a.shape[0]} frames where the reference has {b.shape[0]} (a frame dropped or added)"
                if a.ndim == b.ndim == 4 and a.shape[1:] == b.shape[1:]
                else f"shape {a.shape} differs from the reference's {b.shape}")
        nan = float("nan")
        return QualityReport(psnr=nan, ssim=nan, max_abs=nan, worst_tile_psnr=nan, finite=bool(np.isfinite(a).all()),
                             blank=False, passed=False, reasons=[f"video has {what}"],
                             frames={"count": int(a.shape[0]) if a.ndim == 4 else None,
                                     "reference_count": int(b.shape[0]) if b.ndim == 4 else None,
                                     "reduce": FRAME_REDUCE})
    per = [compare(a[i], b[i], gates) for i in range(a.shape[0])]
    finite = all(r.finite for r in per)
    psnrs, ssims = [r.psnr for r in per], [r.ssim for r in per]
    worst = int(np.nanargmin(psnrs)) if not all(math.isnan(x) for x in psnrs) else 0
    reasons = []
    tiles = [r.worst_tile_psnr for r in per]
    checks = [("holds NaN or Inf", lambda r: not r.finite, None),
              ("blank where the reference is not", lambda r: r.blank, None),
              (f"PSNR is not above {gates.psnr} dB", lambda r: r.finite and not r.psnr > gates.psnr,
               lambda i: f"{psnrs[i]:.2f} dB"),
              (f"SSIM is not above {gates.ssim}", lambda r: r.finite and not r.ssim > gates.ssim,
               lambda i: f"{ssims[i]:.4f}"),
              (f"worst tile PSNR is below {gates.psnr - gates.tile_margin_db} dB (localized corruption)",
               lambda r: r.finite and not r.worst_tile_psnr > gates.psnr - gates.tile_margin_db,
               lambda i: f"{tiles[i]:.2f} dB")]
    for text, failed, value in checks:
        bad = [i for i, r in enumerate(per) if failed(r)]
        if bad:
            detail = "" if value is None else \
                " (" + ", ".join(f"{i}: {value(i)}" for i in bad[:4]) + (" ..." if len(bad) > 4 else "") + ")"
            reasons.append(f"{_frame_list(bad)} of {len(per)}: {text}{detail}")
    reduce = np.min if FRAME_REDUCE == "min" else np.mean
    frames = {"count": len(per), "reduce": FRAME_REDUCE, "worst_frame": worst,
              "psnr": _rounded(psnrs), "ssim": _rounded(ssims),
              "psnr_mean": _rounded([float(np.mean(psnrs))])[0], "ssim_mean": _rounded([float(np.mean(ssims))])[0]}
    return QualityReport(psnr=float(reduce(psnrs)), ssim=float(reduce(ssims)),
                         max_abs=float(np.max([r.max_abs for r in per])),  # NaN when a frame is not finite
                         worst_tile_psnr=float(np.min(tiles)), finite=finite,
                         blank=any(r.blank for r in per), passed=not reasons, reasons=reasons, frames=frames)


@dataclass
class SetQuality:
    """Many images against their references: the worst case decides."""

    n: int
    psnr_mean: float
    psnr_min: float
    ssim_mean: float
    ssim_min: float
    max_abs: float
    worst_tile_psnr: float
    passed: bool
    reasons: list[str]
    per_image: dict[str, dict]
    frame_reduce: str | None = None  # videos: how each video's frames make its figure (its worst frame)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("psnr_mean", "psnr_min", "ssim_mean", "ssim_min", "max_abs", "worst_tile_psnr"):
            v = d[k]
            d[k] = None if v is None or not math.isfinite(v) else round(float(v), 5)
        if d["frame_reduce"] is None:
            del d["frame_reduce"]
        return d


def compare_sets(images: dict, references: dict, gates: Gates | None = None) -> SetQuality:
    """Compare images to references by key; keys missing on either side fail the set."""
    gates = gates or Gates()
    missing = sorted(set(references) ^ set(images))
    reports = {k: compare(images[k], references[k], gates) for k in sorted(references) if k in images}
    vals = list(reports.values())
    reasons = [f"{k}: {r}" for k, rep in reports.items() for r in rep.reasons]
    if missing:
        reasons.append(f"images missing for keys {missing}")
    def agg(fn, attr):
        xs = [getattr(r, attr) for r in vals]
        return float(fn(xs)) if xs else float("nan")
    return SetQuality(
        n=len(vals),
        psnr_mean=agg(np.mean, "psnr"), psnr_min=agg(np.min, "psnr"),
        ssim_mean=agg(np.mean, "ssim"), ssim_min=agg(np.min, "ssim"),
        max_abs=agg(np.max, "max_abs"), worst_tile_psnr=agg(np.min, "worst_tile_psnr"),
        passed=bool(vals) and not reasons, reasons=reasons,
        per_image={k: r.to_dict() for k, r in reports.items()},
        frame_reduce=(f"each video's PSNR/SSIM/worst tile: the {FRAME_REDUCE} over its frames; "
                      "*_min: the worst video, *_mean: the mean over videos"
                      if any(r.frames is not None for r in vals) else None),
    )
