"""Static inspection: facts read from the module tree and the source, no weights, no forward (works on the meta device):
attention modules (by projection names or shapes), block lists (ModuleLists whose elements all hold attention),
heads, attention kind, RoPE and modulation."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from .loop_source import list_uses, read_loops
from .patterns import diffusers_block_metadata, forward_params, match_pattern, static_output_roles
from .report import ArchReport, AttentionFacts, BlockList, CallConvention

QK_NAMES = (("to_q", "to_k", "to_v"), ("q_proj", "k_proj", "v_proj"), ("wq", "wk", "wv"), ("query", "key", "value"))
FUSED_NAMES = ("to_qkv", "qkv", "qkv_proj", "wqkv", "Wqkv")
HEAD_ATTRS = ("heads", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("kv_heads", "num_kv_heads", "n_kv_heads", "num_key_value_heads")
HEAD_DIM_ATTRS = ("head_dim", "dim_head", "attention_head_dim")


def _linear_children(m: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, c) for n, c in m.named_children() if isinstance(c, nn.Linear)]


def shaped_projections(m: nn.Module) -> dict:
    """q/k/v recognised by shape (three Linear of one input width), or a fused qkv next to its output."""
    lins = _linear_children(m)
    by_in: dict[int, list[nn.Linear]] = {}
    for _, lin in lins:
        by_in.setdefault(lin.in_features, []).append(lin)
    for width, group in by_in.items():
        if len(group) >= 3:
            for q in group:
                same = [g for g in group if g is not q and g.out_features == q.out_features]
                if same and q.out_features <= 4 * width:
                    rest = [g for g in group if g is not q and g is not same[0]]
                    return {"q": q, "k": same[0], "v": rest[0]}
    for _, lin in lins:
        # the output projection maps the width back onto itself; a SwiGLU gate reading the same width
        # writes the wide one (minRF's FeedForward: hidden 3 x dim at a small width is no fused qkv)
        if lin.out_features == 3 * lin.in_features and any(
                o is not lin and o.in_features == lin.in_features == o.out_features for _, o in lins):
            return {"qkv": lin}
    return {}


def projections(m: nn.Module) -> dict:
    """q/k/v (or fused) projections of an attention module ({} when none): by name, then by shape."""
    for q, k, v in QK_NAMES:
        if isinstance(getattr(m, q, None), nn.Module) and isinstance(getattr(m, k, None), nn.Module):
            return {"q": getattr(m, q), "k": getattr(m, k), "v": getattr(m, v, None)}
    for name in FUSED_NAMES:
        if isinstance(getattr(m, name, None), nn.Linear):
            return {"qkv": getattr(m, name)}
    if isinstance(m, nn.ModuleList):
        return {}
    return shaped_projections(m)


def is_attention(m: nn.Module) -> bool:
    return isinstance(m, nn.MultiheadAttention) or bool(projections(m))


def attention_modules(m: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, s) for n, s in m.named_modules() if n and is_attention(s)]


def is_container(m: nn.Module) -> bool:
    """A module never called itself (its class defines no ``forward``): a stage holding block lists."""
    return type(m).forward is nn.Module.forward


def is_block(m: nn.Module) -> bool:
    """A called module running attention: below it, or inlined (its own q/k/v projections)."""
    if is_container(m):
        return False
    return bool(attention_modules(m)) or (is_attention(m) and not isinstance(m, nn.MultiheadAttention)
                                          and any(True for _ in m.children()) and len(_linear_children(m)) >= 4)


def param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _first_attr(m, names):
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def attention_shape(attn: nn.Module) -> dict:
    """heads, kv heads, head dim, fused, joint/cross flags of one attention module."""
    if isinstance(attn, nn.MultiheadAttention):
        heads = attn.num_heads
        return {"heads": heads, "kv_heads": heads, "head_dim": attn.head_dim, "fused": attn._qkv_same_embed_dim,
                "joint": False, "cross": not attn._qkv_same_embed_dim}
    proj = projections(attn)
    heads = _first_attr(attn, HEAD_ATTRS)
    kv_heads = _first_attr(attn, KV_HEAD_ATTRS)
    head_dim = _first_attr(attn, HEAD_DIM_ATTRS)
    fused = "qkv" in proj or bool(getattr(attn, "fused_projections", False))
    q_out, k_out = (getattr(proj.get(r), "out_features", None) for r in "qk")
    if head_dim is None and heads and q_out:
        head_dim = q_out // heads
    if heads is None and head_dim and q_out:
        heads = q_out // head_dim
    if kv_heads is None and head_dim and k_out:
        kv_heads = k_out // head_dim
    if kv_heads is None and "qkv" in proj and heads and head_dim:
        rest = getattr(proj["qkv"], "out_features", None) - heads * head_dim
        kv_heads = rest // (2 * head_dim) if rest > 0 else heads
    joint = any(isinstance(getattr(attn, n, None), nn.Module) for n in ("add_k_proj", "add_kv_proj")) or (
        getattr(attn, "added_kv_proj_dim", None) is not None)
    cross = bool(getattr(attn, "is_cross_attention", False))
    q_in, k_in = (getattr(proj.get(r), "in_features", None) for r in "qk")
    if not cross and q_in and k_in:
        cross = q_in != k_in
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "fused": fused, "joint": joint, "cross": cross}


def find_block_lists(module: nn.Module) -> tuple[list[tuple[str, nn.ModuleList]], list[str]]:
    """(block lists, descriptions of the other ModuleLists), outermost first."""
    blocks: list[tuple[str, nn.ModuleList]] = []
    others: list[str] = []
    taken: list[str] = []
    for name, m in module.named_modules():
        if not isinstance(m, nn.ModuleList) or not name:
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        children = list(m)
        if children and all(is_block(c) for c in children):
            blocks.append((name, m))
            taken.append(name)
        elif children and all(is_container(c) for c in children):
            others.append(f"{name} ({len(children)} x {'/'.join(sorted({type(c).__name__ for c in children}))}): "
                          f"containers that are never called themselves; their block lists are searched instead")
        else:
            kinds = sorted({type(c).__name__ for c in children})
            others.append(f"{name} ({len(children)} x {'/'.join(kinds) or 'empty'}): no attention inside, not blocks")
    return blocks, others


def candidate_lists(module: nn.Module, taken: list[str]) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists of non-torch, non-container modules: block lists if the trace sees them call attention."""
    out: list[tuple[str, nn.ModuleList]] = []
    for name, m in module.named_modules():
        if not isinstance(m, nn.ModuleList) or not name or not len(m):
            continue
        if any(name == t or name.startswith(t + ".") for t in taken + [p for p, _ in out]):
            continue
        if all(not is_container(c) and not type(c).__module__.startswith("torch.") for c in m):
            out.append((name, m))
    return out


def add_block_lists(module: nn.Module, report: ArchReport, paths: list[str], why: str) -> None:
    """Take the ModuleLists at ``paths`` as block lists too (found by the trace), redoing loop facts and modulation."""
    if not paths:
        return
    lists = [(p, module.get_submodule(p)) for p in paths]
    report.block_lists += _block_list_facts(lists, param_count(module))
    report.notes = [n for n in report.notes if not any(n.startswith(f"other ModuleList {p} (") for p in paths)]
    report.notes += [f"{p}: {why}" for p in paths]
    everything = [(b.path, module.get_submodule(b.path)) for b in report.block_lists]
    report.modulation, report.modulation_reason = modulation(module, everything)
    notes = list(report.notes)
    _add_loop_facts(module, report)
    report.notes = list(dict.fromkeys(notes + report.notes))


def _rope(module: nn.Module, block_lists) -> bool:
    if any("rope" in type(m).__name__.lower() or "rotary" in type(m).__name__.lower() for m in module.modules()):
        return True
    return any(k in p.lower() for _, lst in block_lists for p in forward_params(lst[0])
               for k in ("rotary", "rope", "freqs"))


def modulation(module: nn.Module, block_lists) -> tuple[str, str]:
    if not block_lists:
        return "unknown", "no block lists"
    per_block, tables = [], []
    for path, lst in block_lists:
        block = lst[0]
        for n, m in block.named_modules():
            low = n.lower()
            if isinstance(m, nn.Linear) and any(k in low for k in ("norm", "ada", "mod")) and m.out_features >= 2 * m.in_features:
                per_block.append(f"{path}[0].{n} (Linear {m.in_features}->{m.out_features})")
                break
        for n, _ in block.named_parameters():
            if "scale_shift" in n or "modulation" in n.split(".")[-1]:
                tables.append(f"{path}[0].{n}")
                break
    if per_block:
        return "per_block", "adaLN projection in every block: " + "; ".join(per_block)
    if tables:
        return "shared", "modulation computed once by the transformer; blocks only add a learned table: " + "; ".join(tables)
    return "none", "no adaLN projection or modulation table found in the blocks"


def source_files(module: nn.Module) -> list[str]:
    files = []
    for cls in type(module).__mro__:
        if cls in (nn.Module, object) or cls.__module__.startswith(("torch.", "diffusers.models.modeling_utils",
                                                                      "diffusers.configuration_utils", "diffusers.loaders")):
            continue
        try:
            f = inspect.getsourcefile(cls)
        except TypeError:
            continue
        if f and f not in files and Path(f).suffix == ".py":
            files.append(f)
    return files[:1]


def inspect_transformer(module: nn.Module, pipeline_class: str | None = None, support: bool = True) -> ArchReport:
    """Static facts of a transformer: works on the meta device (reads no weights, runs no forward)."""
    total = param_count(module)
    lists, others = find_block_lists(module)
    block_lists = _block_list_facts(lists, total)
    attention = _attention_facts(module, lists)
    mod, mod_reason = modulation(module, lists)
    report = ArchReport(
        transformer_class=type(module).__name__,
        pipeline_class=pipeline_class,
        param_count=int(total),
        block_lists=block_lists,
        attention=attention,
        modulation=mod,
        modulation_reason=mod_reason,
        source_files=source_files(module),
        notes=[f"other ModuleList {o}" for o in others],
    )
    _add_loop_facts(module, report)
    if support:
        from .support import support_facts

        report.support = support_facts(module, pipeline_class, report)
    return report


def _block_list_facts(lists: list, total: int) -> list[BlockList]:
    """One ``BlockList`` per found block list: its class, share of parameters, call and pattern."""
    block_lists: list[BlockList] = []
    for path, lst in lists:
        block = lst[0]
        classes = sorted({type(b).__name__ for b in lst})
        roles = static_output_roles(block)
        params = forward_params(block)
        match = match_pattern(block, roles, receives_encoder=("encoder_hidden_states" in params) or None)
        block_lists.append(BlockList(
            path=path,
            length=len(lst),
            block_class="/".join(classes),
            param_share=round(param_count(lst) / total, 4) if total else 0.0,
            signature=params,
            call=CallConvention(outputs=len(roles) if roles else 0, output_roles=list(roles or [])),
            forward_pattern=match.pattern,
            pattern_reason=match.reason,
            compatible_patterns=match.compatible,
            pattern_source="static",
            diffusers_hook_metadata=diffusers_block_metadata(type(block)) is not None,
        ))
    return block_lists


def _attention_facts(module: nn.Module, lists: list) -> AttentionFacts:
    """Heads, kind, fused qkv, rope and processors of the blocks' attention."""
    attention = AttentionFacts()
    main = max(lists, key=lambda pl: param_count(pl[1]), default=None)
    shapes = [attention_shape(a) for _, lst in lists for _, a in attention_modules(lst[0])]
    attention.attention_modules = sum(len(attention_modules(lst[0])) * len(lst) for _, lst in lists)
    if main is not None:
        first = attention_modules(main[1][0])
        if first:
            s = attention_shape(first[0][1])
            attention.heads, attention.kv_heads, attention.head_dim = s["heads"], s["kv_heads"], s["head_dim"]
            if s["heads"] and s["kv_heads"]:
                attention.gqa_ratio = round(s["heads"] / s["kv_heads"], 3)
    attention.fused_qkv = any(s["fused"] for s in shapes)
    if any(s["joint"] for s in shapes):
        attention.kind = "joint"
    elif any(s["cross"] for s in shapes):
        attention.kind = "cross"
    elif shapes:
        attention.kind = "self"
    attention.rope = _rope(module, lists)
    attention.processor_classes = sorted({type(getattr(a, "processor")).__name__ for _, lst in lists
                                          for _, a in attention_modules(lst[0]) if getattr(a, "processor", None) is not None})
    return attention


def _add_loop_facts(module: nn.Module, report: ArchReport) -> None:
    """The forward's loops over the block lists and the code's other uses of them: notes and loop work."""
    block_lists = report.block_lists
    loops = read_loops(module, [b.path for b in block_lists])
    if loops.error:
        report.notes.append(loops.error)
    for path in (b.path for b in block_lists):
        if path not in loops.loops and not loops.error:
            report.notes.append(f"no loop over self.{path} found in {report.transformer_class}.forward; "
                                f"the blocks are called elsewhere (check before caching)")
    try:
        uses = list_uses(type(module), [b.path for b in block_lists])
    except Exception as exc:  # unreadable source: said, not fatal
        uses = {}
        report.notes.append(f"the code's uses of the block lists could not be read: {type(exc).__name__}: {exc}")
    for path, u in uses.items():
        unsafe = u.unsafe()
        if unsafe and not unsafe.startswith("no loop over"):
            report.notes.append(f"{path}: {unsafe}")
    report.loop_extra_work_reasons = [w.describe() for w in loops.active]
    report.loop_work_conditional = [w.describe() for w in loops.conditional]
    report.loop_extra_work = bool(loops.active)
