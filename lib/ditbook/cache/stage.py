"""The cache stage as a sequence of library calls (the notebook calls one per cell).

``CacheSession.open(ctx, report)`` loads the pipeline and builds the adapter; then ``noise_floor``,
``adapter_checks``, ``calibrate``, ``tune``, ``choose``, ``fp8_tune``, ``reproduce`` and
``write_results``. Calibration cases (the card's prompts x seeds) are compared with the intake
baseline, held-out cases with an uncached render made here. Card knobs: the ``cache:`` section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace

from .. import accel
from ..quality import Gates
from ..records import CacheResults, ChosenDetail, CompiledCheck, Fp8Search, Reproduction, decode
from ..adapter.build import CacheAdapter, CacheRefused, build_cache_adapter
from ..adapter.loopfold import FoldError
from .verify import (OrderDependentCache, StrategyRow, check_cases, counted_render, disabled_check,  # noqa: F401
                     evaluate, max_abs, noise_floor, order_check, save_images)
# the 03_cache notebook imports this module (and the display helpers) only: the other names it uses
from ..context import open_stage  # noqa: F401
from ..arch.report import ArchReport  # noqa: F401
from . import plots  # noqa: F401
from .upstream import write_upstream  # noqa: F401


class NoiseFloorError(RuntimeError):
    """The baseline rendered twice does not agree with itself: no quality gate can be read."""


class AdapterCheckFailed(RuntimeError):
    """A strategy with caching turned off does not reproduce the baseline: the cache stage stops."""


def gates_from_card(card) -> Gates:
    return card.cache.gates


def holdout_cases(card) -> tuple[list[str], list[int]]:
    gen = card.generation
    shift = card.cache.holdout_shift
    prompts = list(gen.holdout_prompts or gen.prompts)
    seeds = list(gen.holdout_seeds or [s + shift for s in gen.seeds])
    return prompts, seeds


def pareto(points: list[dict]) -> list[dict]:
    """Configurations no other one beats on both compute saved and worst-image PSNR."""
    pts = [p for p in points if p.get("quality") and p["quality"].get("psnr_min") is not None]
    pts.sort(key=lambda p: (-p["skipped_fraction"], -p["quality"]["psnr_min"]))
    out, best_psnr = [], -1.0
    for p in pts:
        if p["quality"]["psnr_min"] > best_psnr:
            out.append({"name": p["name"], "family": p["family"], "config": p["config"],
                        "skipped_fraction": p["skipped_fraction"], "psnr_min": p["quality"]["psnr_min"],
                        "ssim_min": p["quality"]["ssim_min"], "passed": p["passed"]})
            best_psnr = p["quality"]["psnr_min"]
    return out


@dataclass
class CacheSession:
    ctx: object
    report: object
    pipe: object
    adapter: CacheAdapter
    gates: Gates
    baseline: dict
    baseline_counts: dict | None = None
    holdout_refs: dict | None = None
    holdout_counts: dict | None = None
    floor: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    calibration: dict = field(default_factory=dict)
    results: list = field(default_factory=list)  # StrategyRow (calibration and holdout)
    skipped: dict = field(default_factory=dict)  # strategy -> why it cannot run here
    chosen: ChosenDetail | None = None
    decision: object = None  # ship.decide's answer on held-out seeds (choose)
    chosen_images: dict = field(default_factory=dict)
    reproduction: Reproduction = field(default_factory=lambda: Reproduction(reason="not run"))
    only: list | None = None  # strategy names to run (None: the card's list, else all)
    max_configs: int | None = None  # per strategy (None: the card's, else the whole grid)
    confirm_tries: int | None = None  # held-out confirmations per strategy (None: card.cache.confirm_tries)
    compiled: CompiledCheck = field(default_factory=lambda: CompiledCheck(reason="runtime.compile is off"))
    holdout_kept: dict = field(default_factory=dict)  # {result, images}: the best passing held-out render so far
    refused: str | None = None  # why no cache strategy can be applied safely (the stage still passes)
    fallback: list = field(default_factory=list)  # why cache-dit's registered adapter was replaced by ours
    order: dict = field(default_factory=dict)  # the chosen configuration rendered alone vs after another (order_check)
    fp8: Fp8Search = field(default_factory=Fp8Search)  # the schedule tuned with fp8 applied (fp8_tune)
    _ahead: object = field(default=None, repr=False)  # reproduce's process, started ahead (start_reproduction)

    # -- setup ---------------------------------------------------------------------------
    @classmethod
    def open(cls, ctx, report, pipe=None, only: list | None = None, max_configs: int | None = None,
             **adapter_kwargs) -> "CacheSession":
        pipe = pipe if pipe is not None else ctx.load_pipeline()
        refused = None
        try:
            adapter = build_cache_adapter(pipe, report, ctx.card.name, write_to=ctx.dir, **adapter_kwargs)
        except (CacheRefused, FoldError) as exc:
            refused = f"{type(exc).__name__}: {exc}"
            adapter = CacheAdapter.refused(pipe, report, ctx.card.name, refused, write_to=ctx.dir)
        return cls(ctx=ctx, report=report, pipe=pipe, adapter=adapter, gates=gates_from_card(ctx.card),
                   baseline=ctx.baseline(), only=list(only) if only else None, max_configs=max_configs or None,
                   refused=refused)

    @property
    def card(self):
        return self.ctx.card

    def strategy_names(self) -> list[str]:
        wanted = self.only or self.card.cache.strategies or accel.names("cache")
        return [n for n in wanted if n in accel.names("cache")]

    def runnable(self) -> list[str]:
        if self.refused:
            return []
        out = []
        for name in self.strategy_names():
            if name in self.skipped:
                continue
            why = accel.get(name).applicable(self.adapter)
            if why:
                self.skipped[name] = why
            else:
                out.append(name)
        return out

    # -- evidence ------------------------------------------------------------------------
    def noise_floor(self, other_backend: bool = True) -> dict:
        if self.refused:
            self.floor = {"rerun_max_abs": None, "rerun_vs_intake": {"psnr_min": None},
                          "other_backend": "not measured (cache refused)"}
            return self.floor
        self.floor, rerun, self.baseline_counts = noise_floor(self.pipe, self.card, self.adapter, self.baseline,
                                                              self.gates, other_backend=other_backend)
        again = self.floor["rerun_vs_intake"]
        if not again["passed"]:  # the same config run twice must reproduce intake, or no gate means anything
            raise NoiseFloorError(f"noise floor failed: the baseline rendered again here does not match intake's "
                                  f"images ({'; '.join(again['reasons'][:3])}); the model is not deterministic "
                                  f"on this machine or intake's images are stale — rerun intake")
        prompts, seeds = holdout_cases(self.card)
        self.holdout_refs, self.holdout_counts = counted_render(self.pipe, self.card, self.adapter, prompts, seeds)
        return self.floor

    def adapter_checks(self) -> list[dict]:
        """Every runnable strategy with caching turned off must reproduce the baseline (a hard gate,
        ``AdapterCheckFailed``, after falling back from cache-dit's adapter to ditbook's); one that
        cannot run is skipped, named."""
        if self.refused:
            self.checks = []
            return self.checks
        gen = self.card.generation
        tol = self.card.cache.reproduce_tolerance
        prompts, seeds = check_cases(gen.prompts, gen.seeds, self.card.cache.check_cases)

        def run_checks():
            return [disabled_check(self.pipe, self.card, self.adapter, n, self.baseline, self.baseline_counts,
                                   self.gates, prompts, seeds, tol) for n in self.runnable()]

        self.checks = run_checks()
        bad = [c for c in self.checks if c.get("checked") and not c.get("reproduces")]
        if bad and self.adapter.info.used == "cache-dit" and self.adapter.module is not None:
            self.fallback = [f"{c['name']}: {c.get('error') or 'max abs ' + format(c.get('max_abs'), '.3g')}"
                             for c in bad]
            self.adapter.info.used = "ditbook"
            self.adapter.info.differences.append(
                "cache-dit's registered adapter failed the caching-off check (" + "; ".join(self.fallback)
                + "); ditbook's generated adapter is used instead")
            self.checks = run_checks()
        for c in self.checks:
            if c.get("checked") and not c.get("reproduces") and c.get("error"):
                self.skipped[c["name"]] = f"caching-off check could not run: {c['error']}"
        wrong = [c for c in self.checks if c.get("checked") and not c.get("reproduces") and not c.get("error")]
        if wrong:
            raise AdapterCheckFailed(
                "caching turned off does not reproduce the baseline for "
                + ", ".join(f"{c['name']} (max abs {c['max_abs']:.3g} > {tol:g})" for c in wrong)
                + f" with the {self.adapter.info.used} adapter: the adapter changes the model's output, "
                  "so the cache stage stops and no later stage uses it")
        return self.checks

    def calibrate(self) -> dict:
        """Constants each runnable technique measures on this model: ``{technique: {setting: value}}``,
        or ``{technique: {"error": ...}}`` when it failed."""
        self.calibration = {}
        if self.refused:
            return {}
        gen = self.card.generation

        def run(cases: int | None = None) -> None:
            prompts, seeds = check_cases(gen.prompts, gen.seeds, cases)
            counted_render(self.pipe, self.card, self.adapter, prompts, seeds)

        for name in self.runnable():
            technique = accel.get(name)
            if technique.calibrate is None:
                continue
            try:
                self.calibration[name] = technique.calibrate(self.pipe, self.adapter, run, gen.steps)
            except Exception as exc:  # the technique then runs on its defaults; the reason is recorded
                self.calibration[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return self.calibration

    def _calibrated(self, name: str, settings):
        """``settings`` with the values its technique calibrated filled where it leaves them empty."""
        values = {k: v for k, v in self.calibration.get(name, {}).items()
                  if k != "error" and not getattr(settings, k)}
        return replace(settings, **values) if values else settings

    # -- tuning --------------------------------------------------------------------------
    def tune(self, progress=None) -> list[dict]:
        """Search every runnable strategy's grid, each confirmed on the held-out cases."""
        self.confirm_tries = self.confirm_tries or self.card.cache.confirm_tries
        for name in self.runnable():
            self.tune_strategy(name, progress=progress)
        return self.table()

    def tune_strategy(self, name: str, progress=None, split_prefix: str = "", keep: bool = True) -> list:
        """One strategy's grid on the calibration cases, then held-out confirmations from the most
        compute saved down; returns the held-out results. ``keep``: keep the best held-out images."""
        gen = self.card.generation
        limit = self.max_configs or self.card.cache.max_configs
        tries = self.confirm_tries or self.card.cache.confirm_tries
        hp, hs = holdout_cases(self.card)
        strat = accel.get(name)
        grid = strat.grid(self.adapter, gen.steps)
        if limit:
            grid = grid[: int(limit)]
        family, seen, held = [], [], []
        for cfg in grid:
            cfg = self._calibrated(name, cfg)
            if strat.settings_dict(cfg) in seen:
                continue  # the same configuration twice in a grid renders the same images
            seen.append(strat.settings_dict(cfg))
            r = evaluate(self.pipe, self.card, self.adapter, name, cfg, self.baseline, self.baseline_counts,
                         self.gates, gen.prompts, gen.seeds, split=f"{split_prefix}calibration", stop_at_failure=True)
            family.append((r, cfg))
            self.results.append(r)
            if progress:
                progress(r)
            if r.error:
                break
        passing = sorted([(r, c) for r, c in family if r.passed],
                         key=lambda rc: (-rc[0].skipped_fraction, -rc[0].quality.psnr_min))
        tried = set()
        for r, cfg in passing:
            key = round(r.skipped_fraction, 3)
            if key in tried or r.skipped_fraction == 0.0:
                continue  # same savings as one already confirmed or refuted; or no savings at all
            tried.add(key)
            kept: dict = {}
            h = evaluate(self.pipe, self.card, self.adapter, name, cfg, self.holdout_refs, self.holdout_counts,
                         self.gates, hp, hs, split=f"{split_prefix}holdout", keep_images=kept if keep else None,
                         stop_at_failure=True)
            if keep:
                self._keep_holdout(h, kept)
            self.results.append(h)
            held.append(h)
            if progress:
                progress(h)
            if h.passed or len(tried) >= tries:
                break
        return held

    def table(self, split: str | None = None) -> list[dict]:
        rows = []
        for r in self.results:
            if split and r.split != split:
                continue
            q = r.quality
            rows.append({"strategy": r.name, "split": r.split, "config": json.dumps(r.config),
                         "skipped": r.skipped_fraction, "attn skipped": r.attention_skipped_fraction,
                         "cached steps": r.cached_steps, "PSNR min": q and q.psnr_min, "SSIM min": q and q.ssim_min,
                         "worst tile": q and q.worst_tile_psnr, "max abs": q and q.max_abs, "passed": r.passed,
                         "stopped": r.stopped or "", "error": (r.error or "").splitlines()[0] if r.error else ""}
                        | ({"fp8 layers": f"{r.fp8['quantized']} (kept {r.fp8['kept']})"} if r.fp8 else {}))
        return rows

    def frontier(self, split: str = "calibration") -> list[dict]:
        return pareto([r.to_dict() for r in self.results if r.split == split])

    @staticmethod
    def _rank(r) -> tuple:
        """How :meth:`choose` ranks held-out-passing results: most work skipped, then PSNR."""
        return (r.skipped_fraction, r.quality.psnr_min)

    def _keep_holdout(self, result, images: dict) -> None:
        """Keep only the held-out images of the best passing held-out result so far."""
        best = self.holdout_kept.get("result")
        if result.passed and result.quality and (best is None or self._rank(result) > self._rank(best)):
            self.holdout_kept = {"result": result, "images": images}

    def _save_holdout(self, best) -> dict | None:
        """Save the chosen configuration's held-out images and their uncached references for the
        report; ``{folder, baseline, keys, worst}`` or None."""
        if self.holdout_kept.get("result") is not best or not self.holdout_refs:
            return None
        for sub, images in (("chosen", self.holdout_kept["images"]), ("baseline", self.holdout_refs)):
            save_images(self.ctx.dir / "images" / "holdout" / sub, images)
        per = best.quality.per_image if best.quality else {}
        worst = min(per, key=lambda k: per[k].get("psnr", float("inf"))) if per else None
        return {"folder": "images/holdout/chosen", "baseline": "images/holdout/baseline",
                "keys": sorted(self.holdout_kept["images"]), "worst": worst}

    def candidates(self) -> list:
        """Every configuration rendered on held-out seeds as a candidate of the ship rule."""
        from ..ship import Candidate

        return [Candidate(r.name, r.family, r.config, technique=r.name, psnr=r.quality and r.quality.psnr_min,
                          ssim=r.quality and r.quality.ssim_min, n=r.quality and r.quality.n,
                          skipped_fraction=r.skipped_fraction,
                          failed=[f"stopped on held-out seeds: {r.stopped}"] if r.stopped else [])
                for r in self.results if r.split == "holdout" and not r.error]

    def choose(self) -> ChosenDetail | None:
        """The configuration the ship rule keeps before anything is timed, rendered again, with its
        order check (``OrderDependentCache`` stops the stage)."""
        from ..ship import decide

        self.decision = decide(self.candidates(), self.gates, timed=False)
        if self.decision.name is None:
            self.chosen = None
            return None
        c = self.decision.chosen
        best = next(r for r in self.results if r.split == "holdout" and r.passed and r.name == c.name
                    and r.config == c.config)
        self.chosen = ChosenDetail(best.name, best.family, best.config, skipped_fraction=best.skipped_fraction,
                                   holdout_quality=best.quality, holdout_images=self._save_holdout(best))
        gen = self.card.generation
        cfg = accel.get(best.name).settings(**best.config)
        images: dict = {}
        evaluate(self.pipe, self.card, self.adapter, best.name, cfg, self.baseline, self.baseline_counts, self.gates,
                 gen.prompts, gen.seeds, split="chosen", keep_images=images)
        self.order = order_check(self.pipe, self.card, self.adapter, best.name, cfg, images, gen.prompts, gen.seeds)
        self.chosen_images = images
        save_images(self.ctx.dir / "images" / "chosen", images)
        return self.chosen

    def passing_at(self, min_skipped: float = 0.4) -> list[dict]:
        """Strategies whose held-out run passes the gates while skipping at least ``min_skipped``."""
        return [{"name": r.name, "config": r.config, "skipped_fraction": r.skipped_fraction,
                 "psnr_min": r.quality.psnr_min, "ssim_min": r.quality.ssim_min}
                for r in self.results if r.split == "holdout" and r.passed and r.skipped_fraction >= min_skipped]

    def compiled_check(self, settings=None) -> CompiledCheck:
        """The chosen configuration again with the blocks compiled: its images against the uncompiled
        ones (parallel gates), its render time, and the one-time compile cost."""
        import time

        from ..accel.compile import Compile, compile_settings
        from ..quality import compare_sets
        from .verify import render_set

        settings = compile_settings(settings or self.card.runtime.compile or True)
        if not self.chosen:
            self.compiled = CompiledCheck(reason="no configuration passed on held-out cases")
            return self.compiled
        strat = accel.get(self.chosen.name)
        gen = self.card.generation
        render = lambda: render_set(self.pipe, self.card, gen.prompts, gen.seeds)  # noqa: E731
        out: dict = {"ran": True, "name": self.chosen.name, "backend": str(settings.backend)}
        undo = strat.apply(self.pipe, strat.settings(**self.chosen.config), adapter=self.adapter, steps=gen.steps)
        try:
            render()  # warm
            t0 = time.perf_counter()
            eager = render()
            out["eager_s"] = round(time.perf_counter() - t0, 4)
            compiled = Compile.apply(self.pipe, settings, probe=False)
            try:
                record = compiled.record()
                out["method"], out["regions"] = record.method, record.regions
                t0 = time.perf_counter()
                render()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                images = render()
                out["compiled_s"] = round(time.perf_counter() - t0, 4)
            finally:
                compiled.undo()
        except Exception as exc:  # recorded: compiling the chosen configuration is a finding, not a crash
            out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            self.compiled = CompiledCheck(**out)
            return self.compiled
        finally:
            undo()
        out["compile_s"] = round(max(0.0, first - out["compiled_s"]), 4)
        out["speedup"] = round(out["eager_s"] / out["compiled_s"], 4) if out["compiled_s"] > 0 else None
        q = compare_sets(images, eager, self.card.parallel.gates)  # compiling must not change the result
        out["quality"] = {k: q.to_dict()[k] for k in ("psnr_min", "ssim_min", "max_abs", "passed")}
        out["ok"] = bool(q.passed)
        self.compiled = CompiledCheck(**out)
        return self.compiled

    def fp8_tune(self, progress=None, quantize=None) -> Fp8Search:
        """With card ``cache.fp8``: the chosen strategy tuned again in fp8 (:mod:`.fp8_tune`)."""
        from .fp8_tune import fp8_tune

        self.fp8 = fp8_tune(self, progress=progress, quantize=quantize)
        return self.fp8

    # -- the generated module, in a fresh process ------------------------------------------
    def release_pipeline(self) -> None:
        """Let go of the pipeline: :meth:`reproduce`'s fresh process loads its own."""
        import gc

        import torch

        self.pipe = None
        if self.adapter is not None:
            self.adapter.pipe = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def start_reproduction(self) -> None:
        """Start :meth:`reproduce`'s fresh process now, so its imports overlap the stage's work; ended
        when the session goes if never used."""
        import weakref

        from .reproduce import Ahead

        if self.refused or self._ahead is not None:
            return
        source = self.card.resolve_source(self.card.pipeline.source) if self.card.pipeline.source else None
        package = source if source and not source.endswith(".py") else None
        try:
            self._ahead = Ahead(package, env=dict(os.environ), device=self.ctx.placement.device)
        except OSError:  # started when its turn comes instead
            self._ahead = None
            return
        weakref.finalize(self, self._ahead.close)

    def reproduce(self, timeout: float = 600) -> Reproduction:
        """Rerun the chosen configuration from the generated module in a fresh process; compare."""
        ahead, self._ahead = self._ahead, None
        if not self.chosen:
            if ahead is not None:
                ahead.close()
            self.reproduction = Reproduction(reason=f"cache refused: {self.refused}" if self.refused
                                             else "no configuration passed on held-out cases")
            return self.reproduction
        spec = {"card": str(self.card.card_path), "overrides": self.ctx.overrides,
                "adapter_module": str(self.ctx.dir / f"{self.adapter.info.module_name}.py"),
                "arch": str(self.ctx.run.stage_dir("inspect") / "arch.json"),
                "used": self.adapter.info.used, "name": self.chosen.name, "config": self.chosen.config,
                "images": str(self.ctx.dir / "images" / "chosen"), "device": self.ctx.placement.device,
                "dtype": self.ctx.placement.dtype}
        f8 = self.fp8.chosen
        if f8 is not None and f8.images and self.fp8.shipped_quantizer:
            spec["fp8"] = {"name": f8.name, "config": f8.config, "layers": f8.layers,
                           "images": str(self.ctx.dir / f8.images)}
        spec_path = self.ctx.dir / "reproduce.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        if ahead is not None and ahead.proc.poll() is None:
            returncode, stdout, stderr = ahead.run(spec_path, timeout)
        else:
            proc = subprocess.run([sys.executable, "-m", "ditbook.cache.reproduce", str(spec_path)],
                                  capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
            returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if returncode != 0 or not lines:
            self.reproduction = Reproduction(ran=True, ok=False, returncode=returncode, stderr_tail=stderr[-2000:])
        else:
            out = json.loads(lines[-1])
            tol = self.card.cache.reproduce_tolerance
            out.update(ran=True, ok=out["max_abs"] <= tol, tolerance=tol)
            if isinstance(out.get("fp8"), dict):  # the fp8 composition, rerun in the same process
                out["fp8"]["ok"] = out["fp8"].get("max_abs") is not None and out["fp8"]["max_abs"] <= tol
            self.reproduction = decode(Reproduction, out, "cache.reproduction")
        return self.reproduction

    # -- results.json ----------------------------------------------------------------------
    def write_results(self) -> CacheResults:
        res = CacheResults(
            adapter_module=f"{self.adapter.info.module_name}.py", gates=self.gates, refused=self.refused,
            adapter_fallback=self.fallback, adapter=self.adapter.info.to_dict(), noise_floor=self.floor,
            adapter_checks=self.checks, skipped_strategies=self.skipped, calibration=self.calibration,
            strategies=[replace(r, counts={k: v for k, v in r.counts.items() if k != "calls"}) for r in self.results],
            frontier=self.frontier(), frontier_holdout=self.frontier("holdout"), chosen=self.chosen,
            decision=self.decision.to_dict() if self.decision is not None else None,
            order_check=self.order or None,  # the chosen configuration: a case alone vs after another
            reproduction=self.reproduction, compiled=self.compiled,
            fp8=self.fp8 if self.fp8.ran or self.fp8.reason else Fp8Search(
                reason="cache.fp8 is off" if not self.card.cache.fp8 else "not run"))
        self.ctx.write_results(res)
        return res
