"""The equal-quality table and the Pareto plot, from the quality file (``benchmarks/pareto.py``,
reference model) and the speed file (``benchmarks/pareto_gpu.py``, FLUX.1-dev shape).

    python3 benchmarks/pareto_report.py --speed OUT/pareto_speed.json [--quality docs/pareto_quality.json]
        [--md OUT/pareto.md] [--png OUT/pareto.png]

A peer is ``dominated`` when its ditbook point has held-out PSNR and SSIM at least as high (each
aggregate the quality file names: mean and min over the images), no more work (block evaluations
in full-step equivalents, counted on the reference model), a timed pattern equal to the counted one
for both, and an eager median time no higher at the FLUX shape — and no higher compiled too when
both were timed compiled. Everything is recomputed here from the two files; the search's own
verdict is not trusted. Otherwise the row says ``not dominated`` and why.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .pareto import AGGREGATES, quality_shortfall

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-6


def _times(speed: dict) -> dict:
    return {(r["name"], r["mode"]): r for r in speed.get("rows", [])}


def dominance(quality: dict, speed: dict) -> list[dict]:
    points = {p["name"]: p for p in quality["points"]}
    times = _times(speed)
    aggregates = quality.get("aggregates") or list(AGGREGATES)
    rows = []
    for pair in quality["pairs"]:
        peer = points[pair["peer"]]
        ours = points.get(pair.get("ditbook") or "")
        row = {"peer": peer["name"], "ditbook": ours and ours["name"], "peer_point": peer, "ditbook_point": ours}
        reasons = []
        ok = lambda r: r is not None and r.get("status") == "measured"  # noqa: E731
        for mode in ("eager", "compiled"):
            tp = times.get((peer["name"], mode))
            row[f"peer_{mode}_s"] = tp["median_s"] if ok(tp) else None
        if ours is None:
            reasons.append("no ditbook point found at no more work with quality as high")
        else:
            reasons += quality_shortfall(ours.get("holdout") or {}, peer.get("holdout") or {}, aggregates)
            if ours["counts"]["work_max"] > peer["counts"]["work_min"] + TOL:
                reasons.append(f"more work {ours['counts']['work_max']:.2f} > {peer['counts']['work_min']:.2f}")
            for mode in ("eager", "compiled"):
                tp, to = times.get((peer["name"], mode)), times.get((ours["name"], mode))
                row[f"ditbook_{mode}_s"] = to["median_s"] if ok(to) else None
                if mode == "eager":
                    if not (ok(tp) and ok(to)):
                        reasons.append("no eager time for " + " and ".join(
                            n for n, r in ((peer["name"], tp), (ours["name"], to)) if not ok(r)))
                        continue
                    for n, r in ((peer["name"], tp), (ours["name"], to)):
                        if not r.get("pattern_ok", False):
                            reasons.append(f"timed pattern of {n} differs from the counted one")
                if ok(tp) and ok(to) and to["median_s"] > tp["median_s"]:
                    reasons.append(f"slower {mode}: {to['median_s']:.3f} s > {tp['median_s']:.3f} s")
        row["verdict"] = "dominated" if not reasons else "not dominated: " + "; ".join(reasons)
        rows.append(row)
    return rows


def _qs(q: dict | None) -> str:
    if not q:
        return "–"
    return f"{q['psnr_mean']:.2f} / {q['psnr_min']:.2f} dB, {q['ssim_mean']:.4f} / {q['ssim_min']:.4f}"


def _t(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def _work(p: dict) -> str:
    c = p["counts"]
    full = f"{c['full_min']}" if c.get("full_min") == c.get("full_max") else f"{c.get('full_min')}–{c.get('full_max')}"
    return f"{c['work_min']:.2f} ({full} full)"


def markdown_table(quality: dict, speed: dict) -> str:
    rows = dominance(quality, speed)
    eager = _times(speed).get(("eager", "eager"))
    eager_c = _times(speed).get(("eager", "compiled"))
    head = (f"Held-out quality on the reference model (seeds {quality.get('holdout_seeds')}, "
            f"{quality.get('steps')} steps): PSNR mean / min, SSIM mean / min over the images against the "
            f"uncached images. Work: block evaluations in full-step equivalents on the reference model "
            f"(its least-work image for a peer), full steps in brackets. Times: median end to end at the "
            f"FLUX.1-dev shape, eager {_t(eager and eager.get('median_s'))} s"
            + (f", compiled eager {_t(eager_c.get('median_s'))} s" if eager_c and eager_c.get("median_s") else "")
            + ".")
    lines = [head, "",
             "| peer | peer quality | peer work | peer s (compiled) | ditbook point | ditbook quality | ditbook work "
             "| ditbook s (compiled) | verdict |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    for r in rows:
        p, o = r["peer_point"], r["ditbook_point"]
        lines.append(f"| {p['name']} | {_qs(p.get('holdout'))} | {_work(p)} | {_t(r.get('peer_eager_s'))} "
                     f"({_t(r.get('peer_compiled_s'))}) | {o['name'] if o else '–'} | {_qs(o and o.get('holdout'))} | "
                     f"{_work(o) if o else '–'} | {_t(r.get('ditbook_eager_s'))} ({_t(r.get('ditbook_compiled_s'))}) "
                     f"| {r['verdict']} |")
    n = sum(r["verdict"] == "dominated" for r in rows)
    lines += ["", f"{n} of {len(rows)} peer points dominated."]
    return "\n".join(lines) + "\n"


def front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto front of (time, quality): faster and higher is better."""
    out, best = [], float("-inf")
    for t, q in sorted(points, key=lambda x: (x[0], -x[1])):
        if q > best:
            out.append((t, q))
            best = q
    return out


def plot(quality: dict, speed: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {p["name"]: p for p in quality["points"]}
    times = _times(speed)
    modes = [m for m in ("eager", "compiled") if any(k[1] == m and r.get("status") == "measured"
                                                     for k, r in times.items() if k[0] != "eager")]
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 5.5), squeeze=False)
    rows = dominance(quality, speed)
    for ax, mode in zip(axes[0], modes):
        xy = {}
        for name, p in points.items():
            r = times.get((name, mode))
            if r and r.get("status") == "measured" and p.get("holdout"):
                xy[name] = (r["median_s"], p["holdout"]["psnr_mean"])
        for name, (x, y) in xy.items():
            peer = points[name]["owner"] != "ditbook"
            ax.scatter([x], [y], marker="X" if peer else "o", s=70, color="tab:red" if peer else "tab:blue",
                       zorder=3, label=None)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        for r in rows:
            if r["ditbook"] in xy and r["peer"] in xy:
                (x0, y0), (x1, y1) = xy[r["peer"]], xy[r["ditbook"]]
                ax.annotate("", (x1, y1), (x0, y0), arrowprops={
                    "arrowstyle": "->", "color": "tab:green" if r["verdict"] == "dominated" else "tab:gray", "lw": 1})
        f = front(list(xy.values()))
        if f:
            ax.step([t for t, _ in f], [q for _, q in f], where="post", color="tab:blue", alpha=0.4, lw=1,
                    label="Pareto front (all points)")
        e = times.get(("eager", mode))
        if e and e.get("status") == "measured":
            ax.axvline(e["median_s"], color="k", ls=":", lw=1, label=f"eager {e['median_s']:.2f} s")
        ax.scatter([], [], marker="X", color="tab:red", label="peers (cache-dit, diffusers)")
        ax.scatter([], [], marker="o", color="tab:blue", label="ditbook")
        ax.set_xlabel(f"end-to-end time, s ({mode}, FLUX.1-dev shape, {speed.get('size')}², {speed.get('steps')} steps)")
        ax.set_ylabel("held-out PSNR mean, dB (reference model)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"speed vs quality, {mode}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality", type=Path, default=REPO / "docs" / "pareto_quality.json")
    ap.add_argument("--speed", type=Path, required=True, help="pareto_gpu.py's OUT/pareto_speed.json")
    ap.add_argument("--md", type=Path, default=None, help="default: next to --speed, pareto.md")
    ap.add_argument("--png", type=Path, default=None, help="default: next to --speed, pareto.png")
    a = ap.parse_args(argv)
    quality, speed = json.loads(a.quality.read_text()), json.loads(a.speed.read_text())
    md = a.md or a.speed.with_name("pareto.md")
    png = a.png or a.speed.with_name("pareto.png")
    text = markdown_table(quality, speed)
    md.write_text(text)
    plot(quality, speed, png)
    print(text)
    print(f"wrote {md} and {png}")
    return 0 if all(r["verdict"] == "dominated" for r in dominance(quality, speed)) else 1
