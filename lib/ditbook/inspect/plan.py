"""The integration plan a reviewer approves (its approval: ``ditbook.approval``).

``build_plan`` turns the architecture report and the code surface into a plain mapping: the
facts, the proposed cache adapter, the parallel candidates, the risks and the acceptance gates.
Any change to the model that changes the plan invalidates an earlier approval.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..approval import PLAN_JSON, PLAN_MD, acceptance_gates, plan_hash, weights_identity
from .code_surface import CodeSurface
from ..arch.report import ArchReport


def _risk(rid: str, severity: str, text: str, mitigation: str) -> dict:
    return {"id": rid, "severity": severity, "text": text, "mitigation": mitigation}


def _divisors(n: int | None, options=(2, 4, 8)) -> list[int]:
    return [d for d in options if n and n % d == 0]


def structural_risks(report: ArchReport) -> list[dict]:
    """Risks that decide whether a block cache can apply at all; they come first in the plan."""
    out = []
    if not report.block_lists:
        out.append(_risk("no_block_list", "high",
                         f"inspection found no block list in {report.transformer_class} (no ModuleList of modules "
                         f"that the forward calls and that run attention)",
                         "the cache stage refuses with this reason (nothing for a block cache to skip) and the run "
                         "goes on without cache configurations"))
    for note in report.notes:
        if "outside its loop" in note or "no loop over" in note:
            out.append(_risk("block_list_use", "high", note,
                             "that list is left uncached (a cached unit standing in for it would change what the "
                             "code sees)"))
    return out


def _plan_facts(report: ArchReport) -> dict:
    """What the inspection found, as the plan records it."""
    att, cfg = report.attention, report.cfg
    lists = [{
        "path": b.path, "length": b.length, "block_class": b.block_class, "param_share": round(b.param_share, 3),
        "forward_pattern": b.forward_pattern, "compatible_patterns": b.compatible_patterns,
        "pattern_reason": b.pattern_reason, "cache_dit_pattern": b.cache_dit_pattern,
        "called_with": {"positional": b.call.positional, "keywords": b.call.keywords,
                        "outputs": b.call.output_roles, "varying_arguments": b.call.varying_arguments} if b.call else None,
    } for b in report.block_lists]
    facts = {
        "block_lists": lists,
        "attention": {k: getattr(att, k) for k in ("heads", "kv_heads", "head_dim", "gqa_ratio", "kind", "fused_qkv",
                                                     "masks", "text_seq_len", "image_seq_len", "rope", "native_gqa")},
        "cfg": {"style": cfg.style, "calls_per_step": cfg.calls_per_step, "batch_per_call": cfg.batch_per_call},
        "modulation": report.modulation,
        "loop_extra_work": report.loop_extra_work,
        "loop_work": report.loop_extra_work_reasons,
        "loop_work_conditional": report.loop_work_conditional,
        "traced": report.traced,
    }
    return facts


def _plan_cache_adapter(report: ArchReport) -> dict:
    """How the cache stage will wire the model into cache-dit."""
    sup = report.support
    separate = report.cfg.style == "separate"
    needs_functor = report.loop_extra_work
    cache_adapter = {
        "source": (f"cache-dit registered adapter {sup.cache_dit_adapter!r}" if sup.cache_dit_adapter
                   else "a BlockAdapter built by ditbook from this report"),
        "blocks": [b.path for b in report.block_lists if b.forward_pattern],
        "forward_patterns": [b.forward_pattern for b in report.block_lists if b.forward_pattern],
        "uncacheable_blocks": [b.path for b in report.block_lists if not b.forward_pattern],
        "patch_functor_needed": needs_functor,
        "patch_functor": sup.cache_dit_patch_functor if needs_functor else None,
        "has_separate_cfg": separate,
    }
    return cache_adapter


def _plan_parallel_candidates(report: ArchReport) -> list[dict]:
    """The parallel kinds and degrees the architecture admits."""
    att, cfg, sup = report.attention, report.cfg, report.support
    heads, kv = att.heads, att.kv_heads or att.heads
    parallel = []
    if cfg.style in ("separate", "batched"):
        parallel.append({"kind": "cfg", "degrees": [2], "via": "split the conditional/unconditional batch or calls"})
    cp_via = ("diffusers _cp_plan" if sup.diffusers_cp_plan else
              f"cache-dit CP planner {sup.cache_dit_cp_planner!r}" if sup.cache_dit_cp_planner else "a ditbook CP plan (none registered)")
    ulysses = [d for d in _divisors(heads) if d in _divisors(kv)]
    if ulysses:
        parallel.append({"kind": "ulysses", "degrees": ulysses, "via": cp_via})
    ring = _divisors(att.image_seq_len)
    if ring:
        parallel.append({"kind": "ring", "degrees": ring, "via": cp_via})
    if sup.diffusers_tp_plan or sup.cache_dit_tp_planner:
        parallel.append({"kind": "tensor", "degrees": _divisors(heads),
                         "via": "diffusers _tp_plan" if sup.diffusers_tp_plan else f"cache-dit TP planner {sup.cache_dit_tp_planner!r}"})

    return parallel


def _plan_risks(report: ArchReport, parallel: list[dict]) -> list[dict]:
    """Structural risks first, then attention, call-convention, loop-work, CFG and GQA risks."""
    att, cfg, sup = report.attention, report.cfg, report.support
    separate = cfg.style == "separate"
    heads, kv = att.heads, att.kv_heads or att.heads
    risks = structural_risks(report)
    if att.masks:
        risks.append(_risk("masks_under_cp", "high" if any(p["kind"] in ("ulysses", "ring") for p in parallel) else "medium",
                           f"attention masks enter at {att.masks}; under context parallelism they must be split or "
                           f"gathered with the sequence they mask",
                           "check the CP plan shards every mask; compare a masked prompt against the single-process baseline"))
    kw_lists = [b.path for b in report.block_lists if b.call and b.call.keywords]
    if kw_lists:
        unnamed = [b.path for b in report.block_lists if (b.forward_pattern is None and "no parameter named" in b.pattern_reason)
                   or "traced streams" in b.pattern_reason]
        risks.append(_risk("keyword_called_blocks", "high" if unnamed else "low",
                           f"the transformer calls {kw_lists} with keyword arguments"
                           + (f"; {unnamed} name their streams differently, so cache-dit cannot bind them" if unnamed else ""),
                           "the cached forward takes (hidden_states, encoder_hidden_states, *args, **kwargs): keep the "
                           "names; wrap blocks whose streams are named differently"))
    if report.loop_extra_work:
        risks.append(_risk("dropped_loop_work", "high",
                           "the block loop does work a cache wrapper would silently drop: " + "; ".join(report.loop_extra_work_reasons[:4]),
                           f"use a patch functor that moves the work into the blocks"
                           + (f" (cache-dit ships {sup.cache_dit_patch_functor})" if sup.cache_dit_patch_functor else "")))
    if report.loop_work_conditional:
        risks.append(_risk("conditional_loop_work", "low",
                           "loop work that is off in this run: " + "; ".join(report.loop_work_conditional[:3]),
                           "do not pass those arguments (e.g. controlnet) with the cache on, or add a patch functor"))
    cd_sep = cfg.cache_dit_separate_cfg if cfg.cache_dit_separate_cfg is not None else sup.cache_dit_separate_cfg
    if cfg.style != "unknown" and cd_sep is not None and bool(cd_sep) != separate:
        risks.append(_risk("separate_cfg_flag", "high",
                           f"the traced run uses {cfg.style} CFG but cache-dit's has_separate_cfg is {cd_sep}",
                           f"set has_separate_cfg={separate} on the BlockAdapter"))
    elif separate:
        risks.append(_risk("separate_cfg_flag", "medium", "CFG runs as two transformer calls per step",
                           "has_separate_cfg=True so the cache keeps conditional and unconditional states apart"))
    if heads and kv and kv < heads:
        risks.append(_risk("gqa_path", "high",
                           f"grouped-query attention: {heads} query heads, {kv} key/value heads (ratio {att.gqa_ratio})"
                           + ("; keys reach SDPA with fewer heads (enable_gqa)" if att.native_gqa else ""),
                           f"Ulysses degree must divide {kv}; pick an attention backend that takes GQA natively or repeat K/V"))
    for b in report.block_lists:
        if b.forward_pattern is None:
            risks.append(_risk("no_forward_pattern", "high", f"{b.path}: no cache-dit ForwardPattern: {b.pattern_reason}",
                               "wrap the blocks so they take and return the streams cache-dit expects"))
        elif "traced streams" in b.pattern_reason:
            risks.append(_risk("renamed_streams", "medium", f"{b.path}: {b.forward_pattern} only under other names: "
                               f"{b.pattern_reason}", "the adapter folds the loop into blocks that take the streams "
                               "under cache-dit's names; check the caching-off reproduction"))
    for a in sup.agreement:
        if "DISAGREE" in a or "differ" in a:
            risks.append(_risk("cache_dit_disagreement", "medium", a, "read both; trust the traced call"))
    return risks


def build_plan(report: ArchReport, surface: CodeSurface | None, card) -> dict:
    sup = report.support
    facts = _plan_facts(report)
    cache_adapter = _plan_cache_adapter(report)
    parallel = _plan_parallel_candidates(report)
    risks = _plan_risks(report, parallel)
    gates = acceptance_gates(card)
    plan = {
        "model": card.name if card is not None else None,
        "transformer_class": report.transformer_class,
        "pipeline_class": report.pipeline_class,
        "param_count": report.param_count,
        "facts": facts,
        "existing_support": {
            "cache_dit_adapter": sup.cache_dit_adapter, "cache_dit_blocks": sup.cache_dit_blocks,
            "cache_dit_patterns": sup.cache_dit_patterns, "cache_dit_cp_planner": sup.cache_dit_cp_planner,
            "cache_dit_tp_planner": sup.cache_dit_tp_planner, "diffusers_cp_plan": sup.diffusers_cp_plan,
            "diffusers_tp_plan": sup.diffusers_tp_plan, "diffusers_hook_blocks": sup.diffusers_hook_blocks,
            "agreement": sup.agreement,
        },
        "cache_adapter": cache_adapter,
        "parallel_candidates": parallel,
        "risks": risks,
        "acceptance_gates": gates,
        "weights": weights_identity(card.path, [card.card_path]) if card is not None else None,
        "code_surface": ({"counts": surface.counts, "total": surface.total,
                          "port_estimate_lines": surface.port_estimate_lines,
                          "port_estimate_reason": surface.port_estimate_reason} if surface is not None else None),
    }
    plan["hash"] = plan_hash(plan)
    return plan


def render_plan_md(plan: dict) -> str:
    f = plan["facts"]
    a = f["attention"]
    out = [f"# Integration plan: {plan['model']}", "",
           f"`{plan['transformer_class']}` in `{plan['pipeline_class']}`, {plan['param_count']:,} parameters. "
           f"Plan hash `{plan['hash']}`: approve with `ditbook approve <card>`.", "", "## Facts", "",
           "| block list | blocks | class | params | pattern | called with | outputs |", "|---|---|---|---|---|---|---|"]
    for b in f["block_lists"]:
        cw = b["called_with"] or {}
        call = ("keywords " + ", ".join(cw.get("keywords", []))) if cw.get("keywords") else ("positional " + ", ".join(cw.get("positional", [])))
        out.append(f"| `{b['path']}` | {b['length']} | {b['block_class']} | {b['param_share']:.0%} | {b['forward_pattern'] or 'none'} "
                   f"| {call if cw else '(not traced)'} | {', '.join(cw.get('outputs', [])) if cw else ''} |")
    out += ["", f"- attention: {a['kind']}, {a['heads']} heads x {a['head_dim']}, kv heads {a['kv_heads']} (GQA ratio {a['gqa_ratio']}), "
                f"fused QKV {a['fused_qkv']}, RoPE {a['rope']}, masks {a['masks'] or 'none'}, "
                f"sequence image {a['image_seq_len']} / text {a['text_seq_len']}",
            f"- CFG: {f['cfg']['style']} ({f['cfg']['calls_per_step']} transformer calls per step, batch {f['cfg']['batch_per_call']})",
            f"- modulation: {f['modulation']}",
            f"- loop extra work: {f['loop_extra_work']}" + "".join(f"\n  - {r}" for r in f["loop_work"]),
            "", "## Existing support", ""]
    s = plan["existing_support"]
    out += [f"- cache-dit adapter: {s['cache_dit_adapter']} (blocks {s['cache_dit_blocks']}, patterns {s['cache_dit_patterns']})",
            f"- cache-dit planners: CP {s['cache_dit_cp_planner']}, TP {s['cache_dit_tp_planner']}; "
            f"diffusers _cp_plan {s['diffusers_cp_plan']}, _tp_plan {s['diffusers_tp_plan']}",
            f"- diffusers hook registry: {s['diffusers_hook_blocks']}"] + [f"- {x}" for x in s["agreement"]]
    c = plan["cache_adapter"]
    out += ["", "## Proposed cache adapter", "", f"- from: {c['source']}", f"- blocks: {c['blocks']} with {c['forward_patterns']}",
            f"- patch functor needed: {c['patch_functor_needed']} {c['patch_functor'] or ''}",
            f"- has_separate_cfg: {c['has_separate_cfg']}"]
    if c["uncacheable_blocks"]:
        out.append(f"- not cacheable as they are: {c['uncacheable_blocks']}")
    out += ["", "## Parallel candidates", ""] + [f"- {p['kind']}: degrees {p['degrees']} via {p['via']}" for p in plan["parallel_candidates"]]
    out += ["", "## Risks", "", "| risk | severity | what | mitigation |", "|---|---|---|---|"]
    out += [f"| {r['id']} | {r['severity']} | {r['text']} | {r['mitigation']} |" for r in plan["risks"]]
    g = plan["acceptance_gates"]
    gate = lambda d: (f"PSNR > {d['psnr']:g} dB and SSIM > {d['ssim']:g}, every tile PSNR > "  # noqa: E731
                      f"{d['psnr'] - d['tile_margin_db']:g} dB")
    out += ["", "## Acceptance gates", "",
            f"- cache (`cache.gates`): {gate(g['cache'])} against the intake baseline",
            f"- parallel (`parallel.gates`): {gate(g['parallel'])} against the single-process run of the same launch",
            "- always: " + ", ".join(g["always"])]
    w = plan.get("weights")
    out += ["", "## Weights", "", (f"{len(w['files'])} files, {sum(s for s, _ in w['files'].values()):,} bytes, "
                                   f"digest `{w['digest']}` (a change needs a new approval)") if w else "no model folder"]
    cs = plan.get("code_surface")
    if cs:
        out += ["", "## Code surface", "", "| category | lines |", "|---|---|"] + [f"| {k} | {v} |" for k, v in cs["counts"].items()]
        out += ["", f"Estimated new code beyond wrappers: {cs['port_estimate_lines']} lines ({cs['port_estimate_reason']})."]
    return "\n".join(out) + "\n"


def write_plan(folder: str | Path, plan: dict) -> tuple[Path, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pj, pm = folder / PLAN_JSON, folder / PLAN_MD
    pj.write_text(json.dumps(plan, indent=2, default=str) + "\n")
    pm.write_text(render_plan_md(plan))
    return pj, pm


