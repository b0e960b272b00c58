"""Small HTML and text tables of the report (pandas is not a dependency)."""

from __future__ import annotations

import html

from .report import ArchReport


def block_rows(report: ArchReport) -> list[dict]:
    rows = []
    for b in report.block_lists:
        c = b.call
        rows.append({
            "block list": b.path, "blocks": b.length, "class": b.block_class, "params": f"{b.param_share:.1%}",
            "pattern": b.forward_pattern or "none", "cache-dit": b.cache_dit_pattern or "-",
            "positional": ", ".join(c.positional) if c else "", "keywords": ", ".join(c.keywords) if c else "",
            "outputs": ", ".join(c.output_roles) if c else "", "varying args": ", ".join(c.varying_arguments) if c else "",
            "why": b.pattern_reason,
        })
    return rows


def fact_rows(report: ArchReport) -> list[dict]:
    a, c = report.attention, report.cfg
    facts = {
        "attention": a.kind, "heads": a.heads, "kv heads": a.kv_heads, "head dim": a.head_dim, "GQA ratio": a.gqa_ratio,
        "fused QKV": a.fused_qkv, "RoPE": a.rope, "masks": ", ".join(a.masks) or "none",
        "image / text tokens": f"{a.image_seq_len} / {a.text_seq_len}", "CFG": c.style,
        "transformer calls per step": c.calls_per_step, "batch per call": c.batch_per_call,
        "modulation": report.modulation, "loop extra work": report.loop_extra_work,
        "cache-dit adapter": report.support.cache_dit_adapter, "diffusers _cp_plan / _tp_plan":
            f"{report.support.diffusers_cp_plan} / {report.support.diffusers_tp_plan}",
        "cache-dit CP / TP planner": f"{report.support.cache_dit_cp_planner} / {report.support.cache_dit_tp_planner}",
    }
    return [{"fact": k, "value": v} for k, v in facts.items()]


def html_table(rows: list[dict]) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_table(rows: list[dict], max_width: int = 60) -> str:
    if not rows:
        return "(none)"
    cols = list(rows[0])
    cells = [[str(r.get(c, ""))[:max_width] for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def show(rows: list[dict]) -> None:
    """Display rows as an HTML table in a notebook, or print them as text elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display

        if get_ipython() is not None:
            display(HTML(html_table(rows)))
            return
    except ImportError:
        pass
    print(text_table(rows))
