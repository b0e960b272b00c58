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
from typing import Callable

from ..inspect.report import ArchReport, AttentionFacts
from ..card import ModelCard
from .plans import own_ring, plan_name

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
    """What the kind judges read: the inspection's attention facts, the CFG verdict, the
    registered planners and the device, gathered once per table."""

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
    vae_problem: str | None = None  # why the VAE's decoder cannot be split (parallel.vae), read on meta
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
    from .vae import vae_facts

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


def ulysses_check(f: ModelFacts, n: int, uneven: bool = False) -> tuple[bool, str]:
    """Heads and sequence under Ulysses ``n``. ``uneven`` (Ulysses without ring: the launch can set
    cache-dit's ``ulysses_anything``): a token count ``n`` does not divide is split into
    ``tensor_split`` shares (every rank one token at least) instead of refused."""
    if f.heads is None:
        return False, "head count unknown (inspection found no attention)"
    notes = []
    if f.heads % n:
        return False, (f"{f.heads} query heads not divisible by {n}: needs head padding "
                       f"(cache-dit ulysses_anything), not planned by ditbook")
    if f.kv % n:
        notes.append(f"{f.kv} KV heads not divisible by {n}: K/V repeated to the {f.heads} query heads "
                     f"before the all-to-all")
    s = f.seq_reason(n)
    counts = [c for c in (f.s_img, f.s_txt if f.joint else None) if c is not None]
    if s and uneven and all(c >= n for c in counts):
        notes.append(s + ": split unevenly (torch.tensor_split shares, cache-dit's ulysses_anything)")
    elif s:
        why = "uneven split needs cache-dit's ulysses_anything, which ring attention does not take" if not uneven \
            else "fewer tokens than ranks"
        return False, f"{s}: {why}"
    notes.append(f.cp_how())
    return True, "; ".join(notes)


def device_refusal(spec, device: str | None) -> str | None:
    """Why this device cannot run the plan (None when it can): rings other than ditbook's own
    (inside USP, CFG x ring or +cache plans) are cache-dit's, CUDA only."""
    if spec.ring > 1 and not own_ring(spec) and not str(device or "").startswith("cuda"):
        return ("cache-dit's ring attention (in USP, CFG x ring or +cache plans) takes the log-sum-exp from the "
                "flash SDPA kernel: CUDA only; a plain ring<N> runs ditbook's own ring on any device")
    return None


def ring_check(f: ModelFacts, n: int, own: bool = False) -> tuple[bool, str]:
    """``own``: ditbook's ring (``parallel.ring``, plain ring<N> plans), which computes the
    log-sum-exp itself and so runs on any device; else cache-dit's (inside USP)."""
    if f.heads is None:
        return False, "head count unknown (inspection found no attention)"
    s = f.seq_reason(n)
    if s:
        return False, s
    if not own and not f.device.startswith("cuda"):
        return False, ("ring attention merges partial results by their log-sum-exp, which cache-dit takes "
                       "from the flash SDPA kernel — CUDA only (on CPU it raises NotImplementedError)")
    full_masks = [m for m in f.att.masks if "mask" in m.lower() and "encoder" not in m.lower()]
    if full_masks and own:
        return True, f"key mask(s) {full_masks} travel round the ring with their keys; " + f.cp_how()
    if full_masks:
        return False, f"attention mask(s) {full_masks} over the whole sequence: ring attention takes no mask"
    return True, f.cp_how()


# -- one judge per parallel kind: (facts, world size) -> its row --------------------------------

def judge_cfg(f: ModelFacts, n: int) -> Feasibility:
    if n == 1:
        return Feasibility("cfg", 1, False, None, "one process: nothing to split")
    if n == 2:
        return Feasibility("cfg", 2, f.cfg_ok, "cfg2" if f.cfg_ok else None, f.cfg_why)
    return Feasibility("cfg", n, False, None, f"CFG has two branches: world size {n} needs cfg2 x CP{n // 2}"
                       " (see cfg_x_ulysses)")


def judge_ulysses(f: ModelFacts, n: int) -> Feasibility:
    if n == 1:
        return Feasibility("ulysses", 1, True, "single", "the single-process baseline")
    ok, why = ulysses_check(f, n, uneven=True)
    return Feasibility("ulysses", n, ok, plan_name(ulysses=n), why)


def judge_ring(f: ModelFacts, n: int) -> Feasibility:
    if n == 1:
        return Feasibility("ring", 1, False, None, "one process: nothing to split")
    ok, why = ring_check(f, n, own=True)
    return Feasibility("ring", n, ok, plan_name(ring=n),
                       f"ditbook's ring attention (partials merged by log-sum-exp, K/V over isend/irecv); {why}"
                       if ok else why)


def judge_ulysses_x_ring(f: ModelFacts, n: int) -> Feasibility:
    """USP: the split with the most Ulysses ranks where both the Ulysses and the Ring part hold."""
    if n < 4:
        return Feasibility("ulysses_x_ring", n, False, None, "needs at least 4 processes (2 x 2)")
    for u in sorted(_divisors(n), reverse=True):
        r = n // u
        if u < 2 or r < 2:
            continue
        uok, uwhy = ulysses_check(f, u)
        rok, _ = ring_check(f, r)
        if uok and rok:
            return Feasibility("ulysses_x_ring", n, True, plan_name(ring=r, ulysses=u),
                               f"ring {r} x ulysses {u}; {uwhy}")
    return Feasibility("ulysses_x_ring", n, False, None,
                       f"no ring x ulysses split of {n} with heads and sequence divisible")


def judge_cfg_x_ulysses(f: ModelFacts, n: int) -> Feasibility:
    if n < 4:
        return Feasibility("cfg_x_ulysses", n, False, None, "needs at least 4 processes (cfg2 x ulysses2)")
    if not f.cfg_ok:
        return Feasibility("cfg_x_ulysses", n, False, None, f.cfg_why)
    ok, why = ulysses_check(f, n // 2, uneven=True)
    return Feasibility("cfg_x_ulysses", n, ok, plan_name(cfg=2, ulysses=n // 2), f"cfg2 x ulysses{n // 2}: {why}")


def judge_tp(f: ModelFacts, n: int) -> Feasibility:
    """Tensor parallel of the transformer (``parallel.tensor``): the class's ``_tp_plan``, else a
    plan derived from the traced linear layers; heads and KV heads must split evenly."""
    def no(why: str) -> Feasibility:
        return Feasibility("tp", n, False, None, why)

    if n == 1:
        return no("one process: nothing to shard")
    if f.heads is None:
        return no("head count unknown")
    if f.heads % n:
        return no(f"{f.heads} heads not divisible by {n}")
    if f.kv % n:
        return no(f"GQA: {f.kv} KV heads not divisible by {n}: the K/V projections cannot be split by head")
    diffusers_plan = bool(f.tp_plan) and "_tp_plan" in f.tp_plan  # cache-dit's TP planners are not applied
    # a fused QKV is derived too: split per chunk (``tensor.packed_colwise``), the plan simulated before launch
    how = ("plan: diffusers _tp_plan" if diffusers_plan else
           "plan derived from the traced linear layers (attention in-projections colwise"
           + (", a fused qkv per chunk" if f.att.fused_qkv else "") + ", out-projection rowwise; "
           "MLP up colwise, down rowwise)")
    return Feasibility("tp", n, True, plan_name(tp=n), how)


def judge_text_encoder(f: ModelFacts, n: int) -> Feasibility:
    """Text-encoder parallel (``parallel.text_encoder``): the encoder calls spread over the ranks."""
    encoders = {k: v for k, v in f.components.items() if k.startswith("text_encoder")}
    if n == 1:
        return Feasibility("text_encoder", 1, False, None, "one process")
    if not encoders:
        return Feasibility("text_encoder", n, False, None, "the pipeline has no text encoder component")
    listed = ", ".join(f"{k} ({v})" for k, v in encoders.items())
    return Feasibility("text_encoder", n, True, plan_name(te=n),
                       f"the calls of {listed} spread round-robin over {n} ranks, each result broadcast")


def judge_vae(f: ModelFacts, n: int) -> Feasibility:
    """Patch-parallel VAE decode (``parallel.vae``): judged on the decoder's layers at launch."""
    vae = f.components.get("vae")
    if n == 1:
        return Feasibility("vae", 1, False, None, "one process")
    if not vae:
        return Feasibility("vae", n, False, None, "the pipeline has no vae component")
    if f.vae_problem:
        return Feasibility("vae", n, False, None, f"{vae}: {f.vae_problem}")
    if f.latent_height and f.latent_height % n:
        return Feasibility("vae", n, False, None, f"{vae}: {f.latent_height} latent rows not divisible by {n}")
    return Feasibility("vae", n, True, plan_name(vae=n),
                       f"{vae}: latent rows split over {n} ranks, halo rows per convolution, GroupNorm and attention "
                       f"over the whole image; a decoder layer it cannot split is refused at launch by name")


JUDGES: dict[str, Callable[[ModelFacts, int], Feasibility]] = {
    "cfg": judge_cfg, "ulysses": judge_ulysses, "ring": judge_ring, "ulysses_x_ring": judge_ulysses_x_ring,
    "cfg_x_ulysses": judge_cfg_x_ulysses, "tp": judge_tp, "text_encoder": judge_text_encoder, "vae": judge_vae,
}
# KINDS (above, the display order) names exactly these; tests/test_feasibility.py checks it


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
        for judge in JUDGES.values():
            table.rows.append(judge(f, n))
    return table
