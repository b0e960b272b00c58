"""Typed stage records: one dataclass per stage's ``results.json``, with a schema version.

Every stage writes its results from its record (``RunFolder.write_results(stage, record)``) and
every reader reads them back through it (``RunFolder.read_results(stage)`` -> the record): the
schema is these classes, nothing else. A file of another schema version is refused with
:class:`SchemaVersionError` naming both versions; an unknown field, a missing field without a
default, or a value of the wrong shape is a :class:`RecordError` naming its dotted path (no alias
field names, no silent defaults for what a stage must have written). ``docs/CONTRACTS.md``'s schema
part is generated from these classes (``python -m ditbook.records``).

Fields typed ``dict`` are details a reader only displays (the adapter's decisions, a feasibility
row's facts); everything a later stage decides on is typed.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .quality import SetQuality
from .settings import Gates


class RecordError(ValueError):
    """A results file that does not match its record (the message names the dotted field)."""


class SchemaVersionError(RecordError):
    """A results file written by another schema version of its stage's record."""


# -- the generic part: a dataclass to JSON-ready data and back ------------------------------------------
def encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_dict() if hasattr(value, "to_dict") else {f.name: encode(getattr(value, f.name))
                                                                    for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(tp: Any, value: Any, where: str) -> Any:
    """``value`` (JSON data) as ``tp`` (a dataclass, ``list[X]``, ``dict[str, X]``, ``X | None`` or a
    plain type, which is taken as it is)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(members) == len(typing.get_args(tp)):
                raise RecordError(f"{where}: null where a value is required")
            return None
        return decode(members[0], value, where) if len(members) == 1 else value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # already built (a record made in the same process)
            return value
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp) or (Any,)
        return [decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, item = typing.get_args(tp) or (str, Any)
        return {k: decode(item, v, f"{where}.{k}") for k, v in value.items()}
    return value


def _build(cls: type, data: dict, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise RecordError(f"{where}: unknown field(s) {unknown} of {cls.__name__}")
    values = {}
    for name, f in known.items():
        if name in data:
            values[name] = decode(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(f"{where}.{name}: missing (a field of {cls.__name__} without a default)")
    return cls(**values)


@dataclass
class Part:
    """A nested part of a record: ``to_dict`` field by field."""

    def to_dict(self) -> dict:
        return {f.name: encode(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass
class StageRecord(Part):
    """A stage's ``results.json``: ``{"schema": {"stage", "version"}, <fields>}``."""

    STAGE: ClassVar[str]
    VERSION: ClassVar[int]

    def to_dict(self) -> dict:
        return {"schema": {"stage": self.STAGE, "version": self.VERSION}, **super().to_dict()}

    @classmethod
    def from_dict(cls, data: dict, where: str | None = None) -> "StageRecord":
        where = where or f"{cls.STAGE}/results.json"
        if not isinstance(data, dict):
            raise RecordError(f"{where}: expected a mapping, got {type(data).__name__}")
        schema = data.get("schema") or {}
        found = schema.get("version") if isinstance(schema, dict) else None
        if schema.get("stage", cls.STAGE) != cls.STAGE or found != cls.VERSION:
            got = "none (written before stage records had a schema)" if found is None else f"{schema.get('stage')} {found}"
            raise SchemaVersionError(f"{where}: schema version {got}; this ditbook reads {cls.STAGE} version "
                                     f"{cls.VERSION} (run the stage again with this version)")
        return _build(cls, {k: v for k, v in data.items() if k != "schema"}, where)


# -- intake ----------------------------------------------------------------------------------------------
@dataclass
class ImageRow(Part):
    """One rendered case on disk (paths relative to the stage folder)."""

    key: str
    prompt: str
    seed: int
    png: str
    npy: str
    seconds: float = 0.0
    shape: list[int] = field(default_factory=list)
    frames: int | None = None  # a video's frame count
    png_frames: list[int] | None = None  # a video: the frames its PNG shows, in one row


@dataclass
class IntakeResults(StageRecord):
    STAGE: ClassVar[str] = "intake"
    VERSION: ClassVar[int] = 1

    images: list[ImageRow]
    placement: dict  # {device, dtype}
    load_seconds: float = 0.0
    render_seconds: float = 0.0
    grid: str | None = None
    pipeline_components: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)  # what the model folder says (intake.reference)


# -- inspect ---------------------------------------------------------------------------------------------
@dataclass
class InspectResults(StageRecord):
    STAGE: ClassVar[str] = "inspect"
    VERSION: ClassVar[int] = 1

    plan_hash: str
    transformer_class: str
    arch: str = "arch.json"
    plan: str = "plan.json"
    plan_md: str = "plan.md"
    code_surface: str = "code_surface.json"
    block_lists: list[str] = field(default_factory=list)
    forward_patterns: list = field(default_factory=list)
    loop_extra_work: bool = False
    cfg_style: str = "unknown"
    heads: int | None = None
    kv_heads: int | None = None
    risks: list[str] = field(default_factory=list)
    port_estimate_lines: int = 0
    traced_size: list[int] | None = None


# -- cache -----------------------------------------------------------------------------------------------
@dataclass
class StrategyRow(Part):
    """One configuration of one cache technique rendered on one split (calibration, holdout, ...)."""

    name: str
    family: str
    config: dict
    quality: SetQuality | None
    skipped_fraction: float
    attention_skipped_fraction: float
    cached_steps: int
    passed: bool
    split: str = "calibration"
    seconds: float = 0.0
    error: str | None = None
    counts: dict = field(default_factory=dict)
    stopped: str | None = None  # the search stopped at the first case that failed a gate (which, of how many)
    fp8: dict | None = None  # the fp8 search's rows: {quantized, kept}


@dataclass
class Chosen(Part):
    name: str
    family: str
    config: dict


@dataclass
class ChosenDetail(Chosen):
    skipped_fraction: float | None = None
    holdout_quality: SetQuality | None = None
    holdout_images: dict | None = None  # {folder, baseline, keys, worst}


@dataclass
class CompiledCheck(Part):
    """The chosen configuration rendered compiled against uncompiled (card ``runtime.compile``)."""

    ran: bool = False
    reason: str | None = None
    ok: bool | None = None
    error: str | None = None
    name: str | None = None
    backend: str | None = None
    method: str | None = None
    regions: int | None = None
    eager_s: float | None = None
    compiled_s: float | None = None
    compile_s: float | None = None
    speedup: float | None = None
    quality: dict | None = None


@dataclass
class Fp8Choice(Part):
    """The chosen strategy's schedule tuned with block linears in fp8, confirmed on held-out seeds."""

    name: str
    family: str
    config: dict
    layers: list[str]
    candidates: int
    kept: list[str] = field(default_factory=list)
    kept_share: float | None = None
    skipped_fraction: float | None = None
    holdout_quality: SetQuality | None = None
    calibration_quality: SetQuality | None = None
    images: str | None = None  # its calibration images, for the fresh-process rerun


@dataclass
class Fp8Search(Part):
    """Card ``cache.fp8``: the chosen strategy searched again with block linears in fp8."""

    ran: bool = False
    reason: str | None = None
    refused: str | None = None
    chosen: Fp8Choice | None = None
    quantization: str | None = None
    shipped_quantizer: bool = False
    strategy: str | None = None
    candidates: int | None = None
    left_out: list[str] = field(default_factory=list)
    sensitivity: list[dict] = field(default_factory=list)
    sensitivity_note: str | None = None
    tries: list[dict] = field(default_factory=list)


@dataclass
class Reproduction(Part):
    """The shipped adapter module imported in a fresh process, the chosen configuration rerun."""

    ran: bool = False
    reason: str | None = None
    ok: bool | None = None
    max_abs: float | None = None
    tolerance: float | None = None
    module: str | None = None
    per_image: dict = field(default_factory=dict)
    returncode: int | None = None
    stderr_tail: str | None = None
    fp8: dict | None = None  # the fp8 composition rerun: {max_abs, ok, error}


@dataclass
class CacheResults(StageRecord):
    STAGE: ClassVar[str] = "cache"
    VERSION: ClassVar[int] = 1

    adapter_module: str
    gates: Gates
    refused: str | None = None  # why no cache technique could be applied safely (the stage still passes)
    adapter_fallback: list[str] = field(default_factory=list)
    adapter: dict = field(default_factory=dict)  # AdapterInfo
    noise_floor: dict = field(default_factory=dict)
    adapter_checks: list[dict] = field(default_factory=list)
    skipped_strategies: dict[str, str] = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    strategies: list[StrategyRow] = field(default_factory=list)
    frontier: list[dict] = field(default_factory=list)
    frontier_holdout: list[dict] = field(default_factory=list)
    chosen: ChosenDetail | None = None
    decision: dict | None = None  # ship.decide's record on held-out seeds: rule, why, runners-up
    order_check: dict | None = None
    reproduction: Reproduction = field(default_factory=Reproduction)
    compiled: CompiledCheck = field(default_factory=CompiledCheck)
    fp8: Fp8Search = field(default_factory=Fp8Search)

    def holdout_rows(self, passed_only: bool = True) -> list[StrategyRow]:
        return [r for r in self.strategies if r.split == "holdout" and (r.passed or not passed_only)]


# -- parallel --------------------------------------------------------------------------------------------
@dataclass
class PlanRow(Part):
    """One plan launched over processes, judged against its one-process reference (parity) and,
    with a cache, against the uncached baseline."""

    name: str
    world_size: int
    passed: bool
    quality: SetQuality | None = None  # parity against ``reference`` (parallel.gates)
    seconds: float | None = None
    speedup: float | None = None  # against the reference's time in the same launch
    reference: str | None = None
    baseline_quality: SetQuality | None = None  # +cache plans: against the uncached one-process run
    details: dict = field(default_factory=dict)
    error: str | None = None
    gates: dict = field(default_factory=dict)


@dataclass
class RankSplit(Part):
    """What one rank's blocks received (``cp.sharding.BlockInputRecorder``), which parameters were
    sharded there, and each rank-recording kind's own record (tp, vae, te, ditbook's ring)."""

    block_inputs: dict = field(default_factory=dict)  # block list -> {seq_lens, entries, ...}
    sharded_parameters: list[str] = field(default_factory=list)
    kinds: dict = field(default_factory=dict)  # plan token -> that kind's per-rank record


@dataclass
class KindCheck(Part):
    check: Any = None  # the kind's ``check`` result (None: not checked)
    error: str | None = None  # the ShardingError it raised, named


@dataclass
class Sharding(Part):
    """One launched plan's split, gathered from every rank by the worker and judged there (CP block
    lengths against the unsplit trace) and in the launch (CFG rows against the reference)."""

    ranks: list[RankSplit] = field(default_factory=list)
    degree: int = 1  # the context-parallel degree
    check: Any = None
    error: str | None = None
    kinds: dict[str, KindCheck] = field(default_factory=dict)
    cfg_check: Any = None  # set by the launch for CFG-parallel plans (None: not checked or failed)
    split_cfg: bool = False  # the plan splits the CFG branches (its cfg_check is due)

    def verified(self) -> bool | None:
        """True when every split the plan makes was checked on every rank's record: the block
        sequence (CP), the CFG branches (rows entering the blocks), each kind's own record; None:
        the plan splits nothing."""
        checks = [bool(self.check) and not self.error] if self.degree > 1 else []
        if self.cfg_check is not None or self.split_cfg:
            checks.append(bool(self.cfg_check))
        checks += [bool(k.check) and not k.error for k in self.kinds.values()]
        return all(checks) if checks else None


@dataclass
class ShardingSummary(Part):
    """Per plan in ``parallel/results.json``: per rank, per block list, the sequence lengths and
    rows its blocks received, the sharded parameter count, and whether every split was verified."""

    per_rank: list[dict] = field(default_factory=list)
    sharded_parameters: list[int] = field(default_factory=list)
    rows_per_rank: list[dict] = field(default_factory=list)
    verified: bool | None = None
    error: str | None = None
    kinds: dict[str, KindCheck] = field(default_factory=dict)

    @classmethod
    def of(cls, s: Sharding) -> "ShardingSummary":
        return cls([{n: rec["seq_lens"] for n, rec in r.block_inputs.items()} for r in s.ranks],
                   [len(r.sharded_parameters) for r in s.ranks],
                   [{n: rec.get("entries") for n, rec in r.block_inputs.items()} for r in s.ranks],
                   s.verified(), s.error, s.kinds)


@dataclass
class NotRun(Part):
    name: str
    reason: str


@dataclass
class ParallelResults(StageRecord):
    STAGE: ClassVar[str] = "parallel"
    VERSION: ClassVar[int] = 1

    feasibility: dict
    passed: bool
    plans: list[PlanRow] = field(default_factory=list)
    not_run: list[NotRun] = field(default_factory=list)
    gqa: dict = field(default_factory=dict)
    launch: dict | None = None
    cp_plan_file: str | None = None
    sharding: dict[str, ShardingSummary | None] = field(default_factory=dict)
    device: str | None = None  # where the ranks ran (cpu: their timings are no speed figure)


# -- benchmark -------------------------------------------------------------------------------------------
@dataclass
class ConfigRow(Part):
    """One configuration measured in the benchmark's process beside the baseline."""

    name: str
    family: str
    params: dict = field(default_factory=dict)
    notes: str = ""
    timing: dict | None = None  # Timing.to_dict: end_to_end {median, min, max, n}, parts, peak memory
    speedup: float | None = None
    part_speedups: dict = field(default_factory=dict)
    memory_ratio: float | None = None
    efficiency: dict | None = None
    psnr_min: float | None = None
    ssim_min: float | None = None
    worst_tile_psnr: float | None = None
    passed: bool | None = None
    reasons: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class TimingState(Part):
    """The baseline re-timed at the end against its first timing, and the bound it is held to."""

    drift: float | None
    limit: float
    stable: bool | None  # None: the baseline was not re-timed
    warmup: int | None = None
    repeats: int | None = None
    verdict_rows: list[str] = field(default_factory=list)


@dataclass
class Holdout(Part):
    """A configuration's figures on held-out seeds (videos: each video's worst frame)."""

    psnr_min: float | None
    ssim_min: float | None
    n: int | None = None
    frame_reduce: str | None = None


@dataclass
class Verdict(Part):
    """What ships (``ship.decide`` over the measured candidates) and why, as every page shows it.
    ``name``: the shipped row; when nothing ships, the cache stage's choice (``ship`` false, the
    reason says why), ``baseline`` when the cache stage chose nothing, ``none`` without its record."""

    name: str
    ship: bool
    reason: str
    rule: str
    gates: Gates
    short: str = ""  # the technique
    family: str = ""
    config: dict | None = None
    form: str = "plain"  # plain, compiled, fp8, fp8+compiled
    speedup: float | None = None
    speedup_range: list[float] | None = None
    e2e_ms: float | None = None
    holdout: Holdout | None = None
    passes_gates: bool | None = None
    skipped_fraction: float | None = None
    measured_psnr_min: float | None = None  # its images in the benchmark, on the calibration seeds
    measured_ssim_min: float | None = None
    timing_unstable: dict | None = None  # {drift, limit}
    compile: dict | None = None  # a compiled form shipped: its one-time cost {compile_s, first_call_s, steady_call_s}
    fp8: dict | None = None  # an fp8 form shipped: {layers, candidates, kept}
    runner_ups: list[dict] = field(default_factory=list)  # eligible, not chosen, each with why_not
    refused: list[dict] = field(default_factory=list)  # not eligible, each with why_not


@dataclass
class BenchmarkResults(StageRecord):
    STAGE: ClassVar[str] = "benchmark"
    VERSION: ClassVar[int] = 1

    device: str
    warmup: int
    repeats: int
    baseline: ConfigRow
    configs: list[ConfigRow] = field(default_factory=list)
    flops: dict | None = None
    baseline_drift: float | None = None
    noise_floor: dict | None = None
    timing: TimingState | None = None
    cases: list[str] = field(default_factory=list)
    video: dict | None = None
    inputs: dict = field(default_factory=dict)
    intake_agreement: dict | None = None
    recorded: dict = field(default_factory=dict)  # the earlier stages' rows, as they recorded them
    residual_changes: dict = field(default_factory=dict)
    images: dict = field(default_factory=dict)
    summary: list[dict] = field(default_factory=list)
    gates: dict[str, Gates] = field(default_factory=dict)
    verdict: Verdict | None = None
    plot_points: list[str] = field(default_factory=list)
    parity_only: list[str] = field(default_factory=list)
    plots: dict = field(default_factory=dict)
    grid: str | None = None
    grid_videos: dict | None = None
    labels: dict = field(default_factory=dict)
    holdout_worst: dict | None = None

    def row(self, name: str) -> ConfigRow | None:
        """The measured row of ``name`` (the baseline included)."""
        return next((r for r in [self.baseline, *self.configs] if r.name == name), None)


RECORDS: dict[str, type[StageRecord]] = {r.STAGE: r for r in (IntakeResults, InspectResults, CacheResults,
                                                              ParallelResults, BenchmarkResults)}


def schema_markdown() -> str:
    """The schema part of ``docs/CONTRACTS.md``: every record's fields and types."""
    lines = []
    for rec in RECORDS.values():
        lines.append(f"- `{rec.STAGE}/results.json` — `{rec.__name__}` (version {rec.VERSION}): "
                     + ", ".join(_field_text(rec, f) for f in dataclasses.fields(rec)))
    parts = [ImageRow, StrategyRow, Chosen, ChosenDetail, CompiledCheck, Fp8Choice, Fp8Search, Reproduction, PlanRow,
             NotRun, ShardingSummary, KindCheck, ConfigRow, TimingState, Holdout, Verdict]
    lines.append("")
    lines += [f"  - `{p.__name__}`: " + ", ".join(_field_text(p, f) for f in dataclasses.fields(p)) for p in parts]
    return "\n".join(lines)


def _field_text(cls, f) -> str:
    tp = typing.get_type_hints(cls)[f.name]
    name = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return f"`{f.name}` ({name or _DOTTED.sub(_LAST, str(tp))})"


_DOTTED, _LAST = re.compile(r"\b(?:\w+\.)+(\w)"), r"\1"  # a type's name without its module prefixes


__all__ = ["BenchmarkResults", "CacheResults", "Chosen", "ChosenDetail", "CompiledCheck", "ConfigRow", "Fp8Choice",
           "Fp8Search", "Holdout", "ImageRow", "InspectResults", "IntakeResults", "NotRun", "ParallelResults", "Part", "PlanRow",
           "RECORDS", "RankSplit", "KindCheck", "Sharding", "ShardingSummary", "RecordError", "Reproduction", "SchemaVersionError", "StageRecord", "StrategyRow",
           "TimingState", "Verdict", "decode", "encode", "schema_markdown"]

if __name__ == "__main__":
    print(schema_markdown())
