"""The inspection report as table rows (shown with ``ditbook.display``)."""

from __future__ import annotations

from ..arch.report import ArchReport


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


