"""The reviewer's documents of a run: ``result.md`` and a self-contained ``report.html``.

Both are built from files only — ``run.json``, ``benchmark/results.json`` and the executed
notebooks in the run folder — so ``ditbook report RUN_DIR`` rebuilds them at any time, and a run
whose stage failed still gets a report that names the failed stage and its error.

``report.html`` is one file: every image is a ``data:`` URI, the notebooks are converted with
nbconvert's ``HTMLExporter`` (``basic`` template, images embedded), the style is inline, and no
script or stylesheet is loaded from anywhere.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import re
import shlex
from pathlib import Path

from ..runs import RunFolder
from .summary import markdown_table, recommend, summary_rows

RESULT_MD = "result.md"
REPORT_HTML = "report.html"
_NB_RE = re.compile(r"^(\d+)_([a-z0-9_]+)\.ipynb$")


# -- reading a run --------------------------------------------------------------------------
def stage_rows(meta: dict) -> list[dict]:
    rows = []
    for name, st in (meta.get("stages") or {}).items():
        rows.append({"stage": name, "status": st.get("status", "?"), "seconds": st.get("seconds"),
                     "notebook": st.get("notebook"), "error": st.get("error"),
                     "failing_cell": st.get("failing_cell")})
    return rows


def failures(meta: dict) -> list[dict]:
    return [r for r in stage_rows(meta) if r["status"] == "failed"]


def benchmark_results(run: RunFolder) -> dict | None:
    return run.read_results("benchmark") if run.has_results("benchmark") else None


def notebooks(run: RunFolder) -> list[Path]:
    """The executed stage notebooks in the run folder, in stage order."""
    found = [p for p in run.path.glob("*.ipynb") if _NB_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_NB_RE.match(p.name).group(1)))


def reproduce_commands(meta: dict, run: RunFolder) -> list[str]:
    card = meta.get("card_path", "CARD")
    cmd = ["ditbook", "run", card]
    if meta.get("requested_stages"):
        cmd += ["--stages", ",".join(meta["requested_stages"])]
    for k, v in (meta.get("overrides") or {}).items():
        cmd += ["-p", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return [shlex.join(cmd), shlex.join(["ditbook", "report", str(run.path)])]


def environment_rows(meta: dict) -> list[tuple[str, str]]:
    env = meta.get("environment") or {}
    rows = [(k, str(v)) for k, v in (env.get("versions") or {}).items()]
    rows += [(k, str(v)) for k, v in (env.get("hardware") or {}).items()]
    return rows


def _ms(stat: dict | None) -> str:
    if not stat:
        return "-"
    return f"{stat['median'] * 1e3:.2f} ms (min {stat['min'] * 1e3:.2f}, max {stat['max'] * 1e3:.2f}, n={stat['n']})"


def timing_lines(res: dict) -> list[str]:
    """Plain-language lines about how the baseline was measured and how efficient it is."""
    base = res.get("baseline") or {}
    t = base.get("timing") or {}
    lines = [f"device {res.get('device')}, warm-up {res.get('warmup')}, repeats {res.get('repeats')}, "
             f"cases {len(res.get('cases') or [])}"]
    if t:
        lines.append(f"baseline end to end: {_ms(t.get('end_to_end'))}")
        for part, stat in (t.get("parts") or {}).items():
            lines.append(f"baseline {part.replace('_', ' ')}: {_ms(stat)}")
        lines.append(f"peak memory ({t.get('memory_kind')}): {t.get('peak_memory_mb')} MB")
    fl = res.get("flops")
    eff = base.get("efficiency") or {}
    if fl:
        lines.append(f"transformer FLOPs per step: {fl['gflops_per_step']} GFLOP "
                     f"({fl['calls_per_step']:g} call(s) per step)")
    if eff.get("achieved_tflops") is not None:
        share = eff.get("share_of_peak")
        lines.append(f"achieved {eff['achieved_tflops']} TFLOP/s per transformer call" +
                     (f", {share * 100:.2f}% of the {eff['peak_tflops']} TFLOP/s peak" if share is not None
                      else " (no device peak given: set benchmark.peak_tflops)"))
    if res.get("baseline_drift") is not None:
        lines.append(f"baseline re-timed at the end / at the start: {res['baseline_drift']:.3f}")
    if res.get("noise_floor"):
        nf = res["noise_floor"]
        lines.append(f"noise floor (baseline rendered twice): worst PSNR {nf.get('psnr_min')} dB, "
                     f"SSIM {nf.get('ssim_min')}, max abs {nf.get('max_abs')}")
    if res.get("intake_agreement"):
        ia = res["intake_agreement"]
        lines.append(f"baseline here vs the intake images: worst PSNR {ia.get('psnr_min')} dB, SSIM {ia.get('ssim_min')}")
    return lines


# -- result.md ------------------------------------------------------------------------------
def result_markdown(run_dir: str | Path) -> str:
    run = RunFolder(run_dir)
    meta = run.read_meta()
    res = benchmark_results(run)
    out = [f"# {meta.get('model', '?')} — run {meta.get('run_id', run.path.name)}", ""]
    out.append(f"Status: **{meta.get('status', 'unknown')}**. Written {_dt.datetime.now().isoformat(timespec='seconds')}.")
    for f in failures(meta):
        out += ["", f"**Stage `{f['stage']}` failed**: {f['error']}"]
        if f.get("failing_cell"):
            out += ["", "```", f["failing_cell"], "```"]
        if f.get("notebook"):
            out.append(f"Executed notebook with the traceback: `{f['notebook']}`.")
    out += ["", "## Reproduce", "", "```sh", *reproduce_commands(meta, run), "```"]
    out += ["", "## Hardware and versions", "", "| item | value |", "| --- | --- |"]
    out += [f"| {k} | {v} |" for k, v in environment_rows(meta)]
    out += ["", "## Stages", "", "| stage | status | seconds | error |", "| --- | --- | --- | --- |"]
    out += [f"| {r['stage']} | {r['status']} | {r['seconds'] if r['seconds'] is not None else '-'} | "
            f"{(r['error'] or '-').replace('|', '/')} |" for r in stage_rows(meta)]
    if res is None:
        out += ["", "## Summary", "", "The benchmark stage wrote no results in this run "
                f"(status: {meta.get('stages', {}).get('benchmark', {}).get('status', 'not run')}); "
                "nothing was measured."]
        return "\n".join(out) + "\n"
    rows = res.get("summary") or summary_rows(res)
    rec = res.get("recommendation") or recommend(rows, res.get("gates")).to_dict()
    out += ["", "## Summary", "", markdown_table(rows), ""]
    out += ["Speedups are end to end against the baseline measured in the same process (rows "
            "'measured here'); rows from the cache and parallel stages carry the figures those stages recorded.", ""]
    out += [f"- {line}" for line in timing_lines(res)]
    out += ["", "## Readout", "", f"Ship **{rec['name']}**: {rec['reason']}."]
    if rec.get("rejected"):
        out += ["", "Faster but rejected:", *[f"- {r}" for r in rec["rejected"]]]
    out += ["", "## Plots", ""]
    out += [f"- {k}: `benchmark/{p}`" for k, p in (res.get("plots") or {}).items()]
    out += [f"- contact sheet: `benchmark/{p}`" for p in res.get("sheets") or []]
    return "\n".join(out) + "\n"


def write_result_md(run_dir: str | Path) -> Path:
    path = Path(run_dir) / RESULT_MD
    path.write_text(result_markdown(run_dir))
    return path


# -- report.html ----------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left}
th{background:#f3f3f3}.fail{background:#fde8e8;border:1px solid #e0a0a0;padding:.6em 1em;margin:1em 0}
.ok{color:#176f2c}.bad{color:#a11}pre{background:#f7f7f7;padding:.5em;overflow-x:auto;font-size:.85em}
img{max-width:100%}.nb{border-top:2px solid #888;margin-top:2em}.jp-InputPrompt,.jp-OutputPrompt{display:none}
.jp-InputArea-editor,.input_area{background:#f7f7f7}details>summary{cursor:pointer;font-weight:600}
"""


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def table_html(rows: list[dict], columns: list[str] | None = None, table_id: str | None = None) -> str:
    """Rows of dicts as an HTML table (the notebooks display it; there is no pandas here)."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    def cell(v):
        if isinstance(v, bool):
            return '<span class="ok">yes</span>' if v else '<span class="bad">no</span>'
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape("-" if v is None else str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def notebook_html(path: Path, run_dir: Path) -> str:
    """One executed notebook as an HTML fragment, images embedded, nothing loaded remotely."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(path), as_version=4)
    exporter = HTMLExporter(template_name="basic")
    exporter.embed_images = True
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"path": str(run_dir), "name": path.stem}})
    return _strip_remote(body)


_REMOTE_TAG = re.compile(r"<script[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//[^>]*>\s*</script>|"
                         r"<link[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", re.I)


def _strip_remote(text: str) -> str:
    """Drop any script or stylesheet that would be fetched from the network."""
    return _REMOTE_TAG.sub("", text)


def report_html(run_dir: str | Path) -> str:
    run = RunFolder(run_dir)
    meta = run.read_meta()
    res = benchmark_results(run)
    title = f"ditbook report — {meta.get('model', '?')} / {meta.get('run_id', run.path.name)}"
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>Run status: <b>{html.escape(str(meta.get('status', 'unknown')))}</b>; "
             f"card <code>{html.escape(str(meta.get('card_path', '')))}</code>; created {html.escape(str(meta.get('created', '')))}.</p>"]
    for f in failures(meta):
        cell = f"<pre>{html.escape(f['failing_cell'])}</pre>" if f.get("failing_cell") else ""
        parts.append(f'<div class="fail" id="failed-{html.escape(f["stage"])}"><b>Stage <code>{html.escape(f["stage"])}</code> '
                     f"failed:</b> {html.escape(str(f['error']))}{cell}"
                     f"<p>The executed notebook with the full traceback is included below"
                     f" (<code>{html.escape(str(f.get('notebook') or ''))}</code>).</p></div>")
    parts.append("<h2>Stages</h2>" + table_html(stage_rows(meta), ["stage", "status", "seconds", "error"], "stages-table"))
    parts.append("<h2>Summary</h2>")
    if res is None:
        parts.append('<p id="no-benchmark">The benchmark stage wrote no results in this run, so there is no '
                     'timing summary; see the stage table above.</p>')
        parts.append(table_html([], ["name", "family", "speedup"], "summary-table"))
    else:
        rows = res.get("summary") or summary_rows(res)
        rec = res.get("recommendation") or recommend(rows, res.get("gates")).to_dict()
        parts.append(table_html(rows, ["name", "family", "source", "nproc", "speedup", "e2e_ms", "psnr_min",
                                        "ssim_min", "passed"], "summary-table"))
        parts.append("<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in timing_lines(res)) + "</ul>")
        parts.append(f'<h2>Readout</h2><p id="readout">Ship <b>{html.escape(rec["name"])}</b>: '
                     f"{html.escape(rec['reason'])}.</p>")
        if rec.get("rejected"):
            parts.append("<p>Faster but rejected:</p><ul>" +
                         "".join(f"<li>{html.escape(r)}</li>" for r in rec["rejected"]) + "</ul>")
        bdir = run.stage_dir("benchmark", create=False)
        figs = [(k, bdir / p) for k, p in (res.get("plots") or {}).items()]
        figs += [(f"contact sheet {Path(p).stem}", bdir / p) for p in res.get("sheets") or []]
        if figs:
            parts.append("<h2>Plots and contact sheets</h2>")
        for label, p in figs:
            if p.is_file():
                parts.append(f"<figure><img alt=\"{html.escape(label)}\" src=\"{_data_uri(p)}\">"
                             f"<figcaption>{html.escape(label)} (<code>benchmark/{html.escape(str(p.relative_to(bdir)))}</code>)"
                             f"</figcaption></figure>")
    parts.append("<h2>Hardware and versions</h2>" +
                 table_html([{"item": k, "value": v} for k, v in environment_rows(meta)], ["item", "value"]))
    parts.append("<h2>Reproduce</h2><pre>" + html.escape("\n".join(reproduce_commands(meta, run))) + "</pre>")
    for nb in notebooks(run):
        status = (meta.get("stages") or {}).get(_NB_RE.match(nb.name).group(2), {}).get("status", "?")
        try:
            frag = notebook_html(nb, run.path)
        except Exception as exc:  # an unreadable notebook is reported, not fatal to the report
            frag = f"<p class=bad>could not convert {html.escape(nb.name)}: {html.escape(str(exc))}</p>"
        note = " (built while this stage was still running; <code>ditbook report</code> rebuilds it)" \
            if status == "running" else ""
        parts.append(f'<section class="nb" id="nb-{html.escape(nb.stem)}"><details open><summary>{html.escape(nb.name)} '
                     f"— {html.escape(status)}{note}</summary>{frag}</details></section>")
    from pygments.formatters import HtmlFormatter

    style = CSS + HtmlFormatter().get_style_defs(".highlight")
    doc = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
           f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
    return _strip_remote(doc)


def build_report(run_dir: str | Path) -> Path:
    path = Path(run_dir) / REPORT_HTML
    path.write_text(report_html(run_dir), encoding="utf-8")
    return path


def rebuild(run_dir: str | Path, figures: bool = True) -> tuple[Path, Path]:
    """Re-make the plots (when benchmark results and images exist), ``result.md`` and ``report.html``."""
    run = RunFolder(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no run.json)")
    if figures and run.has_results("benchmark"):
        from .stage import make_figures

        try:
            make_figures(run)
        except FileNotFoundError:
            pass  # images were removed; keep the plots that exist
    return write_result_md(run_dir), build_report(run_dir)


__all__ = ["result_markdown", "write_result_md", "report_html", "build_report", "rebuild", "notebook_html",
           "stage_rows", "failures", "table_html", "RESULT_MD", "REPORT_HTML"]
