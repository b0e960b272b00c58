"""Typed card settings: one dataclass per card section, every default and quality gate written once.

A model card's sections ``generation``, ``runtime``, ``inspect``, ``cache``, ``parallel`` and
``benchmark`` are parsed into the dataclasses below. This module is the only place where a
default or a gate number is written: the stages read ``card.cache.gates``,
``card.parallel.gates``, ``card.generation.steps`` and so on, and nothing else.

``parse_section(cls, data, prefix)`` checks a section and returns the typed object and every
problem, each named by its dotted key (``benchmark.repeat: unknown key``,
``cache.gates.psnr: must be a number, got 'abc'``). Booleans are not integers or numbers;
integers are bounded; ``height``/``width`` are positive multiples of ``SIDE_MULTIPLE``.

Quality gates (``Gates``) live in the sections that judge quality: ``cache.gates`` (cached
images against the intake baseline) and ``parallel.gates`` (a parallel plan against the
single-process run of the same launch). The benchmark stage judges its cache and
cache+parallel rows with ``cache.gates`` and its parallel rows with ``parallel.gates``.

Migration: the gates used to be written flat (``cache: {psnr: 30, ssim: 0.90}``); they are now
``cache: {gates: {psnr: 30, ssim: 0.90}}``, and a flat key is refused with a message naming the
new one. ``benchmark.gates`` and ``inspect.gates`` are gone (the benchmark and ``plan.md`` show
the cache and parallel sections' gates).

``python -m ditbook.settings`` prints the README's table of every card key and its default.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable

MAX_STEPS = 10_000  # denoising steps (and traced steps) above this are refused as a typo
SIDE_MULTIPLE = 8  # height/width: the VAE's downsampling factor of every pipeline ditbook runs
MAX_SIDE = 16_384
MAX_SEED = 2**32 - 1  # every RNG a pipeline may seed (torch, numpy's legacy one) takes 0..2**32-1
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")  # or cuda:N
# a speedup below this is within the run-to-run spread of a CPU benchmark: not worth shipping
MIN_USEFUL_SPEEDUP = 1.05
ALWAYS_CHECKED = ["no NaN/Inf", "no blank image", "worst-tile PSNR within tile_margin_db of the gate"]

# tolerances of ditbook's own checks (not card keys: they judge ditbook's machinery, not the model's
# images), as (fp32/fp64, lower precision):
# every CP rank simulated in one process against the plain forward: max relative error
CP_DRYRUN_REL_TOL = (1e-3, 3e-2)
# an attention path (GQA) against ``enable_gqa``'s result: max absolute difference
GQA_PATH_ATOL = (1e-4, 2e-2)
# an image whose pixel standard deviation is below this is blank
BLANK_STD = 1e-3

# -- checks: value -> (value, error or None) ------------------------------------------------
Check = Callable[[Any], "tuple[Any, str | None]"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _got(v) -> str:
    return f"got {v!r} ({type(v).__name__})"


def integer(lo: int | None = None, hi: int | None = None, multiple: int | None = None) -> Check:
    def check(v):
        if not _is_int(v):
            return v, f"must be an integer, {_got(v)}"
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
            return v, f"must be {rng}, got {v}"
        if multiple and v % multiple:
            return v, f"must be a multiple of {multiple}, got {v}"
        return v, None
    check.kind = "integer"
    return check


def number(lo: float | None = None, hi: float | None = None, hi_open: bool = False) -> Check:
    def check(v):
        if not _is_num(v):
            return v, f"must be a finite number, {_got(v)}"
        if lo is not None and v < lo or hi is not None and (v >= hi if hi_open else v > hi):
            return v, f"must be in [{lo}, {hi}{')' if hi_open else ']'}, got {v}"
        return float(v), None
    check.kind = "number"
    return check


def text(choices: tuple | None = None, prefixes: tuple = ()) -> Check:
    def check(v):
        if not isinstance(v, str):
            return v, f"must be a string, {_got(v)}"
        if choices and v not in choices and not any(v.startswith(p) for p in prefixes):
            return v, f"{v!r} is not one of {choices}" + (f" (or {prefixes[0]}N)" if prefixes else "")
        return v, None
    check.kind = "string"
    return check


def list_of(item: Check, nonempty: bool = False, scalar_ok: bool = False) -> Check:
    def check(v):
        if scalar_ok and not isinstance(v, (list, tuple, dict)):
            v = [v]
        if not isinstance(v, (list, tuple)):
            return v, f"must be a list, {_got(v)}"
        if nonempty and not v:
            return list(v), "must not be empty"
        out = []
        for i, x in enumerate(v):
            x, err = item(x)
            if err:
                return v, f"item {i}: {err}"
            out.append(x)
        return out, None
    check.kind = f"list of {getattr(item, 'kind', 'values')}"
    return check


def mapping() -> Check:
    def check(v):
        if not isinstance(v, dict):
            return v, f"must be a mapping, {_got(v)}"
        return dict(v), None
    check.kind = "mapping"
    return check


def optional(inner: Check) -> Check:
    def check(v):
        return (None, None) if v is None else inner(v)
    check.kind = f"{getattr(inner, 'kind', 'value')} or null"
    check.optional = True
    return check


def section(cls: type) -> Check:
    """A nested mapping parsed into the settings class ``cls`` (unknown keys and wrong values refused)."""
    def check(v):
        if not isinstance(v, dict):
            return v, f"must be a mapping, {_got(v)}"
        out, problems = parse_section(cls, v, "")
        return out, "; ".join(f"{k.lstrip('.')}: {m}" for k, m in problems) or None
    check.kind = "mapping"
    return check


def compile_choice() -> Check:
    """``runtime.compile``: off (false/null), true (inductor), a torch.compile backend name, or a
    mapping of ``ditbook.accel.compile.CompileSettings`` fields (checked there, at the run's start:
    ``preflight.technique_problems``)."""
    def check(v):
        if v is None or isinstance(v, (bool, str)):
            return v, None
        if isinstance(v, dict):
            return dict(v), None
        return v, f"must be a bool, a backend name or a mapping, {_got(v)}"
    check.kind = "bool, backend name or mapping"
    return check


def boolean() -> Check:
    def check(v):
        return (v, None) if isinstance(v, bool) else (v, f"must be true or false, {_got(v)}")
    check.kind = "bool"
    return check


def setting(default=MISSING, check: Check | None = None, doc: str = "", factory=MISSING):
    meta = {"check": check, "doc": doc}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# -- the sections ---------------------------------------------------------------------------
@dataclass
class Gates:
    """Image quality gates: every image must have PSNR above ``psnr`` dB and SSIM above ``ssim``
    against its reference; a tile may fall ``tile_margin_db`` below ``psnr`` before the image fails."""

    psnr: float = setting(30.0, number(0.0, 100.0, hi_open=True), "PSNR gate in dB (images must be above it)")
    ssim: float = setting(0.90, number(-1.0, 1.0, hi_open=True), "SSIM gate (images must be above it)")
    tile_margin_db: float = setting(10.0, number(0.0, 100.0), "how far one tile's PSNR may fall below the gate")

    @classmethod
    def from_dict(cls, d: dict | None, **defaults) -> "Gates":
        """Gates from a mapping (checked: unknown keys and non-numbers raise ``ValueError``)."""
        base = {**asdict(cls()), **defaults}
        gates, problems = parse_section(cls, {**base, **(d or {})}, "gates")
        if problems:
            raise ValueError("; ".join(f"{k}: {m}" for k, m in problems))
        return gates

    def to_dict(self) -> dict:
        return asdict(self)

    def looser_than(self, other: "Gates") -> list[str]:
        """Fields where these gates accept more than ``other``, as ``name old -> new``."""
        out = []
        for name, looser in (("psnr", self.psnr < other.psnr), ("ssim", self.ssim < other.ssim),
                             ("tile_margin_db", self.tile_margin_db > other.tile_margin_db)):
            if looser:
                out.append(f"{name} {getattr(other, name):g} -> {getattr(self, name):g}")
        return out

    def describe(self) -> str:
        return f"PSNR > {self.psnr:g} dB and SSIM > {self.ssim:g} (worst tile > {self.psnr - self.tile_margin_db:g} dB)"


_side = integer(SIDE_MULTIPLE, MAX_SIDE, SIDE_MULTIPLE)


@dataclass
class Generation:
    """``generation:`` — what every stage renders (prompts x seeds)."""

    prompts: list[str] = setting(check=list_of(text(), nonempty=True, scalar_ok=True), factory=list,
                                 doc="prompts rendered by every stage (at least one)")
    negative_prompt: str | None = setting(None, optional(text()), "negative prompt (true CFG)")
    seeds: list[int] = setting(check=list_of(integer(0, MAX_SEED), nonempty=True, scalar_ok=True), factory=lambda: [0],
                               doc=f"seeds (0..{MAX_SEED}); each prompt is rendered once per seed")
    height: int = setting(64, _side, f"image height, a multiple of {SIDE_MULTIPLE}")
    width: int = setting(64, _side, f"image width, a multiple of {SIDE_MULTIPLE}")
    steps: int = setting(8, integer(1, MAX_STEPS), f"denoising steps (1..{MAX_STEPS})")
    guidance_scale: float | None = setting(None, optional(number()), "guidance scale (null: the pipeline's default)")
    true_cfg_scale: float | None = setting(None, optional(number()), "> 1 with a negative prompt: true CFG")
    extra: dict = setting(check=mapping(), factory=dict, doc="any other pipeline __call__ argument")
    holdout_seeds: list[int] = setting(check=list_of(integer(0, MAX_SEED)), factory=list,
                                       doc="seeds that confirm tuned settings (empty: seeds + cache.holdout_shift)")
    holdout_prompts: list[str] = setting(check=list_of(text()), factory=list,
                                         doc="prompts that confirm tuned settings (empty: the prompts)")


@dataclass
class RuntimeSettings:
    """``runtime:`` — where the model runs."""

    device: str = setting("auto", text(DEVICES, ("cuda:",)), "auto (CUDA when present), cpu, cuda or cuda:N")
    dtype: str = setting("auto", text(DTYPES), "auto (bf16 on CUDA for a diffusers pipeline, else fp32), float32, bfloat16, float16")
    compile: bool | str | dict | None = setting(None, compile_choice(), "regional torch.compile, everywhere it is measured: the cache stage checks its choice compiled, the benchmark times a compiled twin of every row, +compile plans use its backend; true (inductor), a backend name, or a mapping of backend, mode, fullgraph, dynamic, decoder (the image decoder too), probe_calls")


@dataclass
class InspectSettings:
    """``inspect:`` — the traced generation of the inspect stage."""

    trace_steps: int = setting(2, integer(1, MAX_STEPS), "denoising steps of the traced generation")
    trace_size: int | None = setting(None, optional(_side), "height/width of the traced generation (null: the card's)")


@dataclass
class CacheSettings:
    """``cache:`` — the cache stage's search and its quality gates."""

    gates: Gates = setting(check=None, factory=Gates, doc="cached images against the intake baseline")
    strategies: list[str] | None = setting(None, optional(list_of(text())), "strategy names to run (null: every registered one)")
    max_configs: int | None = setting(None, optional(integer(1)), "configurations tried per strategy (null: its whole grid)")
    confirm_tries: int = setting(3, integer(1), "held-out confirmations per strategy")
    holdout_shift: int = setting(1000, integer(), "held-out seeds are the seeds plus this (without holdout_seeds)")
    reproduce_tolerance: float = setting(1e-5, number(0.0), "max abs difference of the generated module's rerun")
    check_cases: int | None = setting(2, optional(integer(1)), "prompt x seed cases of each strategy's caching-off check, the first prompt's seeds first (null: every case)")
    reproduce: bool = setting(True, boolean(), "rerun the chosen configuration from the generated adapter module in a fresh process")
    fp8: bool = setting(False, boolean(), "also tune the chosen strategy's schedule with the block linears in fp8 (torchao float8), judged on held-out seeds; the benchmark ships it when faster (refused, with the reason, below CUDA capability 8.9)")
    fp8_keep: list[float] = setting(factory=lambda: [0.0, 0.25, 0.5], check=list_of(number(0.0, 1.0), nonempty=True),
                                    doc="with fp8: shares of the block linears kept in the model's dtype, most sensitive first (measured on the model), tried in order until a schedule passes on held-out seeds")


@dataclass
class ParallelCache:
    """``parallel.cache:`` — the DBCache options of ``+cache`` plans, by cache-dit's ``DBCacheConfig``
    names; a key left out takes the cache strategy's default (``accel.dbcache.DBCacheSettings``,
    the one place DBCache's defaults are written)."""

    Fn_compute_blocks: int | None = setting(None, optional(integer(0)), "blocks always computed first")
    Bn_compute_blocks: int | None = setting(None, optional(integer(0)), "blocks always computed last")
    residual_diff_threshold: float | None = setting(None, optional(number(0.0)), "cache when the residual changed less")
    max_warmup_steps: int | None = setting(None, optional(integer(0)), "steps computed before caching starts")
    max_cached_steps: int | None = setting(None, optional(integer(-1)), "cached steps at most (-1: no limit)")
    max_continuous_cached_steps: int | None = setting(None, optional(integer(-1)), "cached steps in a row at most")
    steps_computation_mask: list[int] | None = setting(None, optional(list_of(integer(0, 1))),
                                                       "1 = a computed step, one entry per step (a static schedule)")
    steps_computation_policy: str | None = setting(None, optional(text(("dynamic", "static"))),
                                                   "static: the mask alone decides which steps compute")
    num_inference_steps: int | None = setting(None, optional(integer(1)), "steps of the schedule")

    def options(self) -> dict:
        """The keys set, as cache-dit ``DBCacheConfig`` keywords."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ParallelSettings:
    """``parallel:`` — which plans run and their quality gates."""

    gates: Gates = setting(check=None, factory=lambda: Gates(psnr=35.0),
                           doc="each plan against the single-process run of the same launch")
    plans: list[str] | None = setting(None, optional(list_of(text())), "plan names to run (null: every feasible plan)")
    cache: ParallelCache | None = setting(None, optional(section(ParallelCache)),
                                         "DBCache options of +cache plans (ParallelCache; null: the cache strategy's defaults)")
    nproc: int = setting(2, integer(1, 1024), "processes per launch (GPUs on a GPU host; gloo processes on the CPU)")
    with_cache: bool = setting(True, boolean(), "also run +cache plans (the cache decision agreed across ranks)")
    with_graph: bool | None = setting(None, optional(boolean()), "also run +compile+graph plans (CUDA graphs); null: when the model runs on a GPU")
    timeout: int = setting(300, integer(1), "seconds a rank may wait in a collective or make no progress")
    gqa_repeats: int = setting(5, integer(1, 1000), "timed repeats per GQA attention path")


@dataclass
class BenchmarkSettings:
    """``benchmark:`` — how the benchmark stage measures (it judges with cache.gates and parallel.gates)."""

    warmup: int = setting(1, integer(0, 1000), "warm-up calls per configuration")
    repeats: int = setting(3, integer(1, 1000), "timed calls per configuration")
    peak_tflops: float | None = setting(None, optional(number(0.0)), "device dense peak TFLOP/s (null: known devices)")
    max_cases: int | None = setting(None, optional(integer(1)), "prompt x seed cases per configuration (null: all)")
    configs: list[dict] = setting(check=list_of(mapping()), factory=list, doc="extra diffusers hook configurations")
    residuals: bool = setting(True, boolean(), "measure the residual change per step at the first block")
    attention_backend: str | None = setting(None, optional(text()), "auto: measure diffusers' attention backends and add the fastest correct one; or a backend name")
    fp8: bool = setting(False, boolean(), "also measure every configuration with its block linears in fp8 (torchao float8; refused, with the reason, below CUDA capability 8.9)")
    timing_drift: float = setting(0.10, number(0.0, 1.0), "how far the baseline re-timed at the end may move from its first timing (a share: 0.10 = 10%); beyond it the verdict says timing unstable instead of a speed-up")


# the baseline and the verdict's rows are timed warm and repeated, whatever benchmark.warmup and
# benchmark.repeats say (a speed-up from a cold, single timing is noise, issue 23)
VERDICT_MIN_WARMUP = 1
VERDICT_MIN_REPEATS = 3


SECTIONS: dict[str, type] = {
    "generation": Generation, "runtime": RuntimeSettings, "inspect": InspectSettings,
    "cache": CacheSettings, "parallel": ParallelSettings, "benchmark": BenchmarkSettings,
}
# sections holding quality gates; the benchmark's families and the section whose gates judge them
GATED_SECTIONS = ("cache", "parallel")
# which section's gates judge a benchmark family: configurations that must not change the result
# (parallel plans, compiled blocks, another attention backend) by the parallel gates
FAMILY_SECTION = {"cache": "cache", "parallel": "parallel", "cache+parallel": "cache", "compile": "parallel",
                  "attention": "parallel"}

_HINTS = {
    "generation": "put other pipeline arguments under generation.extra",
}


def _hint(prefix: str, key: str, cls: type) -> str:
    if prefix in _HINTS:
        return _HINTS[prefix]
    if "gates" in {f.name for f in fields(cls)} and key in {f.name for f in fields(Gates)}:
        return f"gates moved: write {prefix}.gates.{key}"
    return f"known: {', '.join(f.name for f in fields(cls))}"


def parse_section(cls: type, data: Any, prefix: str) -> tuple[Any, list[tuple[str, str]]]:
    """The typed section and every problem as ``(dotted key, message)``. A null section or a
    null value takes the default; a wrong value is reported and replaced by its default."""
    problems: list[tuple[str, str]] = []
    if data is None:
        return cls(), problems
    if not isinstance(data, dict):
        return cls(), [(prefix, f"must be a mapping, {_got(data)}")]
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            problems.append((f"{prefix}.{key}", f"unknown key ({_hint(prefix, str(key), cls)})"))
    values = {}
    for name, f in known.items():
        if name not in data:
            continue
        v = data[name]
        if name == "gates":  # a nested Gates: unset fields keep this section's defaults
            if v is None:
                continue
            if not isinstance(v, dict):
                problems.append((f"{prefix}.{name}", f"must be a mapping of {{psnr, ssim, tile_margin_db}}, {_got(v)}"))
                continue
            sub, subp = parse_section(Gates, {**asdict(f.default_factory()), **v}, f"{prefix}.{name}")
            problems += subp
            if not subp:
                values[name] = sub
            continue
        check = f.metadata.get("check")
        if v is None and not getattr(check, "optional", False):
            continue  # null: the default
        v, err = check(v) if check else (v, None)
        if err:
            problems.append((f"{prefix}.{name}", err))
        else:
            values[name] = v
    return cls(**values), problems


# -- documentation --------------------------------------------------------------------------
def _default_text(f) -> str:
    if f.default_factory is not MISSING:
        v = f.default_factory()
    else:
        v = f.default
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).replace("'", '"') if isinstance(v, (list, dict)) else str(v)


def reference_rows() -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, meaning)`` for every key of every section."""
    rows = []
    for sec, cls in SECTIONS.items():
        for f in fields(cls):
            check = f.metadata.get("check")
            if f.name == "gates":
                default = f.default_factory()
                for g in fields(Gates):
                    rows.append((f"{sec}.gates.{g.name}", g.metadata["check"].kind, f"{getattr(default, g.name):g}",
                                 f"{g.metadata['doc']}; {f.metadata['doc']}"))
                continue
            rows.append((f"{sec}.{f.name}", getattr(check, "kind", "value"), _default_text(f), f.metadata["doc"]))
    return rows


def reference_table() -> str:
    """The README's card reference (``python -m ditbook.settings`` prints it)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | `{d}` | {m} |" for k, t, d, m in reference_rows()]
    return "\n".join(lines)


__all__ = ["Gates", "Generation", "RuntimeSettings", "InspectSettings", "CacheSettings", "ParallelCache", "ParallelSettings",
           "BenchmarkSettings", "SECTIONS", "GATED_SECTIONS", "FAMILY_SECTION", "parse_section", "reference_rows",
           "reference_table", "MAX_STEPS", "SIDE_MULTIPLE", "MAX_SIDE", "DTYPES", "DEVICES", "MIN_USEFUL_SPEEDUP",
           "ALWAYS_CHECKED", "CP_DRYRUN_REL_TOL", "GQA_PATH_ATOL", "BLANK_STD"]

if __name__ == "__main__":
    print(reference_table())
