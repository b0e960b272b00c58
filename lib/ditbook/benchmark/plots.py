"""Benchmark plots as PNG files (matplotlib, Agg backend): trade-offs with the Pareto frontier,
residual change per step, parallel scaling with the ideal line, and contact sheets with
difference maps."""

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
    """Indices of the points no other point beats on both axes (higher is better on both),
    ordered by the first axis."""
    idx = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: points[i][0])


def diff_map(image, reference, gain: float = 4.0) -> np.ndarray:
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


def plot_tradeoff(rows: list[dict], metric: str, path: str | Path, gate: float | None = None) -> Path:
    """Speedup (x) against ``metric`` (``psnr_min`` or ``ssim_min``, y) per family, with the Pareto
    frontier of all points and the baseline at (1, best)."""
    plt = _plt()
    pts = [(r, _num(r.get("speedup")), _num(r.get(metric))) for r in rows]
    pts = [(r, x, y) for r, x, y in pts if x is not None and y is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    families = sorted({r.get("family", "?") for r, _, _ in pts})
    markers = "osD^v<>pP*X"
    for k, fam in enumerate(families):
        sel = [(r, x, y) for r, x, y in pts if r.get("family") == fam]
        ax.scatter([x for _, x, _ in sel], [y for _, _, y in sel], label=fam, marker=markers[k % len(markers)], s=46)
        for r, x, y in sel:
            ax.annotate(str(r.get("name")), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if pts:
        front = pareto_frontier([(x, y) for _, x, y in pts])
        ax.plot([pts[i][1] for i in front], [pts[i][2] for i in front], "k--", lw=1, label="Pareto frontier")
    if gate is not None:
        ax.axhline(gate, color="tab:red", lw=0.8, ls=":", label=f"gate {gate:g}")
    label = {"psnr_min": "worst-image PSNR (dB)", "ssim_min": "worst-image SSIM"}.get(metric, metric)
    ax.set_xlabel("speedup vs baseline (end to end, ×)")
    ax.set_ylabel(label)
    if metric == "psnr_min":
        ax.set_title(f"speed vs quality (identical images plotted at {PSNR_CAP:g} dB)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
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
                  quality: dict[str, dict] | None = None, gain: float = 4.0) -> Path:
    """One prompt's sheet: a row per configuration with baseline, configuration and difference
    map (×``gain``); the row title carries its PSNR/SSIM against the baseline."""
    plt = _plt()
    names = list(images)
    nrows = max(1, len(names))
    fig, axes = plt.subplots(nrows, 3, figsize=(6.6, 2.3 * nrows), dpi=100, squeeze=False)
    for i in range(nrows):
        for ax in axes[i]:
            ax.axis("off")
        if not names:
            axes[i][0].imshow(np.clip(baseline, 0, 1))
            axes[i][0].set_title("baseline", fontsize=8)
            continue
        name = names[i]
        img = images[name]
        q = (quality or {}).get(name) or {}
        axes[i][0].imshow(np.clip(baseline, 0, 1))
        axes[i][0].set_title("baseline", fontsize=8)
        axes[i][1].imshow(np.clip(np.nan_to_num(img), 0, 1))
        title = name
        if q.get("psnr") is not None:
            title += f"\nPSNR {q['psnr']:.1f} dB  SSIM {q.get('ssim', float('nan')):.3f}"
        axes[i][1].set_title(title, fontsize=8)
        axes[i][2].imshow(diff_map(img, baseline, gain))
        axes[i][2].set_title(f"|difference| ×{gain:g}", fontsize=8)
    fig.suptitle(key, fontsize=9)
    return _save(fig, path)


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


__all__ = ["pareto_frontier", "diff_map", "plot_tradeoff", "plot_residuals", "plot_scaling", "contact_sheet"]
