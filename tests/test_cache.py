"""The cache stage: automatic adapter, verification, tuning, generated code, the notebook.

Tiny models only (built here, saved with ``save_pretrained``): the third-party-style GQA model
of ``test_cache_models`` (keyword-called blocks, work in the loop), diffusers' FluxPipeline from
the zoo, every zoo model when the zoo provides it, and the shipped reference model when present.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

from test_cache_models import build_tiny  # noqa: E402


def tiny_card(tmp_path: Path, steps: int = 8, seeds=(0, 1), prompts=("a red square", "a blue circle"), **cache) -> Path:
    build_tiny(tmp_path / "model")
    card = tmp_path / "tiny.yaml"
    data = {"name": "tiny-gqa", "path": "model",
            "pipeline": {"class": "TinyPipeline", "source": str(TESTS / "test_cache_models.py")},
            "transformer": {"class": "TinyGQATransformer", "source": str(TESTS / "test_cache_models.py")},
            "generation": {"prompts": list(prompts), "seeds": list(seeds), "height": 16, "width": 16, "steps": steps,
                           "holdout_seeds": [7]},
            "runtime": {"device": "cpu", "dtype": "float32"}}
    if cache:
        data["cache"] = cache
    card.write_text(yaml.safe_dump(data, sort_keys=False))
    return card


def prepared_run(card_path: Path, outputs: Path, run_id: str = "r1"):
    """A run folder with intake and inspect done and the plan approved (what 03_cache needs)."""
    from ditbook.inspect.stage import run_inspection, save_inspection
    from ditbook.approval import approve
    from ditbook.intake.stage import run_intake
    from ditbook.context import open_stage

    ctx = open_stage(str(card_path), None, "intake", {}, outputs_root=outputs)
    _, pipe = run_intake(ctx)
    result = run_inspection(pipe, ctx.card, steps=2)
    ctx.run.write_results("inspect", save_inspection(ctx.run.stage_dir("inspect"), result))
    approve(ctx.card, ctx.run.stage_dir("inspect") / "plan.json")
    return ctx.run, pipe, result.report


def session_for(card_path, run, pipe, report, **kw):
    from ditbook.cache.stage import CacheSession
    from ditbook.context import open_stage

    ctx = open_stage(str(card_path), str(run.path), "cache", {})
    ctx.require_approved_plan()
    return CacheSession.open(ctx, report, pipe=pipe, **kw)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinygqa")
    card = tiny_card(tmp)
    run, pipe, report = prepared_run(card, tmp / "outputs")
    return card, run, pipe, report


def test_third_party_adapter_folds_loop_and_reproduces_baseline(tiny_run):
    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report)
    info = s.adapter.info
    assert info.patch_functor == "TinyGQATransformerPatchFunctor"
    assert [(p.path, p.pattern, p.folded) for p in info.block_lists] == [("blocks", "Pattern_0", True)]
    assert any("gates" in r for r in info.functor_reasons)  # the loop's extra work is why
    src = (s.ctx.dir / f"{info.module_name}.py").read_text()
    assert "class TinyGQATransformerPatchFunctor(PatchFunctor)" in src and "x = x * owner.gates[i]" in src
    floor = s.noise_floor()
    assert floor["rerun_max_abs"] <= 1e-6
    checks = {c["name"]: c for c in s.adapter_checks()}
    assert {"dbcache", "diffusers_fbc", "teacache_fitted", "scm"} <= set(checks)
    for name, c in checks.items():
        assert c["reproduces"] and c["max_abs"] <= 1e-5, (name, c)
    # PAB hooks the attention modules the inspection finds, of any class (here TinyGQAAttention)
    assert "diffusers_pab" in checks and "diffusers_pab" not in s.skipped
    # the transformer is back to its own forward and blocks after all of it
    assert "forward" not in pipe.transformer.__dict__
    assert type(pipe.transformer.blocks[0]).__name__ == "TinyGQABlock"


def test_strategies_skip_blocks_with_quality_and_wrong_adapter_is_caught(tiny_run):
    from ditbook import accel
    from ditbook.cache.verify import evaluate

    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report)
    s.noise_floor()
    gen = s.card.generation
    cfg = accel.get("dbcache").Settings(Fn=1, threshold=0.08, max_warmup_steps=1)
    good = evaluate(pipe, s.card, s.adapter, "dbcache", cfg, s.baseline, s.baseline_counts, s.gates,
                    gen.prompts, gen.seeds)
    assert good.error is None and good.passed and good.skipped_fraction >= 0.4 and good.cached_steps > 0
    assert good.quality.psnr_min > 30 and good.quality.ssim_min > 0.9

    # a deliberately wrong adapter: the loop body returns (x, context) but the adapter declares
    # Pattern_1 (encoder first): verification must fail it, even with caching turned off
    from ditbook.adapter.build import build_cache_adapter

    wrong = build_cache_adapter(pipe, report, "tiny-wrong", pattern_overrides={"blocks": "Pattern_1"})
    for c in (accel.get("dbcache").disabled(wrong, gen.steps), cfg):
        bad = evaluate(pipe, s.card, wrong, "dbcache", c, s.baseline, s.baseline_counts, s.gates, gen.prompts,
                       gen.seeds)
        assert not bad.passed  # caught: it either breaks the run or the images
        assert bad.error or bad.quality.psnr_min < 30, bad
    # and the pipeline is intact afterwards
    again = evaluate(pipe, s.card, s.adapter, "dbcache", accel.get("dbcache").disabled(s.adapter, gen.steps),
                     s.baseline, s.baseline_counts, s.gates, gen.prompts, gen.seeds)
    assert again.passed and again.quality.max_abs <= 1e-5


def test_search_rows_stop_rendering_at_the_first_failing_case(tiny_run):
    """The search stops a configuration's renders at the first case that fails a gate (every gate
    holds per image, so the verdict is already known), and says where; a passing configuration
    still renders every case, and the checks that need every image are unchanged."""
    from ditbook import accel
    from ditbook.cache.verify import evaluate
    from ditbook.quality import Gates
    from ditbook.render import cases

    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report)
    s.noise_floor()
    gen = s.card.generation
    total = len(gen.prompts) * len(gen.seeds)
    assert total >= 2
    harsh = accel.get("dbcache").Settings(Fn=1, threshold=5.0, max_warmup_steps=0)
    strict = Gates(psnr=90.0)  # a skipping configuration fails these on some case
    full = evaluate(pipe, s.card, s.adapter, "dbcache", harsh, s.baseline, s.baseline_counts, strict,
                    gen.prompts, gen.seeds)
    assert full.stopped is None and full.quality.n == total and not full.passed
    order = [key for key, _, _ in cases(s.card, gen.prompts, gen.seeds)]
    first = next(i for i, k in enumerate(order) if full.quality.per_image[k]["reasons"])
    short = evaluate(pipe, s.card, s.adapter, "dbcache", harsh, s.baseline, s.baseline_counts, strict,
                     gen.prompts, gen.seeds, stop_at_failure=True)
    assert not short.passed and short.quality.n == first + 1
    if first + 1 < total:
        assert short.stopped == f"stopped at {order[first]}, which failed the gates ({first + 1} of {total} cases rendered)"
        assert short.quality.psnr_min >= full.quality.psnr_min  # the worst of fewer cases
        assert short.counts["baseline_block_evals"] < s.baseline_counts["block_evals"]
    good = accel.get("dbcache").Settings(Fn=1, threshold=0.08, max_warmup_steps=1)
    kept = evaluate(pipe, s.card, s.adapter, "dbcache", good, s.baseline, s.baseline_counts, s.gates,
                    gen.prompts, gen.seeds, stop_at_failure=True)
    assert kept.passed and kept.stopped is None and kept.quality.n == total


def test_release_pipeline_lets_the_model_go_before_the_fresh_process_loads_its_own(tiny_run):
    """Before the reproduction's fresh process loads a second copy, the stage drops its own: no
    reference to the transformer is left in the session (at a 12B model the two copies together
    needed twice its memory on the device)."""
    import gc
    import weakref

    card, run, _, report = tiny_run
    s = session_for(card, run, None, report, only=["dbcache"])
    ref = weakref.ref(s.pipe.transformer)
    s.release_pipeline()
    gc.collect()
    assert s.pipe is None and ref() is None
    assert s.write_results().adapter["transformer_class"]  # what follows reads no pipeline


def test_teacache_polynomial_is_fitted_on_the_model(tiny_run):
    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report, only=["teacache_fitted"])
    s.noise_floor()
    cal = s.calibrate()
    coeffs = cal["teacache_fitted"]["coefficients"]
    assert len(coeffs) == 3 and coeffs != [1.0, 0.0]
    from ditbook.accel.teacache_fitted import TeaCacheFitted
    from ditbook.cache.verify import counted_render

    gen = s.card.generation
    again, records = TeaCacheFitted.fit(s.adapter, lambda: counted_render(s.pipe, s.card, s.adapter, gen.prompts,
                                                                          gen.seeds))
    assert again == coeffs  # the stage's calibration is this fit on the calibration cases
    steps = s.card.generation.steps
    assert len(records) == len(s.card.generation.prompts) * len(s.card.generation.seeds) * (steps - 1)
    x = np.array([r["x"] for r in records])
    y = np.array([r["y"] for r in records])
    fit = np.polyval(coeffs, x)
    # the polynomial maps this model's input change onto its residual change (within 20 %)
    assert np.mean(np.abs(fit - y)) / np.mean(y) < 0.2


def test_stage_notebook_end_to_end(tmp_path):
    """papermill runs 03_cache on the tiny third-party model: results.json per the contract, the
    generated module rerun in a fresh process reproduces the verified images, and the benchmark
    stage's entry point re-applies the tuned configuration."""
    import papermill as pm

    card = tiny_card(tmp_path, steps=6, seeds=(0,), prompts=("a red square",))
    run, pipe, report = prepared_run(card, tmp_path / "outputs")
    out = run.path / "03_cache.ipynb"
    pm.execute_notebook(str(ROOT / "notebooks" / "03_cache.ipynb"), str(out), cwd=str(run.path), progress_bar=False,
                        parameters={"CARD": str(card), "RUN_DIR": str(run.path), "OVERRIDES": {
                            "cache.strategies": ["dbcache", "teacache_fitted", "diffusers_fbc"], "cache.max_configs": 3}})
    res = json.loads((run.path / "cache" / "results.json").read_text())
    for key in ("strategies", "chosen", "frontier", "noise_floor", "adapter_module"):
        assert key in res
    row = res["strategies"][0]
    assert {"name", "family", "config", "quality", "skipped_fraction", "cached_steps", "passed"} <= set(row)
    assert (run.path / "cache" / res["adapter_module"]).is_file()
    assert res["chosen"] is not None and {"name", "family", "config"} <= set(res["chosen"])
    assert res["reproduction"]["ok"] and res["reproduction"]["max_abs"] <= 1e-5
    for png in ("tradeoff.png", "grid_chosen.png"):
        assert (run.path / "cache" / png).is_file()

    from types import SimpleNamespace

    from ditbook.benchmark.inputs import cache_configs
    from ditbook.card import load_card
    from ditbook.configuration import row_name
    from ditbook.render import render_all

    c = load_card(card)
    configs = cache_configs(SimpleNamespace(run=run, card=c), run.read_results("cache"))
    assert configs and configs[0].name == row_name(res["chosen"]["name"], res["chosen"]["config"])
    chosen_imgs = {p.stem: np.load(p) for p in (run.path / "cache" / "images" / "chosen").glob("*.npy")}
    undo = configs[0].apply(pipe)
    try:
        imgs = {r.key: r.image for r in render_all(pipe, c)}
    finally:
        undo()
    assert max(float(np.abs(imgs[k] - chosen_imgs[k]).max()) for k in chosen_imgs) <= 1e-5


def _zoo_names():
    from ditbook import zoo

    return zoo.list_models()


@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_adapter_with_caching_disabled_reproduces_baseline(name, tmp_path):
    """Every zoo model: the automatic adapter runs and, with caching off by its threshold,
    reproduces the baseline in fp32 (max abs <= 1e-5); ours and cache-dit's registration both."""
    import importlib

    from ditbook import zoo
    from ditbook.inspect.stage import run_inspection
    from ditbook.quality import Gates
    from ditbook.adapter.build import build_cache_adapter
    from ditbook.cache.verify import counted_render, disabled_check
    from ditbook.card import _from_mapping

    # the zoo has landed: a model that no longer builds is a failure, not a skip
    module = importlib.import_module(f"ditbook.zoo.{zoo.configs[name].module}")
    pipe = module.build_pipeline(seed=0)  # in memory: the same model the zoo saves
    for component in pipe.components.values():
        if hasattr(component, "eval"):
            component.eval()  # built modules start in training mode (dropout)
    pipe.set_progress_bar_config(disable=True)
    data = zoo.card_data(name, str(tmp_path))
    data["runtime"] = {"device": "cpu", "dtype": "float32"}
    data["generation"].update(seeds=[0], steps=3, prompts=data["generation"]["prompts"][:1])
    c = _from_mapping(data, tmp_path / f"{name}.yaml")
    report = run_inspection(pipe, c, steps=2).report
    gen = c.generation
    # cache-dit's own registration too, for the reference model's family (FluxPipeline)
    for prefer in ((False, True) if name == "flux" else (False,)):
        adapter = build_cache_adapter(pipe, report, c.name, prefer_registered=prefer)
        ref, counts = counted_render(pipe, c, adapter, gen.prompts, gen.seeds)
        assert counts["block_evals"] > 0
        check = disabled_check(pipe, c, adapter, "dbcache", ref, counts, Gates(), gen.prompts, gen.seeds)
        assert check.get("reproduces") and check["max_abs"] <= 1e-5, (name, prefer, check, adapter.info.to_dict())
        if not prefer:  # diffusers' FirstBlockCache through our block registration: exact, or the
            # error the stage reports -- never silently off. SD3's last block returns no encoder
            # states, which diffusers' hook subtracts from: the one error expected in the zoo
            fbc = disabled_check(pipe, c, adapter, "diffusers_fbc", ref, counts, Gates(), gen.prompts, gen.seeds)
            if name == "sd3":
                assert not fbc.get("reproduces") and "unsupported operand type(s) for -: 'NoneType' and 'Tensor'" \
                    in str(fbc.get("error")), (name, fbc)
            else:
                assert fbc.get("reproduces") and not fbc.get("error"), (name, fbc)


def test_reference_model_skips_40pct_with_quality_on_holdout(tmp_path):
    """On the shipped reference model, at least one strategy skips >= 40% of block evaluations
    with PSNR >= 30 dB and SSIM >= 0.90 on held-out seeds."""
    ref_card = ROOT / "models" / "reference.yaml"
    if not ref_card.is_file():
        pytest.skip("reference model not landed (models/reference.yaml)")
    data = yaml.safe_load(ref_card.read_text())
    path = Path(data["path"]) if Path(data["path"]).is_absolute() else ref_card.parent / data["path"]
    if not path.is_dir():
        pytest.skip(f"reference model folder {path} not built")
    data["path"] = str(path)
    data.pop("approved_plan", None)
    data["runtime"] = {"device": "cpu", "dtype": "float32"}
    # one seed per prompt for calibration, another for held-out (the stage itself uses the card's)
    data["generation"].update(seeds=[0], holdout_seeds=[1000], prompts=data["generation"]["prompts"][:2])
    card = tmp_path / "reference.yaml"
    card.write_text(yaml.safe_dump(data, sort_keys=False))
    run, pipe, report = prepared_run(card, tmp_path / "outputs")
    s = session_for(card, run, pipe, report, only=["dbcache_taylorseer", "teacache_fitted"], max_configs=2)
    s.confirm_tries = 2
    s.noise_floor(other_backend=False)
    s.calibrate()
    s.tune()
    hits = s.passing_at(0.4)
    assert hits, s.table("holdout")
    assert all(h["psnr_min"] >= 30 and h["ssim_min"] >= 0.9 and h["skipped_fraction"] >= 0.4 for h in hits)
    chosen = s.choose()
    assert chosen and chosen.skipped_fraction >= 0.4
    # the held-out images behind the figure are saved: the chosen configuration's and the uncached
    # references, and the worst of them is the one the held-out worst PSNR is taken from
    saved = chosen.holdout_images
    per = chosen.holdout_quality.per_image
    assert saved["keys"] == sorted(per) and per[saved["worst"]]["psnr"] == pytest.approx(chosen.holdout_quality.psnr_min, abs=1e-4)
    for sub in (saved["folder"], saved["baseline"]):
        for key in saved["keys"]:
            assert (s.ctx.dir / sub / f"{key}.npy").is_file(), (sub, key)
    worst = np.load(s.ctx.dir / saved["folder"] / f"{saved['worst']}.npy")
    ref = np.load(s.ctx.dir / saved["baseline"] / f"{saved['worst']}.npy")
    from ditbook.quality import psnr

    assert abs(psnr(worst, ref) - chosen.holdout_quality.psnr_min) < 1e-3


# --- issue 13: the caching-off check is a hard gate; a refusal lets the run go on -----------------

def _dropped_step_adapter(pipe, report):
    """A deliberately wrong adapter: the folded loop body hands every block the first block's
    embedding (``owner.block_embed[0]`` for ``[i]``): it runs, and silently changes the output."""
    from ditbook.adapter.build import CacheAdapter, build_cache_adapter, import_adapter_module

    good = build_cache_adapter(pipe, report, "tiny-dropped-step")
    assert "owner.block_embed[i]" in good.source
    source = good.source.replace("owner.block_embed[i]", "owner.block_embed[0]")
    module = import_adapter_module(source, None, "tiny_dropped_step", transformer=pipe.transformer)
    return CacheAdapter(pipe, report, good.info, module, source)


def test_wrong_adapter_stops_the_cache_stage(tiny_run):
    from ditbook.cache.stage import AdapterCheckFailed

    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report, only=["dbcache"])
    s.noise_floor(other_backend=False)
    first = s.adapter_checks()[0]
    assert first["reproduces"]  # the generated adapter passes the gate
    # on the card's cache.check_cases (default 2) of its cases, not every one
    assert first["cases"] == min(s.card.cache.check_cases, len(s.baseline)) < len(s.baseline)
    s.adapter = _dropped_step_adapter(pipe, report)
    with pytest.raises(AdapterCheckFailed, match="does not reproduce the baseline"):
        s.adapter_checks()
    assert s.results == []  # nothing was tuned on it


def test_refused_adapter_lets_the_run_go_on(tiny_run, monkeypatch):
    from ditbook.benchmark.inputs import cache_configs
    from ditbook.cache import stage
    from ditbook.adapter.build import CacheRefused

    card, run, pipe, report = tiny_run

    def refuse(*a, **k):
        raise CacheRefused("inspection found no block list in TinyGQATransformer")

    monkeypatch.setattr(stage, "build_cache_adapter", refuse)
    s = session_for(card, run, pipe, report)
    assert s.refused and "no block list" in s.refused
    # every step the notebook runs, in its order
    floor = s.noise_floor()
    assert floor["rerun_vs_intake"]["psnr_min"] is None
    assert s.adapter_checks() == [] and s.calibrate() == {} and s.tune() == [] and s.choose() is None
    assert (s.ctx.dir / f"{s.adapter.info.module_name}.py").read_text().startswith('"""No cache-dit adapter')
    assert not s.reproduce().ran
    res = s.write_results()
    assert "no block list" in res.refused and res.strategies == [] and res.chosen is None
    assert cache_configs(s.ctx, res) == []  # the benchmark runs without cache configurations


def test_failed_fold_leaves_the_instance_as_it_was(tiny_run):
    import torch

    card, run, pipe, report = tiny_run
    from ditbook.adapter.build import build_cache_adapter

    adapter = build_cache_adapter(pipe, report, "tiny-atomic")
    t = pipe.transformer
    blocks = list(t.blocks)
    methods = dict(adapter.module.FOLDED_METHODS)
    adapter.module.FOLDED_METHODS["forward"] = None  # cannot be bound, after nothing changed
    with pytest.raises(TypeError):
        adapter.patch()
    assert list(t.blocks) == blocks and "forward" not in t.__dict__ and not getattr(t, "_ditbook_folded", False)
    adapter.module.FOLDED_METHODS.update(methods)
    path = adapter.info.block_lists[0].path
    body = adapter.module.FOLDED[path]

    class Boom(body):  # a wrapper that fails on the third block: half the list would be swapped
        def __init__(self, block, index, owner, originals=None):
            if index == 2:
                raise RuntimeError("boom")
            super().__init__(block, index, owner, originals)

    adapter.module.FOLDED[path] = Boom
    with pytest.raises(RuntimeError, match="boom"):
        adapter.patch()
    assert list(t.blocks) == blocks and "forward" not in t.__dict__
    x = torch.randn(1, 4, 8, 8)
    assert t is pipe.transformer and all(type(b).__name__ == type(blocks[0]).__name__ for b in t.blocks)
    del x


def test_generated_adapter_import_leaves_no_temp_folder():
    import tempfile

    from ditbook.adapter.build import import_adapter_module

    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("ditbook_adapter_*"))
    mod = import_adapter_module("X = 41 + 1\n", None, "probe_no_temp")
    assert mod.X == 42
    assert set(tmp.glob("ditbook_adapter_*")) == before


def test_prefix_only_cache_dit_registration_falls_back_to_ours(tiny_run):
    # cache-dit matches registrations by pipeline-name prefix: a pipeline that merely starts with
    # "Flux" gets cache-dit's Flux factory, which refuses this transformer; ditbook's adapter is used
    from ditbook.adapter.build import build_cache_adapter, cache_dit_adapter_builds

    card, run, pipe, report = tiny_run
    original = type(pipe)
    pipe.__class__ = type("FluxLikeTinyPipeline", (original,), {})
    try:
        adapter = build_cache_adapter(pipe, report, "tiny-prefix")
        builds = cache_dit_adapter_builds(pipe)  # what the parallel worker's +cache plans ask
    finally:
        pipe.__class__ = original
    assert builds is False
    assert adapter.info.cache_dit_registered == "Flux"
    assert adapter.info.used == "ditbook"
    assert any("could not be built" in d for d in adapter.info.differences)


def test_fold_skipped_by_a_foreign_patched_mark_is_an_error(tiny_run):
    # cache-dit's PatchFunctor.apply skips an instance another functor marked _is_patched; the
    # blocks would then not be the loop bodies the declared patterns describe
    from ditbook.adapter.loopfold import FoldError

    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report)
    assert s.adapter.info.patch_functor
    pipe.transformer._is_patched = True
    try:
        with pytest.raises(FoldError, match="_is_patched"):
            s.adapter.patch()
        assert "forward" not in pipe.transformer.__dict__
    finally:
        pipe.transformer.__dict__.pop("_is_patched", None)
    s.adapter.patch()
    assert pipe.transformer._ditbook_folded
    s.adapter.unpatch()
    assert "forward" not in pipe.transformer.__dict__


@pytest.mark.parametrize("name", ["diffusers_fbc", "diffusers_magcache"])
def test_diffusers_block_strategies_leave_diffusers_registry_as_it_was(tiny_run, name):
    # the block classes are registered in diffusers' TransformerBlockRegistry while the strategy is
    # on (hooks.set_item) and taken out by its undo: the registry holds the same entries after
    from diffusers.hooks._helpers import TransformerBlockRegistry

    from ditbook import accel
    from ditbook.adapter.build import build_cache_adapter

    card, run, pipe, report = tiny_run
    adapter = build_cache_adapter(pipe, report, "tiny-registry")
    strat = accel.get(name)
    assert strat.applicable(adapter) is None
    TransformerBlockRegistry._register()  # diffusers' own lazy fill, what any apply_* call does first
    before = dict(TransformerBlockRegistry._registry)
    undo = strat.apply(pipe, strat.settings(), adapter=adapter, steps=8)
    try:  # the cached blocks' class (the folded loop body here) is registered while the strategy is on
        block_cls = type(adapter.block_lists()[0][1][0])
        assert block_cls in TransformerBlockRegistry._registry and block_cls not in before
    finally:
        undo()
    after = TransformerBlockRegistry._registry
    assert list(after) == list(before) and all(after[k] is v for k, v in before.items())


def test_importing_the_adapter_file_leaves_cache_dits_table_untouched(tmp_path):
    # the emitted file registers itself with cache-dit when imported (a maintainer's merged file
    # does); the stage's import runs it against a copy: the process-wide table is never written
    from cache_dit import BlockAdapterRegister

    from ditbook import hooks
    from ditbook.adapter.build import load_adapter_module

    class Watched(dict):
        writes: list = []

        def __setitem__(self, key, value):
            self.writes.append(key)
            super().__setitem__(key, value)

        def clear(self):
            self.writes.append("clear")
            super().clear()

        def update(self, *a, **kw):
            self.writes.append("update")
            super().update(*a, **kw)

    file = tmp_path / "adapter_probe.py"
    file.write_text("from cache_dit import BlockAdapterRegister\n\n\n"
                    "@BlockAdapterRegister.register('ProbeRegisteredPipeline')\n"
                    "def probe_adapter(pipe, **kwargs):\n    return None\n")
    table = Watched(BlockAdapterRegister._adapters)
    with hooks.swap_attribute(BlockAdapterRegister, "_adapters", table):
        module = load_adapter_module(file)
        assert BlockAdapterRegister._adapters is table and table.writes == []
        assert dict(table) == dict(BlockAdapterRegister._adapters) and "ProbeRegisteredPipeline" not in table
        load_adapter_module(file, register=True)  # a plain import's effect (the reproduction's)
        assert table["ProbeRegisteredPipeline"].__name__ == "probe_adapter"
    assert callable(module.probe_adapter)
    assert "ProbeRegisteredPipeline" not in BlockAdapterRegister._adapters


def test_a_registered_factory_that_builds_nothing_is_not_used(tiny_run):
    # whether cache-dit's registered adapter is used is cache_dit_adapter_builds (the parallel
    # worker's rule): a registration matching the name whose factory returns no adapter is not
    from cache_dit import BlockAdapterRegister

    from ditbook import hooks
    from ditbook.adapter.build import build_cache_adapter, cache_dit_adapter_builds

    card, run, pipe, report = tiny_run
    with hooks.set_item(BlockAdapterRegister._adapters, type(pipe).__name__, lambda pipe, **kw: None):
        adapter = build_cache_adapter(pipe, report, "tiny-none-factory")
        assert adapter.info.cache_dit_registered == type(pipe).__name__
        assert cache_dit_adapter_builds(pipe) is False
    assert adapter.info.used == "ditbook"


def test_check_cases_keep_the_case_keys():
    from ditbook.cache.verify import check_cases
    from ditbook.render import render_key

    prompts, seeds = ["a", "b", "c"], [0, 1]
    assert check_cases(prompts, seeds, None) == (prompts, seeds)
    assert check_cases(prompts, seeds, 6) == (prompts, seeds)
    assert check_cases(prompts, seeds, 2) == (["a"], [0, 1])
    assert check_cases(prompts, seeds, 3) == (["a", "b"], [0, 1])  # at least the cases asked for
    assert check_cases(prompts, seeds, 1) == (["a"], [0])
    assert check_cases(prompts, [7], 2) == (["a", "b"], [7])
    p, s = check_cases(prompts, seeds, 2)
    keys = {render_key(i, x) for i in range(len(p)) for x in s}
    assert keys <= {render_key(i, x) for i in range(len(prompts)) for x in seeds}  # same keys as the full set


def test_scm_grid_masks_skip_steps_and_are_named_apart():
    """Each SCM grid mask has the run's length, computes its first and last steps and skips at
    least one; two masks never share a row name; a run too short to skip a step gets no grid
    (where building a mask used to raise)."""
    from ditbook.accel.scm import SCM, SCMSettings
    from ditbook.configuration import row_name

    for steps in (1, 2, 3):
        assert SCM.grid(None, steps) == []
    for steps in (4, 8, 20, 28, 50):
        grid = SCM.grid(None, steps)
        assert grid, steps
        for c in grid:
            assert len(c.mask) == steps and c.mask[0] == 1 and c.mask[-1] == 1 and 0 < sum(c.mask) < steps
            assert c.computed == sum(c.mask) and c.policy == "static" and c.taylorseer_order in (0, 2)
        names = [row_name("scm", SCM.settings_dict(c)) for c in grid]
        assert len(set(names)) == len(names), names
        assert [c.computed for c in grid] == sorted((c.computed for c in grid), reverse=True)  # gentlest first
    # the count follows the mask given, whatever the recorded count says
    assert SCMSettings(mask=[1, 0, 1], computed=9).computed == 2


def test_an_empty_grid_leaves_the_strategy_without_rows(tiny_run, monkeypatch):
    from ditbook.accel.scm import SCM

    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report)
    s.noise_floor()
    monkeypatch.setattr(SCM, "grid", classmethod(lambda cls, adapter, steps: []))
    before = len(s.results)
    assert s.tune_strategy("scm") == [] and len(s.results) == before
