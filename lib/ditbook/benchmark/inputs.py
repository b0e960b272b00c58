"""What the benchmark reads from the earlier stages, and the configurations it measures.

The benchmark works with whatever subset of the earlier stages exists; the intake baseline is
the minimum. Keys read (every one optional unless said so):

``intake/results.json`` (required)
    ``images``: rows with ``key``, ``prompt``, ``seed``, ``npy`` (the stored baseline images).

``cache/results.json``
    ``tuned`` — the tuned configurations, else ``strategies`` — every strategy verified (only the
    ``split == "holdout"`` rows when there are any); each a row with ``name``, ``family`` (or
    ``strategy``), ``config`` (or ``params``), ``speedup``, ``quality.psnr_min`` / ``psnr_min`` (or
    ``psnr``), ``quality.ssim_min`` / ``ssim_min`` (or ``ssim``), ``passed``, ``skipped_fraction``. Shown as figures
    *recorded by the cache stage*; the benchmark re-measures a configuration only when the cache
    package hands it over as a :class:`~ditbook.timing.Config` (below).
    ``residual_changes``: ``{series name: [relative change per step, ...]}``.

``parallel/results.json``
    ``plans`` (or ``runs``): rows with ``name`` (or ``plan``), ``nproc`` (or ``world_size``),
    ``speedup`` (or ``seconds`` with ``baseline_seconds``, per row or top level),
    ``quality.psnr_min`` / ``psnr_min`` (or ``psnr``), ``quality.ssim_min`` / ``ssim_min`` (or ``ssim``), ``passed``, ``cache`` (the cache configuration run
    together with the plan, making it ``cache+parallel``), ``error``. Multi-process plans run
    under torchrun in the parallel stage, so their timings are the parallel stage's, measured
    against its own single-process baseline in the same launch.

Configurations measured in this process come from *providers*: a function
``benchmark_configs(ctx, results) -> list[Config]`` defined at the top level of ``ditbook.cache``
or ``ditbook.parallel`` (``results`` is that stage's results.json mapping), and from the card's
``benchmark.configs`` list of diffusers hook specs, e.g.
``{hook: first_block_cache, threshold: 0.08}`` (built here with diffusers' own hooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import cache, parallel
from ..configuration import Config, config_label

STAGES_READ = ("intake", "cache", "parallel")
# the stage packages that hand configurations to the benchmark (``benchmark_configs(ctx, results)``)
PROVIDERS = {"cache": cache, "parallel": parallel}


@dataclass
class StageInputs:
    """The earlier stages' results that exist in a run folder (None where absent)."""

    results: dict[str, dict | None] = field(default_factory=dict)
    status: dict[str, str | None] = field(default_factory=dict)

    def get(self, stage: str) -> dict | None:
        return self.results.get(stage)

    @property
    def present(self) -> list[str]:
        return [s for s, r in self.results.items() if r is not None]

    def rows(self) -> list[dict]:
        return [{"stage": s, "results.json": "present" if self.results.get(s) is not None else "absent",
                 "status": self.status.get(s) or "-"} for s in STAGES_READ]

    def to_dict(self) -> dict:
        return {s: self.results.get(s) is not None for s in STAGES_READ}


def read_inputs(run) -> StageInputs:
    """Read the intake, cache and parallel results of a :class:`~ditbook.runs.RunFolder`."""
    meta = run.read_meta() if run.exists() else {}
    out = StageInputs()
    for stage in STAGES_READ:
        out.results[stage] = run.read_results(stage) if run.has_results(stage) else None
        out.status[stage] = meta.get("stages", {}).get(stage, {}).get("status")
    return out


def _first(row: dict, *keys, default=None):
    for k in keys:
        if row.get(k) is not None:
            return row[k]
    return default


def cache_rows(cache: dict | None) -> list[dict]:
    """The cache stage's configurations as summary rows (recorded there, not re-measured)."""
    if not cache:
        return []
    entries = [e for e in (cache.get("tuned") or cache.get("strategies") or []) if isinstance(e, dict)]
    # the cache stage records each configuration on calibration and on held-out seeds: the
    # held-out rows are the evidence
    held_out = any(e.get("split") == "holdout" for e in entries)
    if held_out:
        entries = [e for e in entries if e.get("split") == "holdout"]
    rows = []
    for e in entries:
        fam = _first(e, "family", "strategy", default="cache")
        q = e.get("quality") or {}
        config = e.get("config") or e.get("params") or {}
        label = config_label(config)
        rows.append({
            "name": str(_first(e, "name", "strategy", default="cache")) + (f"[{label}]" if label else ""),
            "family": fam if str(fam).startswith("cache") else f"cache/{fam}",
            "speedup": _first(e, "speedup"),
            "psnr_min": _first(e, "psnr_min", "psnr", default=q.get("psnr_min")),
            "ssim_min": _first(e, "ssim_min", "ssim", default=q.get("ssim_min")),
            "passed": e.get("passed"), "skipped_fraction": e.get("skipped_fraction"),
            "nproc": 1, "source": "cache stage",
            "quality_on": "held-out" if held_out else "calibration",  # the seeds of psnr_min/ssim_min
        })
    return rows


def parallel_rows(parallel: dict | None) -> list[dict]:
    """The parallel stage's plans as summary rows, with their process counts."""
    if not parallel:
        return []
    entries = parallel.get("plans") or parallel.get("runs") or []
    base_top = parallel.get("baseline_seconds")
    rows = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        speedup = e.get("speedup")
        secs, base = e.get("seconds"), e.get("baseline_seconds", base_top)
        if speedup is None and secs and base:
            speedup = base / secs
        # plan names mark cache + CP with a "+cache" suffix (ditbook.parallel.plans)
        cache = e.get("cache") or ("+cache" in str(_first(e, "name", "plan", default="")))
        q = e.get("quality") or {}
        rows.append({
            "name": str(_first(e, "name", "plan", default="plan")),
            "family": "cache+parallel" if cache else "parallel",
            "speedup": speedup, "seconds": secs,
            "psnr_min": _first(e, "psnr_min", "psnr", default=q.get("psnr_min")),
            "ssim_min": _first(e, "ssim_min", "ssim", default=q.get("ssim_min")),
            "passed": e.get("passed"), "nproc": int(_first(e, "nproc", "world_size", default=1)),
            "cache": cache, "error": e.get("error"), "source": "parallel stage",
        })
    return rows


def residual_series(cache: dict | None) -> dict[str, list[float]]:
    if not cache:
        return {}
    series = cache.get("residual_changes") or {}
    return {str(k): [float(x) for x in v] for k, v in series.items() if isinstance(v, list)}


# -- configurations ---------------------------------------------------------------------
def hook_config(spec: dict) -> Config:
    """A configuration from diffusers' own cache hooks, e.g. ``{hook: first_block_cache,
    threshold: 0.08}`` or ``{hook: pyramid_attention_broadcast, spatial_attention_block_skip_range: 2}``.
    Applied with ``transformer.enable_cache`` and undone with ``disable_cache``."""
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


def discover_configs(ctx: Any, inputs: StageInputs, card_specs: list[dict] | None = None,
                     log=print) -> list[Config]:
    """Configurations to measure: from the cache/parallel providers, then the card's hook specs."""
    configs: list[Config] = []
    for stage, module in PROVIDERS.items():
        provider = getattr(module, "benchmark_configs", None)
        if provider is None:
            continue
        results = inputs.get(stage)
        if results is None:
            continue
        configs += list(provider(ctx, results))
    for spec in card_specs or []:
        configs.append(hook_config(spec))
    names = [c.name for c in configs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"configuration names must be unique; repeated: {sorted(dupes)}")
    return configs


__all__ = ["StageInputs", "read_inputs", "cache_rows", "parallel_rows", "residual_series", "hook_config",
           "discover_configs", "STAGES_READ"]
