"""The cache stage: an automatic cache-dit adapter, cache strategies verified against the
baseline, threshold tuning, and the adapter as generated code.

Main API (all dataclasses have ``to_dict``):

* ``build_cache_adapter(pipe, report, model) -> CacheAdapter`` (``adapter``): block lists,
  forward patterns, separate-CFG flag and, when blocks are called with keywords cache-dit cannot
  route or the loop does work per block, a generated ``PatchFunctor`` that folds the loop body
  into per-instance block wrappers (``loopfold``). The adapter *is* a plain module file
  (``adapter_source``: registration function, patch functor class, the folded loop as ordinary
  ``def``s), written to ``cache/adapter_<model>.py`` of the run folder first and imported from
  that file (``adapter.load_adapter_module``): every strategy the stage verifies runs through it,
  and ``upstream`` ships the same text; ``adapter.info`` says what was decided and where it
  differs from cache-dit's own registration.
* ``strategies``: registry by name; one file + one config dataclass per strategy:
  ``dbcache``, ``dbcache_taylorseer``, ``scm`` (cache-dit), ``diffusers_fbc``,
  ``diffusers_magcache``, ``diffusers_taylorseer``, ``diffusers_pab``, ``diffusers_fastercache``
  (diffusers hooks, on any model via run-time block registration), ``teacache_fitted`` (step-level,
  rescale polynomial fitted on this model). ``accel.get(name).apply(pipe, settings, adapter=adapter)``
  returns an undo callable.
* ``verify.evaluate(...) -> StrategyResult``: quality (``bench.metrics.compare_sets``), the
  fraction of block/attention evaluations really skipped (``counting``), cached steps;
  ``verify.noise_floor``; ``verify.disabled_check`` (caching off must reproduce the baseline).
* ``CacheSession`` (``session``): the stage's steps, used by ``notebooks/03_cache.ipynb``.
* ``configs_from_results(results, run_dir) -> [CacheConfig]``: for the benchmark stage, the
  tuned configurations again, each with ``name``, ``family``, ``config`` and
  ``apply(pipe) -> undo``.

``cache/results.json`` holds: ``strategies`` (list of {name, family, config, quality (SetQuality
dict), skipped_fraction, attention_skipped_fraction, cached_steps, passed, split
("calibration"/"holdout"/...), error}), ``chosen`` ({name, family, config} or null),
``chosen_detail`` (the chosen one's ``skipped_fraction``, ``holdout_quality`` and
``holdout_images``: {folder, baseline, keys, worst} — its held-out images and their uncached
references saved under ``cache/images/holdout/``, ``worst`` the key of the held-out worst PSNR),
``frontier`` / ``frontier_holdout`` (compute saved vs worst PSNR, Pareto set), ``noise_floor``,
``adapter_checks`` (caching disabled reproduces the baseline), ``adapter`` (AdapterInfo),
``adapter_module`` (relative path of the generated module), ``calibration``,
``passing_at_40pct``, ``reproduction`` (the generated module rerun in a fresh process),
``fp8`` (card ``cache.fp8``: the chosen strategy tuned again with block linears in fp8,
``fp8_tune``; ``chosen`` the composition confirmed on held-out seeds, with its quantized
``layers``; or ``ran`` false with the reason), ``refused`` (null, or why no cache strategy can be applied safely: the stage still passes and
the benchmark runs without cache configurations), ``adapter_fallback`` (why cache-dit's
registered adapter was replaced by ditbook's: it failed the caching-off check).

The caching-off check is a hard gate: a strategy that runs with caching off but does not
reproduce the baseline stops the stage (``stage.AdapterCheckFailed``). The probe ``ditbook.coverage`` (not part of this stage) runs the
same checks on a tiny instance of every transformer class diffusers exports
(``benchmarks/coverage.py`` -> ``docs/coverage.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..adapter.build import AdapterInfo, CacheAdapter, build_cache_adapter  # noqa: F401


@dataclass
class CacheConfig:
    """One tuned configuration, ready to apply to a pipeline of the same model."""

    name: str
    family: str
    config: dict
    skipped_fraction: float | None = None
    split: str = "holdout"
    _module_path: Path | None = field(default=None, repr=False)
    _arch_path: Path | None = field(default=None, repr=False)
    _used: str = field(default="ditbook", repr=False)
    fp8: dict | None = None  # the fp8 composition (``fp8_tune``): {layers, candidates}; None: no fp8

    def apply(self, pipe, steps: int | None = None) -> Callable[[], None]:
        """Apply to ``pipe`` through the run's generated adapter (with ``fp8``: its layers in fp8
        first); returns the undo callable."""
        from ..arch.report import ArchReport
        from .. import accel
        from ..adapter.build import load_adapter_file
        from .fp8_tune import torchao_fp8

        module = load_adapter_file(self._module_path, pipe.transformer)
        adapter = CacheAdapter.from_module(pipe, ArchReport.load(self._arch_path), module, self._used)
        strat = accel.get(self.name)
        undo_fp8 = torchao_fp8(pipe.transformer, self.fp8["layers"]) if self.fp8 else None
        try:
            undo = strat.apply(pipe, strat.settings(**self.config), adapter=adapter, steps=steps)
        except BaseException:
            if undo_fp8 is not None:
                undo_fp8()
            raise
        if undo_fp8 is None:
            return undo

        def undo_both() -> None:
            try:
                if undo is not None:
                    undo()
            finally:
                undo_fp8()
        return undo_both

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "config": self.config,
                "skipped_fraction": self.skipped_fraction, "split": self.split}


def configs_from_results(results: dict | str | Path, run_dir: str | Path | None = None,
                         only_passed: bool = True) -> list[CacheConfig]:
    """The configurations of a cache stage's ``results.json`` (a dict or its path): the chosen
    one first, then every held-out-confirmed one (``only_passed``) or every one tried."""
    if not isinstance(results, dict):
        path = Path(results)
        run_dir = run_dir or path.parent.parent
        results = json.loads(path.read_text())
    run_dir = Path(run_dir) if run_dir else None
    module = run_dir / "cache" / results["adapter_module"] if run_dir else None
    arch = run_dir / "inspect" / "arch.json" if run_dir else None
    used = (results.get("adapter") or {}).get("used", "ditbook")
    rows = [r for r in results.get("strategies", []) if r.get("split") == "holdout" and (r["passed"] or not only_passed)]
    if not only_passed:
        rows += [r for r in results.get("strategies", []) if r.get("split") == "calibration"]
    out, seen = [], set()
    chosen = results.get("chosen")
    ordered = ([r for r in rows if chosen and r["name"] == chosen["name"] and r["config"] == chosen["config"]]
               + rows)
    for r in ordered:
        key = (r["name"], json.dumps(r["config"], sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        out.append(CacheConfig(r["name"], r["family"], r["config"], r.get("skipped_fraction"), r.get("split", ""),
                               module, arch, used))
    f8 = (results.get("fp8") or {}).get("chosen")
    if f8:  # the composition tuned with fp8 applied, confirmed on held-out seeds: timed beside the rest
        out.append(CacheConfig(f8["name"], f8["family"], f8["config"], f8.get("skipped_fraction"), "fp8-holdout",
                               module, arch, used, fp8={"layers": f8["layers"], "candidates": f8["candidates"]}))
    return out


def benchmark_configs(ctx, results: dict) -> list:
    """The benchmark stage's provider (see ``ditbook.benchmark.inputs``): the chosen configuration and
    every held-out-confirmed one, as ``bench.timing.Config`` objects measured side by side with
    the baseline in the benchmark's own process."""
    from ..configuration import Config, fp8_suffix, row_name

    steps = ctx.card.generation.steps
    out = []
    for c in configs_from_results(results, run_dir=ctx.run.path):
        notes = (f"tuned by the cache stage; {c.skipped_fraction:.0%} of block evaluations skipped"
                 if c.skipped_fraction is not None else "tuned by the cache stage")
        params = dict(c.config)
        if c.fp8:
            params["fp8"] = {"layers": len(c.fp8["layers"]), "candidates": c.fp8["candidates"], "tuned": True}
            notes += f"; tuned with {len(c.fp8['layers'])} of {c.fp8['candidates']} block linears in fp8"
        out.append(Config(name=row_name(c.name, c.config) + (fp8_suffix(c.fp8) if c.fp8 else ""), family=f"cache/{c.name}",
                          apply=lambda pipe, c=c: c.apply(pipe, steps=steps), params=params, notes=notes))
    return out


__all__ = ["AdapterInfo", "CacheAdapter", "CacheConfig", "benchmark_configs", "build_cache_adapter",
           "configs_from_results"]
