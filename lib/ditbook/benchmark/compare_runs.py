"""What changed between two runs: card differences, versions and git revision, per-stage status
and time, metric deltas per configuration, the verdicts; then the notebooks' source diff
through nbdime (outputs, execution counts and widget state left out unless asked for)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..runs import RunFolder
from .report import notebooks
from .summary import summary_rows
from .verdict import headline, verdict

# per configuration: speed, and each quality figure with what it is measured on (benchmark.shown)
METRICS = ("speedup", "e2e_ms", "psnr", "ssim", "psnr_parity")
LABELLED = {"psnr": "quality_on", "ssim": "quality_on", "psnr_parity": None}


@dataclass
class RunComparison:
    run_a: str
    run_b: str
    model_a: str
    model_b: str
    card_changes: list[dict] = field(default_factory=list)  # {key, a, b}
    version_changes: list[dict] = field(default_factory=list)  # {item, a, b}
    stage_status: list[dict] = field(default_factory=list)  # {stage, a, b, seconds_a, seconds_b}
    deltas: list[dict] = field(default_factory=list)  # per configuration: {name, words, metric: {a, b, delta, on_a, on_b}}
    only_in: dict[str, list[str]] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)  # A/B -> headline
    unstable: list[str] = field(default_factory=list)  # the sides whose timing was unstable
    notebook_diffs: dict[str, str] = field(default_factory=dict)  # notebook -> pretty nbdime diff

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def format(self) -> str:
        out = [f"A: {self.run_a} ({self.model_a})", f"B: {self.run_b} ({self.model_b})"]
        if self.model_a != self.model_b:
            out.append("warning: the runs are of different models")
        out += ["", "card:" + ("" if self.card_changes else " identical")]
        out += [f"  {c['key']}: {_v(c['a'])} -> {_v(c['b'])}" for c in self.card_changes]
        out += ["", "versions:" + ("" if self.version_changes else " identical")]
        out += [f"  {c['item']}: {_v(c['a'])} -> {_v(c['b'])}" for c in self.version_changes]
        out += ["", "stages (status, seconds):"]
        out += [f"  {r['stage']:10s} {r['a'] or '-':8s} {_f(r['seconds_a']):>8s}  ->  {r['b'] or '-':8s} "
                f"{_f(r['seconds_b']):>8s}" for r in self.stage_status]
        out += ["", "metrics per configuration, A -> B (delta); worst PSNR/SSIM: the worst image against the "
                "uncached baseline, with the seeds it is measured on; parity: against one process; parallel plans "
                "run as CPU processes are parity runs, no speed-up:"]
        if self.unstable:
            out.append(f"  (timing unstable in {' and '.join(self.unstable)}: its speed figures are not reliable)")
        for d in self.deltas:
            words = f" ({d['words']})" if d.get("words") and d["words"] != d["name"] else ""
            out.append(f"  {d['name']}{words}: " + "; ".join(_metric_text(m, d[m]) for m in METRICS
                                                             if _shown(m, d[m])))
        for side, names in self.only_in.items():
            if names:
                out.append(f"  only in {side}: {', '.join(names)}")
        out += ["", "verdict:"] + [f"  {side}: {text}" for side, text in self.verdicts.items()]
        for name, diff in self.notebook_diffs.items():
            body = diff.rstrip()
            out += ["", f"=== notebook {name}: " + ("no source differences" if not body else "source diff (nbdime)")]
            if body:
                out.append(body)
        return "\n".join(out) + "\n"


METRIC_NAMES = {"speedup": "speedup", "e2e_ms": "e2e ms", "psnr": "worst PSNR dB", "ssim": "worst SSIM",
                "psnr_parity": "parity PSNR dB"}


def _shown(metric: str, d: dict) -> bool:
    return d.get("a") is not None or d.get("b") is not None or metric == "speedup"


def _metric_text(metric: str, d: dict) -> str:
    """One metric, A -> B, each side labelled; a delta only between figures measured alike."""
    from .shown import ON_TEXT, PARITY

    if metric == "speedup" and d.get("parity_only"):
        return "speedup: none (parity run of CPU processes)"

    def side(s: str) -> str:
        v = d.get(s)
        if v is None or metric not in LABELLED:
            return _f(v)
        on = PARITY if metric == "psnr_parity" else d.get(f"on_{s}")
        return f"{_f(v)} ({ON_TEXT.get(on, on)})"

    text = f"{METRIC_NAMES[metric]} {side('a')} -> {side('b')}"
    if d["delta"] is not None:
        text += f" ({'+' if d['delta'] >= 0 else ''}{_f(d['delta'])})"
    elif metric in LABELLED and d.get("a") is not None and d.get("b") is not None:
        text += " (not alike: measured on other seeds)"
    return text


def _f(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _v(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."


def flatten(d, prefix: str = "") -> dict:
    """Nested mappings as dotted keys (lists are values; an empty mapping is the same as none)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def changes(a: dict, b: dict) -> list[tuple[str, object, object]]:
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k), fb.get(k)) for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)]


def _rows(run: RunFolder) -> dict[str, dict]:
    """The run's configurations as the report shows them (``shown.shown_rows``), by row id."""
    if not run.has_results("benchmark"):
        return {}
    from .plots import row_id
    from .shown import shown_rows

    res = run.read_results("benchmark")
    rows = shown_rows(res.summary or summary_rows(res), res, run.results_or_none("cache"), run.results_or_none("parallel"))
    # the baseline is the reference: no quality figure of its own
    return {row_id(r): dict(r, speedup=r.get("speedup_shown"),
                            **({"psnr": None, "ssim": None} if r.get("family") == "baseline" else {})) for r in rows}


def _verdict(run: RunFolder) -> str:
    cache = run.results_or_none("cache")
    from .report import verdict_words

    v = verdict(run.results_or_none("benchmark"), cache)
    return headline(v, verdict_words(v, cache))


def _source_only(nb) -> None:
    """Keep what a person wrote: sources and tags; drop outputs, counts and metadata."""
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in ("kernelspec",)}
    for i, cell in enumerate(nb.cells):
        if "id" in cell:
            cell["id"] = f"cell-{i}"  # random per save: not a change anyone made
        tags = cell.metadata.get("tags")
        cell.metadata = {"tags": tags} if tags else {}
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None


def notebook_diff(path_a: Path, path_b: Path, outputs: bool = False) -> str:
    """nbdime's diff of two notebooks without colour; only sources and tags unless ``outputs``."""
    import nbdime
    import nbformat
    from nbdime.prettyprint import PrettyPrintConfig, pretty_print_diff

    a = nbformat.read(str(path_a), as_version=4)
    b = nbformat.read(str(path_b), as_version=4)
    if not outputs:
        for nb in (a, b):
            _source_only(nb)
    diff = nbdime.diff_notebooks(a, b)
    if not diff:
        return ""
    buf = io.StringIO()
    pretty_print_diff(a, diff, "", PrettyPrintConfig(out=buf, use_color=False, use_git=False))
    return buf.getvalue()


def compare_runs(run_a: str | Path, run_b: str | Path, outputs: bool = False) -> RunComparison:
    a, b = RunFolder(run_a), RunFolder(run_b)
    ma, mb = a.read_meta(), b.read_meta()
    cmp = RunComparison(str(a.path), str(b.path), ma.get("model", "?"), mb.get("model", "?"))
    cmp.card_changes = [{"key": k, "a": va, "b": vb} for k, va, vb in
                        changes({"card": ma.get("card", {}), "overrides": ma.get("overrides", {})},
                                {"card": mb.get("card", {}), "overrides": mb.get("overrides", {})})]
    def versions(meta: dict) -> dict:
        env, src = meta.get("environment", {}), meta.get("source", {})
        return {**env.get("versions", {}), **env.get("hardware", {}), "git revision": src.get("revision"),
                "git dirty": src.get("dirty"), "offline": env.get("offline")}

    cmp.version_changes = [{"item": k, "a": va, "b": vb} for k, va, vb in changes(versions(ma), versions(mb))]
    sta, stb = ma.get("stages", {}), mb.get("stages", {})
    cmp.stage_status = [{"stage": s, "a": sta.get(s, {}).get("status"), "b": stb.get(s, {}).get("status"),
                         "seconds_a": sta.get(s, {}).get("seconds"), "seconds_b": stb.get(s, {}).get("seconds")}
                        for s in dict.fromkeys([*sta, *stb])]
    ra, rb = _rows(a), _rows(b)
    for name in [n for n in ra if n in rb]:
        d = {"name": name, "words": rb[name].get("words")}
        for m in METRICS:
            va, vb, label = ra[name].get(m), rb[name].get(m), LABELLED.get(m)
            on_a, on_b = (ra[name].get(label), rb[name].get(label)) if label else (None, None)
            delta = vb - va if on_a == on_b and isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
            d[m] = {"a": va, "b": vb, "delta": None if delta is None else round(float(delta), 6),
                    "on_a": on_a, "on_b": on_b}
        d["speedup"]["parity_only"] = bool(ra[name].get("parity_only") or rb[name].get("parity_only"))
        cmp.deltas.append(d)
    cmp.only_in = {"A": [n for n in ra if n not in rb], "B": [n for n in rb if n not in ra]}
    cmp.verdicts = {"A": _verdict(a), "B": _verdict(b)}
    from .verdict import timing_unstable

    cmp.unstable = [side for side, run in (("A", a), ("B", b)) if timing_unstable(run.results_or_none("benchmark"))]
    nbs_b = {p.name: p for p in notebooks(b)}
    for p in notebooks(a):
        if p.name in nbs_b:
            cmp.notebook_diffs[p.name] = notebook_diff(p, nbs_b[p.name], outputs)
    return cmp


__all__ = ["RunComparison", "compare_runs", "notebook_diff", "flatten", "changes"]
