"""The reviewer's documents of a run: ``result.md`` and a self-contained ``report.html``, built from
the run folder's files only (``ditbook report RUN_DIR`` rebuilds them; a failed stage is named).
``report.html`` embeds every image and notebook and loads nothing from anywhere.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import re
import shlex
from pathlib import Path

from ..records import BenchmarkResults, CacheResults, ParallelResults, Verdict
from ..runs import RunFolder
from .summary import summary_rows
from .shown import shown_rows
from .verdict import NOT_RECORDED, checklist, fp8_text, headline, read_stage_results, verdict

RESULT_MD = "result.md"
REPORT_HTML = "report.html"
_NB_RE = re.compile(r"^(\d+)_([a-z0-9_]+)\.ipynb$")


# -- reading a run --------------------------------------------------------------------------
def stage_rows(meta: dict) -> list[dict]:
    return [{"stage": name, "status": st.get("status", "?"), "seconds": st.get("seconds"),
             "notebook": st.get("notebook"), "error": st.get("error"), "failing_cell": st.get("failing_cell")}
            for name, st in (meta.get("stages") or {}).items()]


def failures(meta: dict) -> list[dict]:
    return [r for r in stage_rows(meta) if r["status"] == "failed"]


def benchmark_results(run: RunFolder) -> BenchmarkResults | None:
    return run.results_or_none("benchmark")


def notebooks(run: RunFolder) -> list[Path]:
    """The executed stage notebooks in the run folder, in stage order."""
    found = [p for p in run.path.glob("*.ipynb") if _NB_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_NB_RE.match(p.name).group(1)))


def relative_path(path: str | Path, meta: dict) -> str:
    """``path`` relative to the run's ``cwd``, else its checkout, else the current directory;
    unchanged when it lies outside all of them."""
    roots = [r for r in [meta.get("cwd"), ((meta.get("source") or {}).get("root")), str(Path.cwd())] if r]
    for root in roots:
        try:
            return str(Path(path).resolve().relative_to(Path(root).resolve()))
        except (ValueError, OSError):
            continue
    return str(path)


def reproduce_commands(meta: dict, run: RunFolder) -> list[str]:
    card = relative_path(meta.get("card_path", "CARD"), meta)
    cmd = ["ditbook", "run", card]
    if meta.get("requested_stages"):
        cmd += ["--stages", ",".join(meta["requested_stages"])]
    for k, v in (meta.get("overrides") or {}).items():
        cmd += ["-p", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return [shlex.join(cmd), shlex.join(["ditbook", "report", relative_path(run.path, meta)])]


def _plain(v) -> str:
    """A recorded value as a reader reads it: no Python ``[]`` / ``True``."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) if v else "none"
    return str(v)


def environment_rows(meta: dict) -> list[tuple[str, str]]:
    env = meta.get("environment") or {}
    src = meta.get("source") or {}
    rows = []
    for k, v in (env.get("versions") or {}).items():
        if k == "ditbook" and src.get("version"):
            continue  # once, below, with where it ran from
        rows.append((k, _plain(v)))
    rows += [(k, _plain(v)) for k, v in (env.get("hardware") or {}).items()]
    if src.get("version"):
        rows.append(("ditbook", str(src["version"]) + (" (installed package)" if src.get("from") != "checkout" else
                                                       " (checkout)")))
    rows.append(("git revision", (src.get("revision") or NOT_RECORDED) +
                 (" (uncommitted changes)" if src.get("dirty") else "") +
                 (" (recorded when the package was built)" if src.get("from") == "build" else "")))
    if "offline" in env:
        rows.append(("loads offline", "yes (HF_HUB_OFFLINE=1: nothing fetched from the network)" if env["offline"]
                     else _plain(env["offline"])))
    return rows


def _ms(stat: dict | None, over: str = "repeats") -> str:
    if not stat:
        return "-"
    return (f"{stat['median'] * 1e3:.2f} ms median (min {stat['min'] * 1e3:.2f}, max {stat['max'] * 1e3:.2f}, "
            f"over {stat['n']} {over})")


def timing_lines(res: BenchmarkResults) -> list[str]:
    """Plain-language lines about how the baseline was measured and how efficient it is."""
    from .shown import timing_counts

    t, eff = res.baseline.timing, res.baseline.efficiency
    lines = [f"device {res.device}; timing: {timing_counts(res)}; quality: {len(res.cases)} "
             "cases on the calibration seeds (the card's prompts × seeds), each against the uncached baseline"]
    if res.video:
        lines.append(f"cases are videos of {res.video['frames']} frames: {res.video['meaning']}")
    if t:
        lines.append(f"baseline end to end: {_ms(t['end_to_end'])}")
        for part, stat in t.get("parts", {}).items():
            over = "transformer calls (every step of every repeat)" if part == "transformer_step" else "repeats"
            lines.append(f"baseline {part.replace('_', ' ')}: {_ms(stat, over)}")
        lines.append(f"peak memory ({t.get('memory_kind')}): {t.get('peak_memory_mb')} MB")
    if res.flops:
        lines.append(f"transformer FLOPs per step: {res.flops['gflops_per_step']} GFLOP "
                     f"({res.flops['calls_per_step']:g} call(s) per step)")
    if eff and eff.get("achieved_tflops") is not None:
        share = eff.get("share_of_peak")
        lines.append(f"achieved {eff['achieved_tflops']} TFLOP/s per transformer call" +
                     (f", {share * 100:.2f}% of the {eff['peak_tflops']} TFLOP/s peak" if share is not None
                      else " (no device peak given: set benchmark.peak_tflops)"))
    if res.baseline_drift is not None:
        lines.append(f"baseline re-timed at the end / at the start: {res.baseline_drift:.3f}")
    if res.noise_floor:
        nf = res.noise_floor
        lines.append(f"noise floor (baseline rendered twice, calibration seeds): worst PSNR {nf.get('psnr_min')} dB, "
                     f"SSIM {nf.get('ssim_min')}, max abs {nf.get('max_abs')}")
    if res.intake_agreement:
        ia = res.intake_agreement
        lines.append(f"baseline here vs the intake images (calibration seeds): worst PSNR {ia.get('psnr_min')} dB, "
                     f"SSIM {ia.get('ssim_min')}")
    return lines


def _mark(ok: bool | None) -> str:
    return "✔" if ok is True else "✘" if ok is False else "–"


def not_run_plans(parallel: ParallelResults | None) -> list:
    """The parallel plans the stage did not run, each with its reason (``records.NotRun``)."""
    return list(parallel.not_run) if parallel is not None else []


def verdict_words(v: Verdict, cache: CacheResults | None) -> str | None:
    """The verdict's configuration in words (``shown.config_words``), or None when it has none."""
    from .shown import config_words

    return None if v.name in ("baseline", "none") else config_words(v.name, cache)


def _repeats(res: BenchmarkResults | None, name: str) -> int | None:
    row = res.row(name) if res is not None else None
    return row.timing["end_to_end"].get("n") if row is not None and row.timing else None


def runners_up(v: Verdict, res: BenchmarkResults | None, cache: CacheResults | None) -> list[dict]:
    """The verdict's runners-up as the report lists them: words, key, speed, quality, why not."""
    from .shown import HELD_OUT, config_words, quality_text
    from .verdict import speed_range

    own = _repeats(res, v.name)
    out = []
    for r in v.runner_ups:
        sp, lo_hi, n = r.get("speedup"), speed_range(res, r["name"]), _repeats(res, r["name"])
        speed = "speed-up not measured" if sp is None else f"{sp:.2f}× end to end" + (
            f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f})" if lo_hi else "")
        if sp is not None and own and n and n != own:
            speed += f", timed over {n} repeats against the verdict's {own}"
        out.append({"name": r["name"], "words": config_words(r["name"], cache), "speed": speed,
                    "quality": "worst-image PSNR / SSIM " + quality_text(r.get("psnr"), r.get("ssim"), HELD_OUT),
                    "why_not": r["why_not"]})
    return out


def not_chosen(v: Verdict, cache: CacheResults | None) -> list[dict]:
    """The candidates the ship rule could not take, in words, each with what it failed."""
    from .shown import config_words

    return [{"name": r["name"], "words": config_words(r["name"], cache), "why_not": r["why_not"]}
            for r in v.refused if r["name"] != v.name]


# -- result.md ------------------------------------------------------------------------------
def result_markdown(run_dir: str | Path) -> str:
    # long: the document's sections in reading order (verdict, use it, checklist, reproduce, tables)
    from .shown import LPIPS_NOTE, holdout_meaning, usage

    run = RunFolder(run_dir)
    meta = run.read_meta()
    res = benchmark_results(run)
    out = [f"# {meta.get('model', '?')} — run {meta.get('run_id', run.path.name)}", ""]
    out.append(f"Status: **{meta.get('status', 'unknown')}**. Written {_dt.datetime.now().isoformat(timespec='seconds')}.")
    stage_results = read_stage_results(run)
    cache = stage_results.get("cache")
    v = verdict(res, cache)
    f8 = fp8_text(v, cache)
    words = verdict_words(v, cache)
    out += ["", "## Verdict", "", f"**{headline(v, words)}**", ""]
    if words and words != v.name:
        out += [f"Configuration key: `{v.name}`", ""]
    out += [f"The ship rule (ditbook.ship): {v.rule or 'see benchmark/results.json'}."]
    ups = runners_up(v, res, cache)
    if ups:
        out += ["", "Runners-up (passing on held-out seeds and every check, not chosen):" if len(ups) > 1 else
                "Runner-up (passing on held-out seeds and every check, not chosen):", ""]
        out += [f"- {u['words']} — {u['speed']}, {u['quality']}: not chosen, {u['why_not']} (`{u['name']}`)"
                for u in ups]
    refused = not_chosen(v, cache)
    if refused:
        out += ["", "Not eligible:", ""] + [f"- {r['words']}: {r['why_not']} (`{r['name']}`)" for r in refused]
    out += [*(["", f8] if f8 else []), "", holdout_meaning(meta.get("card", {})), ""]
    use = usage(run, v, stage_results)
    if use:
        out += ["## Use it", ""]
        out += [f"- {k}: `{p}`" for k, p in use["files"].items()]
        if use["lines"]:
            out += ["", use["how"], "", "```python", *use["lines"], "```"]
        out += ["", "Expect: " + "; ".join(use["expect"]) + "."]
        out += [x for n in use["notes"] for x in ("", n)]
        out += ["", LPIPS_NOTE, ""]
    out += ["## Checklist", "", "| check | | figure |", "| --- | --- | --- |"]
    out += [f"| {c['item']} | {_mark(c['ok'])} | {c['figure'].replace('|', '/')} |"
            for c in checklist(meta, stage_results, v)]
    for f in failures(meta):
        out += ["", f"**Stage `{f['stage']}` failed**: {f['error']}"]
        if f.get("failing_cell"):
            out += ["", "```", f["failing_cell"], "```"]
        if f.get("notebook"):
            out.append(f"Executed notebook with the traceback: `{f['notebook']}`.")
    out += ["", "## Reproduce", "", "```sh", *reproduce_commands(meta, run), "```"]
    out += ["", "## Hardware and versions", "", "| item | value |", "| --- | --- |"]
    out += [f"| {k} | {v_} |" for k, v_ in environment_rows(meta)]
    out += ["", "## Stages", "", "| stage | status | seconds | error |", "| --- | --- | --- | --- |"]
    out += [f"| {r['stage']} | {r['status']} | {r['seconds'] if r['seconds'] is not None else '-'} | "
            f"{(r['error'] or '-').replace('|', '/')} |" for r in stage_rows(meta)]
    if res is None:
        out += ["", "## Summary", "", "The benchmark stage wrote no results in this run "
                f"(status: {meta.get('stages', {}).get('benchmark', {}).get('status', 'not run')}); "
                "nothing was measured."]
        return "\n".join(out) + "\n"
    rows = shown_rows(res.summary or summary_rows(res), res, cache, stage_results.get("parallel"))
    out += ["", "## Summary", "", summary_markdown(rows), ""]
    out += [SUMMARY_NOTE, ""]
    if v.timing_unstable:
        out += [_unstable_note(v).strip().replace("<b>", "**").replace("</b>", "**"), ""]
    skipped = not_run_plans(stage_results.get("parallel"))
    if skipped:
        out += ["Parallel plans not run:", ""] + [f"- {n.name}: {n.reason}" for n in skipped] + [""]
    out += [f"- {line}" for line in timing_lines(res)]
    out += ["", "## Plots", ""]
    out += [f"- {k}: `benchmark/{p}`" for k, p in res.plots.items()]
    if res.grid:
        out.append(f"- image grid (calibration seeds, one case per prompt): `benchmark/{res.grid}`")
    return "\n".join(out) + "\n"


SUMMARY_NOTE = ("Every PSNR/SSIM is the worst image's, labelled with what it is measured on: held-out seeds (the "
                "cache stage's confirmation on seeds it did not tune on), calibration seeds (the benchmark's render "
                "of the card's seeds, for a configuration with no held-out record), or, for a parallel plan, parity "
                "against one process beside its figure against the uncached baseline. Speed-up: median end to end "
                "against the baseline timed in the same process, in brackets the range its min and max timings "
                "allow; step and decode: the per-part speed-ups of one transformer step and of the decode. A "
                "parallel plan run as CPU processes shares the cores, so it has no speed-up: it is a parity run.")

MD_COLUMNS = ("configuration", "key", "family", "from", "proc.", "repeats", "speed-up (min–max)", "step", "decode",
              "peak MB", "worst PSNR / SSIM vs uncached baseline", "parity vs one process", "passed")


def summary_markdown(rows: list[dict]) -> str:
    """The summary as a markdown table (the same figures as :func:`summary_html`)."""
    from .shown import PARITY, quality_text, speed_text

    def x(v):
        return "-" if not isinstance(v, (int, float)) or isinstance(v, bool) else f"{v:.2f}×"

    def cells(r):
        par = r.get("psnr_parity") is not None or r.get("ssim_parity") is not None
        passed = r.get("passed_shown", r.get("passed"))
        words = r.get("words") or r.get("name")
        return [words, f"`{r.get('name')}`" if words != r.get("name") else "-", r.get("family_shown") or r.get("family"),
                str(r.get("source") or "-").replace(" stage", "").replace("measured ", ""),
                r.get("devices") or str(r.get("nproc") or 1), str(r.get("repeats") or "-"),
                speed_text(r), "-" if r.get("parity_only") else x(r.get("step_speedup")),
                "-" if r.get("parity_only") else x(r.get("decode_speedup")),
                "-" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}",
                REFERENCE if r.get("family") == "baseline" else quality_text(r.get("psnr"), r.get("ssim"), r.get("quality_on")),
                quality_text(r.get("psnr_parity"), r.get("ssim_parity"), PARITY) if par else "-",
                "-" if passed is None else "yes" if passed else "no"]

    lines = ["| " + " | ".join(MD_COLUMNS) + " |", "|" + " --- |" * len(MD_COLUMNS)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def write_result_md(run_dir: str | Path) -> Path:
    path = Path(run_dir) / RESULT_MD
    path.write_text(result_markdown(run_dir))
    return path


# -- report.html ----------------------------------------------------------------------------
CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1180px;margin:0 auto;padding:.8em 1.2em;color:#222;line-height:1.4}
h1{font-size:1.3em;margin:.2em 0 .5em}h2{font-size:1.15em;margin:1.4em 0 .4em;border-bottom:1px solid #ddd}
.box{overflow-x:auto;max-width:100%;margin:.5em 0}
table{border-collapse:collapse;font-size:.88em}th,td{border:1px solid #ccc;padding:.2em .45em;text-align:left;vertical-align:top}
td{overflow-wrap:normal;word-break:normal}th{background:#f3f3f3}td.name{min-width:9em}.tok{white-space:nowrap}.note{font-size:.8em;color:#555;margin:.2em 0}
.verdict{border:2px solid #176f2c;background:#eef8f0;padding:.55em .9em;margin:.4em 0;font-size:1.02em}
.verdict.no{border-color:#a11;background:#fdf0f0}
.verdict-row{display:flex;flex-wrap:wrap;gap:.8em;align-items:flex-start}.verdict-row>.verdict{flex:1 1 480px;min-width:0}
.verdict-row>figure{flex:0 1 380px;margin:.4em 0}.verdict-row figcaption{font-size:.8em}
#headline{font-size:1.08em}.verdict ul{margin:.2em 0 .1em;padding-left:1.2em}.verdict li{margin:.15em 0}
#gates,#rule{font-size:.93em}
code.key,.key code{font-size:.8em;color:#444;overflow-wrap:anywhere;word-break:break-word}.key{margin:.1em 0 .3em}
.use{border:1px solid #8aa;background:#f4f8f8;padding:.4em .9em;margin:.6em 0}.use pre{margin:.3em 0;font-size:.92em}
td small{color:#555}
#checklist td:nth-child(2){text-align:center;font-weight:700;width:2em}
.fail{background:#fde8e8;border:1px solid #e0a0a0;padding:.6em 1em;margin:1em 0}
.ok{color:#176f2c}.bad{color:#a11}.nr{color:#777}
pre{background:#f7f7f7;padding:.5em;overflow-x:auto;font-size:.85em;white-space:pre-wrap;overflow-wrap:anywhere}
img{max-width:100%;height:auto}figure{margin:.6em 0}figcaption{font-size:.85em;color:#555}
.twocol{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}.twocol>figure{flex:1 1 540px;min-width:0}.twocol>.box{flex:1 1 440px}#plot-key td:first-child,#summary-table td:nth-child(n+4):nth-child(-n+9){white-space:nowrap}#plot-key td.name{min-width:7em}
nav.toc{font-size:.9em}nav.toc ol{margin:.2em 0;padding-left:1.4em;columns:2}
.nb{border-top:1px solid #bbb;margin-top:.6em}.jp-InputPrompt,.jp-OutputPrompt,.prompt{display:none}
.nb .input_area,.nb .jp-InputArea-editor{background:#f7f7f7}
.nb div.output_subarea,.nb .jp-OutputArea-output{overflow-x:auto;max-width:100%}
details>summary{cursor:pointer;font-weight:600;padding:.3em 0}
"""


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


LABEL_KEYS = ("quality_on", "parity_only")  # what a row says about its own figures, shown in their cells


def table_html(rows: list[dict], columns: list[str] | None = None, table_id: str | None = None) -> str:
    """Rows of dicts as an HTML table in its own scrolling box; ``quality_on`` labels a row's
    ``psnr_min`` / ``ssim_min`` cells, ``parity_only`` drops its speed figure."""
    from .shown import ON_TEXT

    columns = columns or [k for k in dict.fromkeys(k for r in rows for k in r) if k not in LABEL_KEYS]

    def cell(v, r, c):
        if c in ("speedup", "speedup_shown") and r.get("parity_only"):
            return "- (parity run: CPU processes share the cores)"
        if isinstance(v, bool):
            return '<span class="ok">yes</span>' if v else '<span class="bad">no</span>'
        if isinstance(v, float):
            text = f"{v:.4g}"
            if c in ("psnr_min", "ssim_min") and r.get("quality_on"):
                text += f" <small>({html.escape(ON_TEXT.get(r['quality_on'], str(r['quality_on'])))})</small>"
            return text
        return html.escape("-" if v is None else str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c), r, c)}</td>" for c in columns) + "</tr>" for r in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f'<div class="box"><table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _alt_text(nb) -> None:
    """Give every image output an alt text (output metadata ``alt``) from the nearest heading above it."""
    heading = nb.metadata.get("title") or ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.lstrip().startswith("#"):
                    heading = line.lstrip("# ").strip()
                    break
            continue
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            for mime in ("image/png", "image/jpeg", "image/svg+xml"):
                if mime in data:
                    md = out.setdefault("metadata", {}).setdefault(mime, {})
                    md.setdefault("alt", f"figure: {heading}" if heading else "figure")


def notebook_html(path: Path, run_dir: Path, known_images: dict[str, tuple[str, str]] | None = None) -> str:
    """One executed notebook as an HTML fragment, images embedded; an image already in ``known_images``
    (base64 PNG -> (anchor, label)) becomes a link to it."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            png = (out.get("data") or {}).get("image/png")
            if png and known_images and png.replace("\n", "") in known_images:
                anchor, label = known_images[png.replace("\n", "")]
                out["data"] = {"text/html": f'<p><a href="#{anchor}">{html.escape(label)}: shown above</a></p>'}
    _alt_text(nb)
    exporter = HTMLExporter(template_name="basic")
    exporter.embed_images = True
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"path": str(run_dir), "name": path.stem}})
    return _strip_remote(body)


_REMOTE_TAG = re.compile(r"<script[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//[^>]*>\s*</script>|"
                         r"<link[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", re.I)


def _strip_remote(text: str) -> str:
    """Drop any script or stylesheet that would be fetched from the network."""
    return _REMOTE_TAG.sub("", text)


def _checklist_html(items: list[dict]) -> str:
    rows = []
    for c in items:
        mark = ('<span class="ok">✔</span>' if c["ok"] is True else '<span class="bad">✘</span>' if c["ok"] is False
                else '<span class="nr">–</span>')
        rows.append(f"<tr><td>{html.escape(c['item'])}</td><td>{mark}</td><td>{html.escape(c['figure'])}</td></tr>")
    return ('<div class="box"><table id="checklist"><thead><tr><th>acceptance check</th><th></th><th>figure</th></tr>'
            f"</thead><tbody>{''.join(rows)}</tbody></table></div>")


def name_html(name) -> str:
    """A configuration's name, escaped, with line-break opportunities only after ``[ , +`` and spaces."""
    pieces = re.findall(r"[^\[,+ ]*[\[,+ ]?", "-" if name is None else str(name))
    return "<wbr>".join(f"<span class=tok>{html.escape(p)}</span>" for p in pieces if p)


def config_html(words, key) -> str:
    """A configuration's words, with its full key below when the two differ."""
    if not key or str(words) == str(key):
        return name_html(words)
    return f'{html.escape(str(words))}<br><code class="key">{name_html(key)}</code>'


def _fixed(x, nd: int) -> str:
    return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x:.{nd}f}"


REFERENCE = "the reference (uncached)"


def _quality_html(psnr, ssim, on) -> str:
    """One PSNR/SSIM pair with what it is measured on, the label on its own line."""
    from .shown import quality_text

    return html.escape(quality_text(psnr, ssim, on)).replace(" (", "<br><small>(", 1).replace(")", ")</small>", 1) \
        if (psnr is not None or ssim is not None) else "-"


def _row_quality_html(r: dict) -> str:
    """A row's one figure against the uncached baseline; the baseline is the reference itself."""
    if r.get("family") == "baseline":
        return html.escape(REFERENCE)
    return _quality_html(r.get("psnr"), r.get("ssim"), r.get("quality_on"))


def _speed_html(r: dict) -> str:
    from .shown import speed_text

    sp = html.escape(speed_text(r)).replace(" (", "<br><small>(", 1)
    return sp + ("</small>" if "<small>" in sp else "")


def _key_table(rows: list[dict], labels: dict[str, str], chosen: str | None) -> str:
    """The plot's key: per configuration on the plot its key, words, speed-up and quality figure."""
    from .plots import row_id

    body = []
    for r in rows:
        name = row_id(r)
        key = "base" if r.get("family") == "baseline" else labels.get(name)
        if key is None or r.get("speedup_shown") is None or r.get("psnr") is None and r.get("family") != "baseline":
            continue  # not on the plot (not timed here, or a parity run): in the summary table
        body.append(f"<tr><td>{html.escape(key)}{' ★' if r.get('name') == chosen else ''}</td>"
                    f"<td class=name>{config_html(r.get('words') or r.get('name'), r.get('name'))}</td>"
                    f"<td>{_speed_html(r)}</td><td>{_row_quality_html(r)}</td></tr>")
    return ('<div class="box"><table id="plot-key"><thead><tr><th>key</th><th>configuration</th><th>speed-up '
            "(min–max)</th><th>worst PSNR / SSIM vs uncached baseline</th></tr></thead><tbody>" + "".join(body) +
            "</tbody></table></div>")


def _holdout_worst_html(run: RunFolder, res: BenchmarkResults | None, words: str | None = None) -> str:
    """The worst held-out image of the chosen configuration as a figure; '' when none was drawn."""
    w = res.holdout_worst if res is not None else None
    path = run.stage_dir("benchmark", create=False) / str(w["plot"]) if w else None
    if path is None or not path.is_file():
        return ""
    cap = (f"Worst held-out image of {html.escape(words or str(w.get('name')))} (case {html.escape(str(w.get('key')))}): "
           f"PSNR {_fixed(w.get('psnr'), 2)} dB, SSIM {_fixed(w.get('ssim'), 4)} (held-out seeds), "
           "against the uncached render of the same seed.")
    return (f'<figure id="holdout-worst"><img alt="the worst held-out image of the chosen configuration, its uncached '
            f'reference and their difference" src="{_data_uri(path)}"><figcaption>{cap}</figcaption></figure>')


def _off_axis(rows: list[dict], parallel: ParallelResults | None = None) -> str:
    """The caption's note of the parallel plans left off the speed axis and of those not run."""
    from .shown import display_name

    names = [display_name(r) for r in rows if r.get("parity_only")]
    out = (f' <span id="off-axis">Not on the speed axis (parallel plans run as CPU processes share the cores: parity '
           f'runs, in the summary table): {html.escape(", ".join(names))}.</span>' if names else "")
    skipped = not_run_plans(parallel)
    if skipped:
        out += f' Not run: {html.escape(", ".join(n.name for n in skipped))} (reasons below the summary table).'
    return out


def _unstable_note(v: Verdict) -> str:
    """The caveat on every speed figure of a run whose baseline drifted (the checklist's row)."""
    return (" <b>Timing was unstable in this run</b> (the baseline re-timed at the end drifted beyond "
            "benchmark.timing_drift): its speed-ups and their ranges are not reliable." if v.timing_unstable else "")


SUMMARY_HEAD = ("configuration", "from", "proc.", "repeats", "speed-up (min–max)", "e2e ms", "step", "decode",
                "peak MB", "worst PSNR / SSIM vs uncached baseline", "parity vs one process", "passed")


def summary_html(rows: list[dict], parallel: ParallelResults | None = None) -> str:
    """The summary table: each configuration once with its labelled quality figure, parity, speed-up
    with its range, per-part speed-ups and peak memory."""
    from .shown import PARITY

    def passed(v):
        return "-" if v is None else '<span class="ok">yes</span>' if v else '<span class="bad">no</span>'

    def x(v, r):
        return "-" if r.get("parity_only") or not isinstance(v, (int, float)) else f"{v:.2f}×"

    body = []
    for r in rows:
        src = str(r.get("source") or "").replace(" stage", "").replace("measured ", "")
        e2e = r.get("e2e_ms")
        par = r.get("psnr_parity") is not None or r.get("ssim_parity") is not None
        fam = html.escape(str(r.get("family_shown") or r.get("family") or ""))
        peak = "-" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}"
        cells = [f"<td class=name>{config_html(r.get('words') or r.get('name'), r.get('name'))}"
                 f"<br><small>{fam}</small></td>", f"<td>{html.escape(src)}</td>",
                 f"<td>{html.escape(r.get('devices') or str(r.get('nproc') or 1))}</td>",
                 f"<td>{r.get('repeats') or '-'}</td>", f"<td>{_speed_html(r)}</td>",
                 f"<td>{'-' if e2e is None or r.get('parity_only') else f'{e2e:.4g}'}</td>",
                 f"<td>{x(r.get('step_speedup'), r)}</td>", f"<td>{x(r.get('decode_speedup'), r)}</td>",
                 f"<td>{peak}</td>",
                 f"<td>{_row_quality_html(r)}</td>",
                 f"<td>{_quality_html(r.get('psnr_parity'), r.get('ssim_parity'), PARITY) if par else '-'}</td>",
                 f"<td>{passed(r.get('passed_shown', r.get('passed')))}</td>"]
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{html.escape(c)}</th>" for c in SUMMARY_HEAD)
    skipped = not_run_plans(parallel)
    not_run = ('<p class=note id="not-run">Parallel plans not run: ' + "; ".join(
        f"<b>{html.escape(n.name)}</b>: {html.escape(n.reason)}" for n in skipped) + ".</p>"
               if skipped else "")
    return (f'<div class="box"><table id="summary-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
            f"</tbody></table></div>{not_run}<p class=note>{html.escape(SUMMARY_NOTE)}</p>")


def _verdict_html(run: RunFolder, v: Verdict, res: BenchmarkResults | None, cache: CacheResults | None,
                  f8: str) -> str:
    """The verdict box (headline, key, gates, rule, runners-up), beside it the worst held-out image."""
    words = verdict_words(v, cache)
    g = v.gates
    key = (f'<div class="key" id="verdict-key">configuration key: <code>{name_html(v.name)}</code></div>'
           if words and words != v.name else "")
    ups = runners_up(v, res, cache)
    items = "".join(f"<li><b>{html.escape(u['words'])}</b> — {html.escape(u['speed'])}, {html.escape(u['quality'])}: "
                    f"{html.escape(str(u['why_not']))} <code class=key>{name_html(u['name'])}</code></li>" for u in ups)
    out = not_chosen(v, cache)
    refused = "".join(f"<li><b>{html.escape(r['words'])}</b>: {html.escape(r['why_not'])} "
                      f"<code class=key>{name_html(r['name'])}</code></li>" for r in out)
    rule = (f"The ship rule (ditbook.ship): {html.escape(v.rule or 'see benchmark/results.json')}."
            + ((" Runners-up" if len(ups) > 1 else " Runner-up") + f" (passing on held-out seeds and every check, "
               f"not chosen):<ul>{items}</ul>" if ups else "")
            + (f'<details id="refused"><summary>Not eligible: {len(out)} configuration{"s" if len(out) > 1 else ""} '
               f"(open for why each)</summary><ul>{refused}</ul></details>" if refused else ""))
    box = (f'<div class="verdict{"" if v.ship else " no"}" id="verdict"><b id="headline">'
           f"{html.escape(headline(v, words))}</b>{key}"
           f'<div id="gates">Gates (cache, on held-out seeds): worst-image PSNR &gt; {g.psnr:g} dB and '
           f'SSIM &gt; {g.ssim:g}. Every configuration the cache stage confirmed is timed here; one rule decides.</div>'
           f'<div id="rule">{rule}</div>' + (f'<div id="fp8">{html.escape(f8)}</div>' if f8 else "") + "</div>")
    worst = _holdout_worst_html(run, res, words)
    return f'<div class="verdict-row">{box}{worst}</div>' if worst else box


def _use_html(run: RunFolder, v: Verdict, stage_results: dict, meta: dict) -> str:
    """The "use it" box: files, lines to paste, what to expect, what held-out means here."""
    from .shown import LPIPS_NOTE, holdout_meaning, usage

    use = usage(run, v, stage_results)
    meaning = f"<p class=note>{html.escape(holdout_meaning(meta.get('card', {})))}</p>"
    if not use:
        return meaning
    files = "".join(f"<li>{html.escape(k)}: <code>{html.escape(p)}</code></li>" for k, p in use["files"].items())
    lines = (f"<p>{html.escape(use['how'])}</p><pre id=\"use-lines\">{html.escape(chr(10).join(use['lines']))}</pre>"
             if use["lines"] else "")
    notes = "".join(f"<p class=note>{html.escape(n)}</p>" for n in use["notes"])
    return (f'<div class="use" id="use-it"><b>Use it</b> (files in the run folder)<ul>{files}</ul>{lines}'
            f"<p><b>Expect:</b> {html.escape('; '.join(use['expect']))}.</p>{notes}{meaning}"
            f"<p class=note>{html.escape(LPIPS_NOTE)}</p></div>")


def report_html(run_dir: str | Path) -> str:
    # long: the page's sections in reading order (verdict, checklist, failures, plot, grid, tables, notebooks)
    run = RunFolder(run_dir)
    meta = run.read_meta()
    res = benchmark_results(run)
    stage_results = read_stage_results(run)
    v = verdict(res, stage_results.get("cache"))
    f8 = fp8_text(v, stage_results.get("cache"))
    status = str(meta.get("status", "unknown"))
    title = f"{meta.get('model', '?')} · run {meta.get('run_id', run.path.name)} · {status}"
    parts = [f'<h1 id="title">ditbook report — {html.escape(title)}</h1>']
    parts.append(_verdict_html(run, v, res, stage_results.get("cache"), f8))
    parts.append(_checklist_html(checklist(meta, stage_results, v)))
    parts.append(_use_html(run, v, stage_results, meta))
    for f in failures(meta):
        cell = f"<pre>{html.escape(f['failing_cell'])}</pre>" if f.get("failing_cell") else ""
        parts.append(f'<div class="fail" id="failed-{html.escape(f["stage"])}"><b>Stage <code>{html.escape(f["stage"])}</code> '
                     f"failed:</b> {html.escape(str(f['error']))}{cell}"
                     f"<p>The executed notebook with the full traceback is included below"
                     f" (<code>{html.escape(str(f.get('notebook') or ''))}</code>).</p></div>")
    nbs = notebooks(run)
    toc = [("plot", "Speed vs quality"), ("grid", "Images"), ("summary", "Summary table"), ("stages", "Stages"),
           ("environment", "Hardware and versions"), ("reproduce", "Reproduce")]
    toc += [(f"nb-{nb.stem}", f"Notebook {nb.name}") for nb in nbs]
    parts.append('<nav class="toc" id="toc"><b>Contents</b><ol>' +
                 "".join(f'<li><a href="#{a}">{html.escape(t)}</a></li>' for a, t in toc) + "</ol></nav>")
    known: dict[str, tuple[str, str]] = {}
    if res is None:
        parts.append('<h2 id="plot">Speed vs quality</h2><p id="no-benchmark">The benchmark stage wrote no results '
                     "in this run, so nothing was timed; see the stages table.</p>")
        parts.append('<h2 id="grid">Images</h2><p>No benchmark images.</p>')
        parts.append('<h2 id="summary">Summary table</h2>' + table_html([], ["name", "family", "speedup"], "summary-table"))
    else:
        rows = shown_rows(res.summary or summary_rows(res), res, stage_results.get("cache"),
                          stage_results.get("parallel"))
        bdir = run.stage_dir("benchmark", create=False)
        from .plots import short_labels

        labels = res.labels or short_labels(rows)
        plot = bdir / res.plots.get("tradeoff_psnr", "plots/tradeoff_psnr.png")
        parts.append('<h2 id="plot">Speed vs quality</h2><div class="twocol">')
        if plot.is_file():
            uri = _data_uri(plot)
            known[uri.split(",", 1)[1]] = ("plot", "speed vs quality plot")
            parts.append(f'<figure><img id="plot-img" alt="speed-up against worst-image PSNR per configuration, '
                         f'Pareto front ringed, the verdict starred" src="{uri}"><figcaption>Worst-image PSNR against the '
                         "uncached baseline, on held-out seeds (filled markers) or on the calibration seeds (hollow: "
                         "no held-out record), against the end-to-end speed-up; bars: the range the min and max "
                         "timings allow; ringed: the Pareto front; ★: the verdict; dotted: the gate; the baseline is "
                         "the dashed line at 1×, its images identical to themselves (no PSNR to draw)."
                         + _off_axis(rows, stage_results.get("parallel")) + _unstable_note(v) + "</figcaption></figure>")
        parts.append(_key_table(rows, labels, v.name) + "</div>")
        grid = bdir / res.grid if res.grid else None
        parts.append('<h2 id="grid">Images</h2>')
        if grid is not None and grid.is_file():
            uri = _data_uri(grid)
            known[uri.split(",", 1)[1]] = ("grid", "image grid")
            if res.grid_videos:
                n = res.grid_videos["frames"]
                parts.append(f'<figure><img id="grid-img" alt="per case, the baseline video and each configuration as '
                             f'a row of {n} frames, with its difference map below" src="{uri}"><figcaption>Videos: a row '
                             f"of frames each ({n} frames, frame numbers on top). Per case (one per prompt) the baseline, "
                             "then each configuration (key, name, worst-frame PSNR and SSIM against the uncached baseline, "
                             "calibration seed) with its difference maps below, all on one scale.</figcaption></figure>")
            else:
                parts.append(f'<figure><img id="grid-img" alt="baseline once, then each configuration and its difference '
                             f'map per prompt" src="{uri}"><figcaption>Rows: the baseline, then each configuration (key, '
                             "name) with its difference map beside each image, all maps on one scale (colour bar). "
                             "Columns: one case per prompt, on the calibration seeds (the card's seeds, the first of each prompt); "
                             "each map's PSNR is that image's against the uncached baseline, calibration seed."
                             "</figcaption></figure>")
        else:
            parts.append("<p>No image grid (no stored images).</p>")
        parts.append('<h2 id="summary">Summary table</h2>' + summary_html(rows, stage_results.get("parallel"))
                     + (f"<p class=note>{_unstable_note(v).strip()}</p>" if v.timing_unstable else ""))
        parts.append("<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in timing_lines(res)) + "</ul>")
        for k, p in res.plots.items():
            if k != "tradeoff_psnr" and (bdir / p).is_file():
                uri = _data_uri(bdir / p)
                known[uri.split(",", 1)[1]] = (f"fig-{k}", f"{k} plot")
                parts.append(f'<details id="fig-{html.escape(k)}"><summary>{html.escape(k)} plot</summary><figure>'
                             f'<img alt="{html.escape(k)} plot" src="{uri}"></figure></details>')
    parts.append('<h2 id="stages">Stages</h2>' +
                 table_html(stage_rows(meta), ["stage", "status", "seconds", "error"], "stages-table"))
    parts.append('<h2 id="environment">Hardware and versions</h2>' +
                 table_html([{"item": k, "value": v_} for k, v_ in environment_rows(meta)], ["item", "value"]))
    parts.append('<h2 id="reproduce">Reproduce</h2><pre>' + html.escape("\n".join(reproduce_commands(meta, run))) + "</pre>")
    if nbs:
        parts.append("<h2>Executed notebooks</h2>")
    for nb in nbs:
        st = meta.get("stages", {}).get(_NB_RE.match(nb.name).group(2), {}).get("status", "?")
        try:
            frag = notebook_html(nb, run.path, known)
        except Exception as exc:  # an unreadable notebook is reported, not fatal to the report
            frag = f"<p class=bad>could not convert {html.escape(nb.name)}: {html.escape(str(exc))}</p>"
        note = " (built while this stage was still running; <code>ditbook report</code> rebuilds it)" \
            if st == "running" else ""
        parts.append(f'<section class="nb" id="nb-{html.escape(nb.stem)}"><details><summary>{html.escape(nb.name)} '
                     f"— {html.escape(st)}{note}</summary>{frag}</details></section>")
    from pygments.formatters import HtmlFormatter

    style = CSS + HtmlFormatter().get_style_defs(".highlight")
    doc = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
           f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{html.escape(title)}</title>'
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
        from .figures import make_figures

        try:
            make_figures(run)
        except FileNotFoundError:
            pass  # images were removed; keep the plots that exist
    return write_result_md(run_dir), build_report(run_dir)


__all__ = ["result_markdown", "write_result_md", "report_html", "build_report", "rebuild", "notebook_html",
           "stage_rows", "failures", "table_html", "RESULT_MD", "REPORT_HTML"]
