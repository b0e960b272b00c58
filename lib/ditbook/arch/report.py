"""The architecture report: plain dataclasses stored as ``inspect/arch.json``, read by every later stage."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


def _build(cls, data: dict | None):
    if data is None:
        return None
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class CallConvention:
    """How the transformer really calls a block, traced on a real run."""

    positional: list[str] = field(default_factory=list)  # parameter names bound positionally, in order
    keywords: list[str] = field(default_factory=list)  # parameter names passed as keywords
    outputs: int = 1  # arity of the returned value (1 for a bare tensor)
    returns_tuple: bool = False  # the block returns a tuple/list (a 1-tuple has outputs == 1 too)
    output_roles: list[str] = field(default_factory=list)  # e.g. ["encoder_hidden_states", "hidden_states"]
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    output_shapes: list[list[int]] = field(default_factory=list)
    calls_per_forward: int = 0
    varying_arguments: list[str] = field(default_factory=list)  # names passed to some blocks only, or a new value per block


@dataclass
class BlockList:
    """One ``nn.ModuleList`` of transformer blocks."""

    path: str  # attribute path from the transformer, e.g. "transformer_blocks"
    length: int
    block_class: str
    param_share: float  # share of the transformer's parameters
    signature: list[str] = field(default_factory=list)  # block.forward parameter names
    call: CallConvention | None = None
    forward_pattern: str | None = None  # cache-dit ForwardPattern name, e.g. "Pattern_0"
    pattern_reason: str = ""
    compatible_patterns: list[str] = field(default_factory=list)  # every pattern cache-dit could run it with
    pattern_source: str = "static"  # "static" (signature only) or "traced" (a real call)
    cache_dit_pattern: str | None = None  # what cache-dit's registered adapter declares for this list
    diffusers_hook_metadata: bool = False  # the block class is in diffusers' TransformerBlockRegistry

    @classmethod
    def from_dict(cls, d: dict) -> "BlockList":
        d = dict(d)
        d["call"] = _build(CallConvention, d.get("call"))
        return _build(cls, d)


@dataclass
class AttentionFacts:
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    gqa_ratio: float | None = None  # heads / kv_heads; 1.0 without GQA
    kind: str = "unknown"  # "joint" (text+image in one attention), "cross", "self"
    fused_qkv: bool = False
    masks: list[str] = field(default_factory=list)  # where masks enter: argument names / attention kwargs
    text_seq_len: int | None = None
    image_seq_len: int | None = None
    rope: bool = False
    processor_classes: list[str] = field(default_factory=list)
    attention_modules: int = 0  # attention modules found inside the blocks
    cross_attention_len: int | None = None  # key length of cross attention (traced)
    sdpa_calls: int = 0  # scaled_dot_product_attention calls per transformer forward (traced)
    native_gqa: bool = False  # keys/values reach attention with fewer heads than queries (traced)


@dataclass
class CfgFacts:
    calls_per_step: float | None = None  # transformer calls per denoising step
    style: str = "unknown"  # "none", "separate" (two calls), "batched" (batch of two), "distilled"
    batch_per_call: int | None = None
    steps_traced: int | None = None
    transformer_calls: int | None = None
    cache_dit_separate_cfg: bool | None = None  # cache-dit's own has_separate_cfg answer for the pipeline


@dataclass
class SupportFacts:
    cache_dit_adapter: str | None = None  # name of cache-dit's registered adapter, if any
    cache_dit_cp_planner: str | None = None
    cache_dit_tp_planner: str | None = None
    diffusers_cp_plan: bool = False
    diffusers_tp_plan: bool = False
    diffusers_hook_blocks: dict[str, bool] = field(default_factory=dict)  # block class -> registered
    notes: list[str] = field(default_factory=list)
    cache_dit_blocks: list[str] = field(default_factory=list)  # block-list paths cache-dit's adapter names
    cache_dit_patterns: list[str] = field(default_factory=list)  # its ForwardPattern per list, same order
    cache_dit_patch_functor: str | None = None
    cache_dit_separate_cfg: bool | None = None
    agreement: list[str] = field(default_factory=list)  # how ditbook's findings compare with cache-dit's


@dataclass
class ArchReport:
    transformer_class: str
    pipeline_class: str | None
    param_count: int
    block_lists: list[BlockList] = field(default_factory=list)
    loop_extra_work: bool = False
    loop_extra_work_reasons: list[str] = field(default_factory=list)
    attention: AttentionFacts = field(default_factory=AttentionFacts)
    cfg: CfgFacts = field(default_factory=CfgFacts)
    modulation: str = "unknown"  # "shared" across blocks or "per_block"
    support: SupportFacts = field(default_factory=SupportFacts)
    traced: bool = False
    notes: list[str] = field(default_factory=list)
    modulation_reason: str = ""
    loop_work_conditional: list[str] = field(default_factory=list)  # loop work present in the code but off in this run
    source_files: list[str] = field(default_factory=list)  # files defining the transformer (for the code surface)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArchReport":
        d = dict(d)
        d["block_lists"] = [BlockList.from_dict(b) for b in d.get("block_lists", [])]
        d["attention"] = _build(AttentionFacts, d.get("attention")) or AttentionFacts()
        d["cfg"] = _build(CfgFacts, d.get("cfg")) or CfgFacts()
        d["support"] = _build(SupportFacts, d.get("support")) or SupportFacts()
        return _build(cls, d)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ArchReport":
        path = Path(path)
        if not path.is_file():  # a run started without its inspect stage (another run's plan approved it)
            raise FileNotFoundError(f"this run has no inspection: {path} is missing — a later stage reads its own "
                                    f"run's inspect results; run the inspect stage in this run "
                                    f"(ditbook run CARD --stages intake,inspect,...)")
        return cls.from_dict(json.loads(path.read_text()))

    def block_list(self, path: str) -> BlockList:
        for b in self.block_lists:
            if b.path == path:
                return b
        raise KeyError(f"no block list {path!r}; have {[b.path for b in self.block_lists]}")
