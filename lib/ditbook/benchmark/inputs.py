"""What the benchmark reads from the earlier stages' records, and the configurations it measures:
every configuration the cache stage confirmed on held-out seeds (and its fp8 composition), applied
through the adapter module it shipped, and the card's diffusers hooks (``benchmark.configs``). The
parallel stage's plans are shown as that stage recorded them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import accel
from ..configuration import Config, fp8_suffix, row_name
from ..records import CacheResults, IntakeResults, ParallelResults

STAGES_READ = ("intake", "cache", "parallel")


@dataclass
class StageInputs:
    """The earlier stages' records that exist in a run folder (None where absent)."""

    intake: IntakeResults | None = None
    cache: CacheResults | None = None
    parallel: ParallelResults | None = None
    status: dict[str, str | None] = field(default_factory=dict)

    def rows(self) -> list[dict]:
        return [{"stage": s, "results.json": "present" if getattr(self, s) is not None else "absent",
                 "status": self.status.get(s) or "-"} for s in STAGES_READ]

    def to_dict(self) -> dict:
        return {s: getattr(self, s) is not None for s in STAGES_READ}


def read_inputs(run) -> StageInputs:
    """The intake, cache and parallel records of a :class:`~ditbook.runs.RunFolder`."""
    meta = run.read_meta() if run.exists() else {}
    stages = meta.get("stages", {})
    return StageInputs(**{s: run.results_or_none(s) for s in STAGES_READ},
                       status={s: stages.get(s, {}).get("status") for s in STAGES_READ})


def cache_rows(cache: CacheResults | None) -> list[dict]:
    """The cache stage's held-out rows as summary rows (recorded there, not re-measured)."""
    rows = []
    for e in cache.holdout_rows(passed_only=False) if cache else []:
        rows.append({"name": row_name(e.name, e.config), "family": f"cache/{e.name}", "speedup": None,
                     "psnr_min": e.quality.psnr_min if e.quality else None,
                     "ssim_min": e.quality.ssim_min if e.quality else None, "passed": e.passed,
                     "skipped_fraction": e.skipped_fraction, "nproc": 1, "source": "cache stage",
                     "quality_on": "held-out"})
    return rows


def parallel_rows(parallel: ParallelResults | None) -> list[dict]:
    """The parallel stage's plans as summary rows, with their process counts."""
    rows = []
    for p in parallel.plans if parallel else []:
        cache = "+cache" in p.name
        rows.append({"name": p.name, "family": "cache+parallel" if cache else "parallel", "speedup": p.speedup,
                     "seconds": p.seconds, "psnr_min": p.quality.psnr_min if p.quality else None,
                     "ssim_min": p.quality.ssim_min if p.quality else None, "passed": p.passed,
                     "nproc": p.world_size, "cache": cache, "error": p.error, "source": "parallel stage"})
    return rows


# -- configurations ---------------------------------------------------------------------------
def hook_config(spec: dict) -> Config:
    """A configuration from diffusers' own cache hooks, e.g. ``{hook: first_block_cache, threshold: 0.08}``,
    applied with ``transformer.enable_cache``."""
    spec = dict(spec)
    hook = spec.pop("hook")
    name = spec.pop("name", None) or f"{hook}-" + "-".join(f"{v}" for v in spec.values())

    def apply(pipe):
        from diffusers import hooks

        cls_name = "".join(part.capitalize() for part in hook.split("_")) + "Config"
        cfg_cls = getattr(hooks, cls_name, None)
        if cfg_cls is None:
            raise ValueError(f"diffusers.hooks has no {cls_name} (benchmark.configs hook {hook!r})")
        kwargs = dict(spec)
        if "current_timestep_callback" in cfg_cls.__dataclass_fields__:
            kwargs.setdefault("current_timestep_callback", lambda: getattr(pipe, "current_timestep", 0))
        pipe.transformer.enable_cache(cfg_cls(**kwargs))
        return pipe.transformer.disable_cache

    return Config(name=name, family=f"cache/{hook}", apply=apply, params=spec, notes="diffusers hook")


def _recorded_config(ctx, cache: CacheResults, name: str, family: str, config: dict, skipped: float | None,
                     fp8_layers: list | None = None, candidates: int | None = None) -> Config:
    """A cache stage configuration applied through its shipped adapter file (``fp8_layers`` first)."""
    technique = accel.get(name)
    files = {"adapter_file": ctx.run.stage_dir("cache") / cache.adapter_module,
             "arch_file": ctx.run.stage_dir("inspect") / "arch.json", "used": cache.adapter.get("used", "ditbook")}
    steps = ctx.card.generation.steps

    def apply(pipe):
        from ..accel.fp8 import Fp8, Fp8Settings

        quantized = Fp8.apply(pipe, Fp8Settings(layers=list(fp8_layers))) if fp8_layers else None
        try:
            cached = technique.apply_with_file(pipe, technique.settings(**config), steps=steps, **files)
        except BaseException:
            if quantized is not None:
                quantized.undo()
            raise

        def undo() -> None:
            try:
                cached.undo()
            finally:
                if quantized is not None:
                    quantized.undo()
        return undo

    params = dict(config)
    notes = f"tuned by the cache stage; {skipped:.0%} of block evaluations skipped" if skipped is not None else \
        "tuned by the cache stage"
    row = row_name(name, config)
    if fp8_layers:
        params["fp8"] = {"layers": len(fp8_layers), "candidates": candidates, "tuned": True}
        notes += f"; tuned with {len(fp8_layers)} of {candidates} block linears in fp8"
        row += fp8_suffix({"layers": fp8_layers, "candidates": candidates})
    return Config(name=row, family=f"cache/{name}", apply=apply, params=params, notes=notes)


def cache_configs(ctx, cache: CacheResults | None) -> list[Config]:
    """The cache stage's held-out-passing configurations (the chosen first) and its fp8 composition."""
    if cache is None:
        return []
    rows = cache.holdout_rows()
    chosen = cache.chosen
    rows.sort(key=lambda r: not (chosen and r.name == chosen.name and r.config == chosen.config))
    out, seen = [], set()
    for r in rows:
        key = row_name(r.name, r.config)
        if key not in seen:
            seen.add(key)
            out.append(_recorded_config(ctx, cache, r.name, r.family, r.config, r.skipped_fraction))
    f8 = cache.fp8.chosen
    if f8 is not None:  # the composition tuned with fp8 applied, confirmed on held-out seeds
        out.append(_recorded_config(ctx, cache, f8.name, f8.family, f8.config, f8.skipped_fraction, f8.layers,
                                    f8.candidates))
    return out


def discover_configs(ctx: Any, inputs: StageInputs, card_specs: list[dict] | None = None,
                     log=print) -> list[Config]:
    """Configurations to measure: the cache stage's, then the card's hook specs."""
    configs = cache_configs(ctx, inputs.cache) + [hook_config(spec) for spec in card_specs or []]
    names = [c.name for c in configs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"configuration names must be unique; repeated: {sorted(dupes)}")
    return configs


__all__ = ["StageInputs", "read_inputs", "cache_rows", "parallel_rows", "hook_config", "cache_configs",
           "discover_configs", "STAGES_READ"]
