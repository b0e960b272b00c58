"""Which parallel plans a model admits at world sizes 1, 2, 4, 8, and why not where it doesn't:
each ``ditbook.accel`` technique judges itself on facts gathered here once from the inspection
report and the card (nothing runs the model).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import accel
from ..accel.technique import Feasibility
from ..arch.report import ArchReport, AttentionFacts
from ..card import ModelCard

WORLD_SIZES = (1, 2, 4, 8)


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


def model_components(card: ModelCard) -> dict[str, str]:
    """Component name -> class name from the model folder's ``model_index.json``."""
    try:
        index = json.loads((Path(card.path) / "model_index.json").read_text())
    except (OSError, TypeError, ValueError):
        return {}
    return {k: v[1] for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[1]}


def _cache_dit_registered(folder: str, registry: str) -> set[str]:
    """Class names cache-dit registers planners for in ``distributed/<folder>``, from its source."""
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


@dataclass
class ModelFacts:
    """What the kind judges read, gathered once per table."""

    att: AttentionFacts
    heads: int | None
    kv: int | None
    s_img: int | None
    s_txt: int | None
    joint: bool
    device: str
    registered_cp: str | None  # a registered CP planner / plan, or None (derived from the trace)
    tp_plan: str | None
    cfg_ok: bool
    cfg_why: str
    components: dict[str, str] = field(default_factory=dict)
    text_encoder_planners: set[str] = field(default_factory=set)
    vae_planners: set[str] = field(default_factory=set)
    vae_problem: str | None = None  # why the VAE's decoder cannot be split (accel.vae), read on meta
    latent_height: int | None = None  # latent rows at the card's height

    def seq_reason(self, n: int) -> str | None:
        bad = []
        if self.s_img is not None and self.s_img % n:
            bad.append(f"{self.s_img} image tokens")
        if self.joint and self.s_txt is not None and self.s_txt % n:
            bad.append(f"{self.s_txt} text tokens (split with the image in joint attention)")
        return (", ".join(bad) + f" not divisible by {n}") if bad else None

    def cp_how(self) -> str:
        return f"plan: {self.registered_cp}" if self.registered_cp else "plan derived from the traced call conventions"


def model_facts(report: ArchReport, card: ModelCard, device: str) -> ModelFacts:
    att = report.attention
    sup = report.support
    cfg_ok, cfg_why = _cfg_active(report, card)
    from ..accel.vae import vae_facts

    vae_problem, latent_height = vae_facts(card.path, card.generation.height)
    return ModelFacts(
        att=att, heads=att.heads, kv=att.kv_heads or att.heads, s_img=att.image_seq_len,
        s_txt=att.text_seq_len, joint=att.kind == "joint", device=str(device),
        registered_cp=sup.cache_dit_cp_planner or ("diffusers _cp_plan" if sup.diffusers_cp_plan else None),
        tp_plan=sup.cache_dit_tp_planner or ("diffusers _tp_plan" if sup.diffusers_tp_plan else None),
        cfg_ok=cfg_ok, cfg_why=cfg_why, components=model_components(card),
        text_encoder_planners=_cache_dit_registered("text_encoders", "TextEncoderTensorParallelismPlannerRegister"),
        vae_planners=_cache_dit_registered("autoencoders", "AutoEncoderDataParallelismPlannerRegister"),
        vae_problem=vae_problem, latent_height=latent_height)


def feasibility(report: ArchReport, card: ModelCard, world_sizes=WORLD_SIZES, device: str | None = None) -> FeasibilityTable:
    """The feasibility of every parallel kind at each world size, with its reason. ``device``
    (default: the card's placement) rules out what the device cannot run (Ring on CPU)."""
    if device is None:
        from ..loading import choose_placement

        device = choose_placement(card).device
    f = model_facts(report, card, device)
    att = f.att
    table = FeasibilityTable(model=card.name, facts={
        "heads": f.heads, "kv_heads": f.kv, "head_dim": att.head_dim, "gqa_ratio": att.gqa_ratio,
        "attention_kind": att.kind, "fused_qkv": att.fused_qkv, "masks": list(att.masks),
        "image_seq_len": f.s_img, "text_seq_len": f.s_txt, "cfg_style": report.cfg.style,
        "cp_plan_source": f.registered_cp or "derived from the traced call conventions",
        "components": f.components, "device": f.device,
    })
    for n in world_sizes:
        for technique in accel.parallel_kinds():  # each kind judges itself (its module's ``judge``)
            table.rows += technique.judge(f, n)
    return table
