"""Which parallel plans a model admits at world sizes 1, 2, 4, 8, and why not where it doesn't.

Read from the inspection report (heads, KV heads, fused QKV, attention kind, masks, sequence
lengths, CFG style, registered planners) and the card (guidance settings, model folder's
component classes). Nothing here runs the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..inspect.report import ArchReport
from ..card import ModelCard
from .plans import plan_name

WORLD_SIZES = (1, 2, 4, 8)
KINDS = ("cfg", "ulysses", "ring", "ulysses_x_ring", "cfg_x_ulysses", "tp", "text_encoder", "vae")


@dataclass
class Feasibility:
    kind: str
    world_size: int
    feasible: bool
    plan: str | None  # the plan name to launch, when it is a launchable plan
    reason: str  # why not, or how (padding, replicated KV, ...)
    launchable: bool = True  # ditbook's launcher runs it (TP/encoder/VAE are judged only)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FeasibilityTable:
    model: str
    rows: list[Feasibility] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"model": self.model, "facts": self.facts, "rows": [r.to_dict() for r in self.rows]}

    def get(self, kind: str, world_size: int) -> Feasibility:
        for r in self.rows:
            if r.kind == kind and r.world_size == world_size:
                return r
        raise KeyError((kind, world_size))

    def feasible_plans(self, world_size: int | None = None, launchable_only: bool = True) -> list[str]:
        return [r.plan for r in self.rows if r.feasible and r.plan and (not launchable_only or r.launchable)
                and (world_size is None or r.world_size == world_size)]

    def check(self, plan: str) -> Feasibility | None:
        """The row for a plan name (``+cache`` ignored), or None when the table has none."""
        base = plan.split("+")[0]
        for r in self.rows:
            if r.plan and r.plan.split("+")[0] == base:
                return r
        return None

    def table(self) -> list[dict]:
        """Rows for display: one row per kind, one column per world size."""
        out = []
        for kind in dict.fromkeys(r.kind for r in self.rows):
            row = {"kind": kind}
            for ws in WORLD_SIZES:
                try:
                    f = self.get(kind, ws)
                except KeyError:
                    continue
                row[str(ws)] = ("yes" if f.feasible else "no") + (f" — {f.reason}" if f.reason else "")
            out.append(row)
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_components(card: ModelCard) -> dict[str, str]:
    """Component name -> class name from the model folder's ``model_index.json``."""
    try:
        index = json.loads((Path(card.path) / "model_index.json").read_text())
    except (OSError, TypeError, ValueError):
        return {}
    return {k: v[1] for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[1]}


def _cache_dit_registered(folder: str, registry: str) -> set[str]:
    """Class names cache-dit registers planners for in ``distributed/<folder>``.

    Read from the source files' ``@<Registry>.register("Name")`` lines, because importing the
    planners themselves pulls in optional dependencies (einops) that a CPU install may lack.
    """
    try:
        import cache_dit
    except ImportError:
        return set()
    root = Path(cache_dit.__file__).parent / "distributed" / folder
    pat = re.compile(rf"{registry}\.register\(\s*\"([A-Za-z0-9_]+)\"")
    names: set[str] = set()
    for f in root.glob("*.py"):
        names.update(pat.findall(f.read_text(errors="ignore")))
    return names


def _prefix_registered(cls_name: str, names: set[str]) -> str | None:
    # cache-dit's own registries match by class-name prefix; mirror that to report what it would pick
    for n in sorted(names, key=len, reverse=True):
        if cls_name.startswith(n):
            return n
    return None


def _cfg_active(report: ArchReport, card: ModelCard) -> tuple[bool, str]:
    style = report.cfg.style
    gen = card.generation
    if style == "separate":
        return True, "two transformer calls per step (cond, uncond): one per rank"
    if style == "batched":
        return True, "one call with a batch of two (cond, uncond): one half per rank"
    if style in ("none", "distilled"):
        how = "guidance is distilled into the model" if style == "distilled" else "no classifier-free guidance"
        tc = gen.true_cfg_scale
        hint = (f"; true_cfg_scale={tc} in the card turns on a second call" if tc and tc > 1 else
                "; set generation.true_cfg_scale > 1 (with a negative prompt) if the pipeline supports true CFG")
        return False, f"one transformer call per step ({how}): no second branch to split{hint}"
    return False, f"CFG style not traced ({style}); run the inspect stage with tracing"


def feasibility(report: ArchReport, card: ModelCard, world_sizes=WORLD_SIZES, device: str | None = None) -> FeasibilityTable:
    """The feasibility of every parallel kind at each world size, with its reason. ``device``
    (default: the card's placement) rules out what the device cannot run (Ring on CPU)."""
    if device is None:
        from ..loading import choose_placement

        device = choose_placement(card).device
    att = report.attention
    heads, kv = att.heads, att.kv_heads or att.heads
    s_img, s_txt = att.image_seq_len, att.text_seq_len
    joint = att.kind == "joint"
    sup = report.support
    registered_cp = sup.cache_dit_cp_planner or ("diffusers _cp_plan" if sup.diffusers_cp_plan else None)
    comps = model_components(card)
    table = FeasibilityTable(model=card.name, facts={
        "heads": heads, "kv_heads": kv, "head_dim": att.head_dim, "gqa_ratio": att.gqa_ratio,
        "attention_kind": att.kind, "fused_qkv": att.fused_qkv, "masks": list(att.masks),
        "image_seq_len": s_img, "text_seq_len": s_txt, "cfg_style": report.cfg.style,
        "cp_plan_source": registered_cp or "derived from the traced call conventions",
        "components": comps, "device": str(device),
    })
    add = table.rows.append
    cfg_ok, cfg_why = _cfg_active(report, card)

    def seq_reason(n: int) -> str | None:
        bad = []
        if s_img is not None and s_img % n:
            bad.append(f"{s_img} image tokens")
        if joint and s_txt is not None and s_txt % n:
            bad.append(f"{s_txt} text tokens (split with the image in joint attention)")
        return (", ".join(bad) + f" not divisible by {n}") if bad else None

    def cp_how() -> str:
        return f"plan: {registered_cp}" if registered_cp else "plan derived from the traced call conventions"

    def ulysses_check(n: int) -> tuple[bool, str]:
        if heads is None:
            return False, "head count unknown (inspection found no attention)"
        notes = []
        if heads % n:
            return False, (f"{heads} query heads not divisible by {n}: needs head padding "
                           f"(cache-dit ulysses_anything), not planned by ditbook")
        if kv % n:
            notes.append(f"{kv} KV heads not divisible by {n}: K/V repeated to the {heads} query heads "
                         f"before the all-to-all")
        s = seq_reason(n)
        if s:
            return False, s + ": uneven split needs padding (ulysses_anything)"
        notes.append(cp_how())
        return True, "; ".join(notes)

    def ring_check(n: int) -> tuple[bool, str]:
        if heads is None:
            return False, "head count unknown (inspection found no attention)"
        s = seq_reason(n)
        if s:
            return False, s
        if not str(device).startswith("cuda"):
            return False, ("ring attention merges partial results by their log-sum-exp, which cache-dit takes "
                           "from the flash SDPA kernel — CUDA only (on CPU it raises NotImplementedError)")
        full_masks = [m for m in att.masks if "mask" in m.lower() and "encoder" not in m.lower()]
        if full_masks:
            return False, f"attention mask(s) {full_masks} over the whole sequence: ring attention takes no mask"
        return True, cp_how()

    for n in world_sizes:
        # CFG parallel
        if n == 1:
            add(Feasibility("cfg", 1, False, None, "one process: nothing to split"))
        elif n == 2:
            add(Feasibility("cfg", 2, cfg_ok, "cfg2" if cfg_ok else None, cfg_why))
        else:
            add(Feasibility("cfg", n, False, None, f"CFG has two branches: world size {n} needs cfg2 x CP{n // 2}"
                            " (see cfg_x_ulysses)"))
        # Ulysses
        if n == 1:
            add(Feasibility("ulysses", 1, True, "single", "the single-process baseline"))
        else:
            ok, why = ulysses_check(n)
            add(Feasibility("ulysses", n, ok, plan_name(ulysses=n), why))
        # Ring
        if n == 1:
            add(Feasibility("ring", 1, False, None, "one process: nothing to split"))
        else:
            ok, why = ring_check(n)
            add(Feasibility("ring", n, ok, plan_name(ring=n), why))
        # Ulysses x Ring
        if n < 4:
            add(Feasibility("ulysses_x_ring", n, False, None, "needs at least 4 processes (2 x 2)"))
        else:
            best = None
            for u in sorted(_divisors(n), reverse=True):
                r = n // u
                if u < 2 or r < 2:
                    continue
                uok, uwhy = ulysses_check(u)
                rok, rwhy = ring_check(r)
                if uok and rok:
                    best = (r, u, uwhy)
                    break
            if best:
                r, u, why = best
                add(Feasibility("ulysses_x_ring", n, True, plan_name(ring=r, ulysses=u),
                                f"ring {r} x ulysses {u}; {why}"))
            else:
                add(Feasibility("ulysses_x_ring", n, False, None,
                                f"no ring x ulysses split of {n} with heads and sequence divisible"))
        # CFG x Ulysses
        if n < 4:
            add(Feasibility("cfg_x_ulysses", n, False, None, "needs at least 4 processes (cfg2 x ulysses2)"))
        elif not cfg_ok:
            add(Feasibility("cfg_x_ulysses", n, False, None, cfg_why))
        else:
            ok, why = ulysses_check(n // 2)
            add(Feasibility("cfg_x_ulysses", n, ok, plan_name(cfg=2, ulysses=n // 2),
                            f"cfg2 x ulysses{n // 2}: {why}"))
        # Tensor parallel (judged, not launched)
        tp_plan = sup.cache_dit_tp_planner or ("diffusers _tp_plan" if sup.diffusers_tp_plan else None)
        if n == 1:
            add(Feasibility("tp", 1, False, None, "one process: nothing to shard", launchable=False))
        elif heads is None:
            add(Feasibility("tp", n, False, None, "head count unknown", launchable=False))
        elif heads % n:
            add(Feasibility("tp", n, False, None, f"{heads} heads not divisible by {n}", launchable=False))
        else:
            notes = []
            if kv % n:
                notes.append(f"GQA: {kv} KV heads not divisible by {n} -> replicate K/V projections on every "
                             f"rank or shard the FFN only")
            if att.fused_qkv:
                notes.append("fused QKV: the packed projection needs block-wise column sharding")
            if not tp_plan:
                add(Feasibility("tp", n, False, None,
                                "no TP plan registered (diffusers _tp_plan / cache-dit planner); "
                                + ("; ".join(notes) + "; " if notes else "")
                                + "ditbook does not derive TP shard specs", launchable=False))
            else:
                add(Feasibility("tp", n, True, plan_name(tp=n), "; ".join([f"plan: {tp_plan}"] + notes),
                                launchable=False))
        # Text encoders and VAE (cache-dit planners; judged here, not launched)
        te_names = _cache_dit_registered("text_encoders", "TextEncoderTensorParallelismPlannerRegister")
        encoders = {k: v for k, v in comps.items() if k.startswith("text_encoder")}
        if n == 1:
            add(Feasibility("text_encoder", 1, False, None, "one process", launchable=False))
        elif not encoders:
            add(Feasibility("text_encoder", n, False, None, "the pipeline has no text encoder component",
                            launchable=False))
        else:
            hits = {k: _prefix_registered(v, te_names) for k, v in encoders.items()}
            ok = [f"{k} ({encoders[k]})" for k, h in hits.items() if h]
            miss = [f"{k} ({encoders[k]})" for k, h in hits.items() if not h]
            why = (f"cache-dit TP planner for {', '.join(ok)}" if ok else "") + \
                  ((("; " if ok else "") + f"no cache-dit planner for {', '.join(miss)}") if miss else "")
            add(Feasibility("text_encoder", n, bool(ok), None, why, launchable=False))
        vae_names = _cache_dit_registered("autoencoders", "AutoEncoderDataParallelismPlannerRegister")
        vae = comps.get("vae")
        if n == 1:
            add(Feasibility("vae", 1, False, None, "one process", launchable=False))
        elif not vae:
            add(Feasibility("vae", n, False, None, "the pipeline has no vae component", launchable=False))
        else:
            hit = _prefix_registered(vae, vae_names)
            add(Feasibility("vae", n, bool(hit), None,
                            f"cache-dit data-parallel (tiled) planner for {vae}" if hit
                            else f"no cache-dit planner for {vae}", launchable=False))
    return table
