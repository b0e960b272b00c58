"""Benchmark plots as PNG files (matplotlib, Agg backend): trade-offs with the Pareto frontier,
residual change per step, parallel scaling, the image grid and per-prompt contact sheets."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..quality import PSNR_CAP


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def pareto_frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes, ordered by the first axis."""
    idx = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: points[i][0])


def diff_map(image, reference, gain: float = 10.0) -> np.ndarray:
    """|image - reference| averaged over channels, amplified by ``gain``, as an RGB heat image
    in [0, 1] (black: equal; yellow: large). NaN/Inf show as magenta."""
    a = np.asarray(image, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    d = np.abs(a - b)
    if d.ndim == 3:
        d = d.mean(axis=-1)
    bad = ~np.isfinite(d)
    d = np.clip(np.nan_to_num(d, nan=0.0, posinf=0.0) * gain, 0.0, 1.0)
    rgb = np.stack([np.clip(2 * d, 0, 1), np.clip(2 * d - 0.5, 0, 1), np.zeros_like(d)], axis=-1)
    rgb[bad] = (1.0, 0.0, 1.0)
    return rgb.astype(np.float32)


def wrap_name(name: str, width: int) -> list[str]:
    """A name in lines of about ``width`` characters, broken only after ``[ , +`` and spaces."""
    import re

    lines, line = [], ""
    for piece in re.findall(r"[^\[,+ ]*[\[,+ ]?", name):
        if line and len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
    return lines + ([line.rstrip()] if line.strip() else [])


def row_id(r: dict) -> str:
    """A row's name, with its process count when it ran on more than one."""
    n = int(r.get("nproc") or 1)
    return str(r.get("name")) + (f" ×{n} proc" if n > 1 else "")


def short_labels(rows: list[dict]) -> dict[str, str]:
    """A short key (A, B, ..., AA, ...) per configuration in row order, baseline excepted, by row id."""
    out: dict[str, str] = {}
    for r in rows:
        name = row_id(r)
        if r.get("family") == "baseline" or name in out:
            continue
        i, key = len(out), ""
        while True:
            key = chr(ord("A") + i % 26) + key
            i = i // 26 - 1
            if i < 0:
                break
        out[name] = key
    return out


def plot_tradeoff(rows: list[dict], metric: str, path: str | Path, gate: float | None = None,
                  labels: dict[str, str] | None = None, highlight: str | None = None) -> Path:
    """Speedup (x) against ``metric`` (y), one marker per family, each point with its short key and
    its ``speedup_range`` bar; the Pareto front ringed, ``highlight`` starred, the baseline a dashed
    line at 1×; identical images (PSNR at the cap) on a band whose tick says "identical"."""
    # long: one figure drawn layer by layer (baseline, points, bars, front, highlight, gate, labels, legend)
    plt = _plt()
    labels = labels if labels is not None else short_labels(rows)
    pts = [(r, _num(r.get("speedup")), _num(r.get(metric))) for r in rows if r.get("family") != "baseline"]
    pts = [(r, x, y) for r, x, y in pts if x is not None and y is not None]
    capped_y = metric == "psnr_min"
    others = [y for _, _, y in pts if not capped_y or y < PSNR_CAP - 1e-6]
    lows = others + ([gate] if gate is not None else [])
    top = None
    if capped_y and len(others) < len(pts):  # identical images: a band above the real figures
        span = max((max(others) - min(lows)) if lows else 1.0, 1.0)
        top = (max(others) if others else (gate or 0.0)) + 0.3 * span
    raised = {id(r) for r, _, y in pts if top is not None and y >= PSNR_CAP - 1e-6}
    pts = [(r, x, top if id(r) in raised else y) for r, x, y in pts]
    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=200)
    ax.axvline(1.0, color="0.45", lw=1.1, ls="--", zorder=0, label="baseline (1×, uncached)")
    families = sorted({str(r.get("family", "?")) for r, _, _ in pts})
    markers = "osD^v<>pPX"
    if pts:
        front = pareto_frontier([(x, y) for _, x, y in pts])
        ax.plot([pts[i][1] for i in front], [pts[i][2] for i in front], "-", color="0.3", lw=1.2, zorder=1,
                label="Pareto front")
        ax.scatter([pts[i][1] for i in front], [pts[i][2] for i in front], s=170, facecolors="none",
                   edgecolors="0.3", lw=1.2, zorder=2)
    for r, x, y in pts:  # the speed-up's range from the min and max timings
        lo_hi = r.get("speedup_range")
        if lo_hi and _num(lo_hi[0]) is not None and _num(lo_hi[1]) is not None:
            ax.errorbar([x], [y], xerr=[[max(0.0, x - lo_hi[0])], [max(0.0, lo_hi[1] - x)]], fmt="none",
                        ecolor="0.35", elinewidth=1.0, capsize=3, zorder=2)
    for k, fam in enumerate(families):
        sel = [(r, x, y) for r, x, y in pts if str(r.get("family", "?")) == fam]
        hollow = [r.get("quality_on") == "calibration" for r, _, _ in sel]
        held = [(x, y) for (_, x, y), h in zip(sel, hollow) if not h]
        calib = [(x, y) for (_, x, y), h in zip(sel, hollow) if h]
        sc = ax.scatter([x for x, _ in held], [y for _, y in held], label=f"{fam} (held-out seeds)" if held else None,
                        marker=markers[k % len(markers)], s=48, zorder=3)
        if calib:
            ax.scatter([x for x, _ in calib], [y for _, y in calib], label=f"{fam} (calibration seeds)",
                       marker=markers[k % len(markers)], s=48, zorder=3, facecolors="none",
                       edgecolors=sc.get_facecolor()[0] if held else None, linewidths=1.3)
    for r, x, y in pts:
        key = labels.get(row_id(r), "?")
        if highlight is not None and str(r.get("name")) == highlight:
            ax.scatter([x], [y], marker="*", s=320, color="gold", edgecolors="k", lw=0.8, zorder=5,
                       label="verdict")
        ax.annotate(key, (x, y), fontsize=9, fontweight="bold", xytext=(6, 5), textcoords="offset points", zorder=4)
    if top is not None:
        ax.axhline(top, color="0.6", lw=0.8, ls=":", zorder=0)
    if gate is not None:
        ax.axhline(gate, color="tab:red", lw=1, ls=":", label=f"gate {gate:g}")
    xs = [x for _, x, _ in pts] + [1.0] + [v for r, _, _ in pts for v in (r.get("speedup_range") or [])
                                          if _num(v) is not None]
    ys = [y for _, _, y in pts] + ([gate] if gate is not None else [])
    if ys:
        xpad = max(0.05, (max(xs) - min(xs)) * 0.08)
        ypad = max(1e-3, (max(ys) - min(ys)) * 0.08)
        ax.set_xlim(min(xs) - xpad, max(xs) + 2.5 * xpad)
        ax.set_ylim(min(ys) - ypad, max(ys) + 2 * ypad)
    if top is not None:  # the band's tick says what it is; no number is drawn above the real figures
        ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t < top - 0.15 * (top - min(lows or [top - 1]))]
        ax.set_yticks(ticks + [top])
        ax.set_yticklabels([f"{t:g}" for t in ticks] + ["identical"])
    label = {"psnr_min": "worst-image PSNR vs uncached baseline (dB)", "ssim_min": "worst-image SSIM"}.get(metric, metric)
    ax.set_xlabel("speed-up vs baseline, end to end (×); bars: min–max timings", fontsize=9)
    ax.set_ylabel(label, fontsize=9)
    ax.set_title("speed vs worst-image quality (filled: held-out seeds; hollow: calibration seeds)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), borderaxespad=0, frameon=False,
              ncol=2)
    return _save(fig, path)


def plot_residuals(series: dict[str, list[float]], path: str | Path) -> Path:
    """Relative L1 change of the first block's residual against the step index, per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for name, ys in series.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, label=name)
    ax.set_xlabel("transformer call (step)")
    ax.set_ylabel("relative L1 change of residual")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    if series:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_scaling(rows: list[dict], path: str | Path) -> Path:
    """Speedup against process count per plan, with the ideal (linear) line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 4.2), dpi=100)
    pts = [(r, int(r.get("nproc") or 1), _num(r.get("speedup"))) for r in rows]
    pts = [(r, n, s) for r, n, s in pts if s is not None]
    nmax = max([n for _, n, _ in pts] + [2])
    ax.plot([1, nmax], [1, nmax], "k--", lw=1, label="ideal")
    by_plan: dict[str, list] = {}
    for r, n, s in pts:
        by_plan.setdefault(str(r.get("name")), []).append((n, s))
    for name, ns in by_plan.items():
        ns = sorted([(1, 1.0)] + ns)
        ax.plot([n for n, _ in ns], [s for _, s in ns], marker="o", label=name)
    ax.set_xlabel("processes")
    ax.set_ylabel("speedup vs one process (×)")
    ax.set_xticks(range(1, nmax + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def contact_sheet(key: str, baseline: np.ndarray, images: dict[str, np.ndarray], path: str | Path,
                  quality: dict[str, dict] | None = None, gain: float = 10.0) -> Path:
    """One prompt's sheet: per configuration the baseline, its image and the difference map."""
    plt = _plt()
    names = list(images)
    nrows = max(1, len(names))
    fig, axes = plt.subplots(nrows, 3, figsize=(6.6, 2.3 * nrows), dpi=100, squeeze=False)
    for i in range(nrows):
        for ax in axes[i]:
            ax.axis("off")
        axes[i][0].imshow(np.clip(baseline, 0, 1))
        axes[i][0].set_title("baseline", fontsize=8)
        if not names:
            continue
        name = names[i]
        img = images[name]
        q = (quality or {}).get(name) or {}
        axes[i][1].imshow(np.clip(np.nan_to_num(img), 0, 1))
        title = name
        if q.get("psnr") is not None:
            title += f"\nPSNR {q['psnr']:.1f} dB  SSIM {q.get('ssim', float('nan')):.3f}"
        axes[i][1].set_title(title, fontsize=8)
        axes[i][2].imshow(diff_map(img, baseline, gain))
        axes[i][2].set_title(f"|difference| ×{gain:g}", fontsize=8)
    fig.suptitle(key, fontsize=9)
    return _save(fig, path)


FONT = 9.5  # the grid's and the worst-image figure's text size (pt): about 11 px in the report
DIFF_GAIN = 10.0  # one gain for every difference map: |difference| of 1/DIFF_GAIN or more is full scale


def _abs_diff(image, reference) -> np.ndarray:
    """|image - reference|, averaged over channels."""
    d = np.abs(np.asarray(image, dtype=np.float64) - np.asarray(reference, dtype=np.float64))
    return d.mean(axis=-1) if d.ndim == 3 else d


def _row_label(name: str, labels: dict | None, words: dict | None, width: int) -> str:
    """A configuration's row label: its short key and its name in words, wrapped."""
    short = (labels or {}).get(name)
    said = (words or {}).get(name) or name
    return "\n".join(wrap_name(f"{short}: {said}" if short else said, width))


def image_grid(baseline: dict[str, np.ndarray], images: dict[str, dict[str, np.ndarray]], path: str | Path,
               prompts: dict[str, str] | None = None, labels: dict[str, str] | None = None,
               gain: float = DIFF_GAIN, words: dict[str, str] | None = None) -> Path:
    """Configurations as rows, prompts as columns: the baseline once, then per configuration its image
    and its difference map, all maps on one scale (``gain``) with one colour bar. ``baseline`` /
    ``images[name]``: case key -> image; ``prompts``: column titles; ``words``: row labels. Videos:
    :func:`video_grid`."""
    # long: one figure drawn cell by cell (column titles, row labels, images, maps, one colour bar)
    import textwrap

    from ..quality import psnr

    if any(np.ndim(v) == 4 for v in baseline.values()):  # videos (render.is_video)
        return video_grid(baseline, images, path, prompts, labels, gain, words)

    plt = _plt()
    keys = list(baseline)
    names = list(images)
    ncols = 2 * max(1, len(keys))
    nrows = 1 + len(names)
    fig, axes = plt.subplots(nrows, ncols, figsize=(1.45 * ncols + 1.2, 1.75 * nrows + 0.6), dpi=200,
                             squeeze=False)
    for row in axes:
        for ax in row:
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
    vmax = 1.0 / gain
    mappable = None
    for j, key in enumerate(keys):
        text = (prompts or {}).get(key, key)
        title = "\n".join(textwrap.wrap(f"{key} (calibration seed): {text}", 26)[:3])
        axes[0][2 * j].imshow(np.clip(baseline[key], 0, 1))
        axes[0][2 * j].set_title(title, fontsize=FONT, loc="left")
        axes[0][2 * j + 1].axis("off")
    axes[0][0].set_ylabel("baseline\n(uncached)", fontsize=FONT)
    for i, name in enumerate(names, start=1):
        axes[i][0].set_ylabel(_row_label(name, labels, words, 17), fontsize=FONT)
        for j, key in enumerate(keys):
            img = images[name].get(key)
            if img is None:
                axes[i][2 * j].axis("off")
                axes[i][2 * j + 1].axis("off")
                continue
            axes[i][2 * j].imshow(np.clip(np.nan_to_num(img), 0, 1))
            d = _abs_diff(img, baseline[key])
            mappable = axes[i][2 * j + 1].imshow(np.nan_to_num(d, nan=vmax, posinf=vmax), cmap="magma", vmin=0,
                                                 vmax=vmax)
            p = psnr(img, baseline[key])
            axes[i][2 * j + 1].set_title(f"PSNR {p:.1f} dB\n(calibration seed)", fontsize=FONT)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    if mappable is not None:
        cax = fig.add_axes((0.945, 0.15, 0.015, 0.7))
        bar = fig.colorbar(mappable, cax=cax)
        bar.set_label(f"|difference| (×{gain:g}: full scale = {vmax:g})", fontsize=FONT)
        bar.ax.tick_params(labelsize=FONT - 1)
    return _save(fig, path, tight=False)


def video_grid(baseline: dict[str, np.ndarray], images: dict[str, dict[str, np.ndarray]], path: str | Path,
               prompts: dict[str, str] | None = None, labels: dict[str, str] | None = None,
               gain: float = DIFF_GAIN, words: dict[str, str] | None = None) -> Path:
    """The image grid for videos: per case the baseline's frames in a row, then per configuration its
    frames (labelled with the worst frame's PSNR and SSIM) and their difference maps below."""
    import textwrap

    from ..quality import compare
    from ..render_sheet import diff_frames, pick_frames, sheet_frames, video_sheet

    judged, worst = [], []  # (key, name, image, comparison); every worst frame is among those shown
    for key, base in baseline.items():
        for name, by_key in images.items():
            img = by_key.get(key)
            if img is not None:
                q = compare(img, base)
                judged.append((key, name, img, q))
                if q.frames and q.frames.get("worst_frame") is not None:
                    worst.append(q.frames["worst_frame"])
    shown = sheet_frames(list(baseline.values()), worst)
    rows: list[tuple[str, np.ndarray]] = []
    for key, base in baseline.items():
        text = (prompts or {}).get(key, "")
        picked = pick_frames(base, shown)
        rows.append(("\n".join(textwrap.wrap(f"{key} baseline: {text}", 34)[:2]), picked))
        for _, name, img, q in (j for j in judged if j[0] == key):
            head = _row_label(name, labels, words, 60)
            fig_q = (f"worst frame {q.frames['worst_frame']}: {q.psnr:.1f} dB, SSIM {q.ssim:.3f} (calibration seed)"
                     if q.frames and q.frames.get("worst_frame") is not None else "; ".join(q.reasons)[:60])
            rows.append((f"{head}\n{fig_q}", pick_frames(img, shown)))
            if np.shape(img) == np.shape(base):
                rows.append((f"|Δ| ×{gain:g} (full scale {1 / gain:g})", diff_frames(pick_frames(img, shown), picked, gain)))
    fig = video_sheet(rows, "videos: a row of frames each (frame numbers on top, the worst frames among them); under "
                            "each configuration its difference map", path, frame_numbers=shown)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return Path(path)


def worst_image_figure(reference: np.ndarray, image: np.ndarray, path: str | Path, title: str | None = None,
                       gain: float = DIFF_GAIN) -> Path:
    """The image behind a worst-case figure: the uncached reference, the configuration's image and
    their difference (one scale, ``gain``) side by side; ``title`` above it, if given."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(4.6, 1.95), dpi=200)
    d = _abs_diff(image, reference)
    for ax, img, label in ((axes[0], np.clip(reference, 0, 1), "uncached\n(held-out seed)"),
                           (axes[1], np.clip(np.nan_to_num(image), 0, 1), "chosen\nconfiguration"),
                           (axes[2], None, f"|difference|\n×{gain:g} (full {1 / gain:g})")):
        if img is None:
            ax.imshow(np.nan_to_num(d, nan=1 / gain), cmap="magma", vmin=0, vmax=1 / gain)
        else:
            ax.imshow(img)
        ax.set_title(label, fontsize=FONT)
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=FONT)
    return _save(fig, path)


def _save(fig, path, tight: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight", pad_inches=0.08)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


__all__ = ["pareto_frontier", "diff_map", "short_labels", "plot_tradeoff", "plot_residuals", "plot_scaling",
           "contact_sheet", "image_grid", "video_grid", "worst_image_figure", "row_id", "DIFF_GAIN"]
