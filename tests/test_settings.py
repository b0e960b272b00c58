"""Typed card settings (issue 14.1) and approval coverage (issue 18.5/18.6).

Every gate is written once (``ditbook.settings``) and the value a card sets is the value that
``plan.md``, the cache stage, the parallel judge, the benchmark summary and ``result.md`` show
and apply; every section refuses unknown keys and wrong types by dotted name, also from ``-p``;
the approved plan covers the gates and the model's files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import pytest
import yaml

from ditbook.card import gate_problems, load_card
from ditbook.cli import main
from ditbook.settings import SECTIONS, CacheSettings, Gates, ParallelSettings, parse_section, reference_table

ROOT = Path(__file__).resolve().parent.parent


# -- helpers ----------------------------------------------------------------------------------
def write_card(tmp_path: Path, name: str = "card.yaml", with_index: bool = True, **sections) -> Path:
    """A card over a model folder that passes `ditbook check`'s folder half (an index, the
    transformer's config and a weights file that opens), so the card's sections decide."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    if with_index:
        (model / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                            "transformer": ["diffusers", "FluxTransformer2DModel"]}))
        (model / "transformer").mkdir(exist_ok=True)
        (model / "transformer" / "config.json").write_text("{}")
        save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(model / "transformer" / "diffusion_pytorch_model.safetensors"))
    data = {"name": "demo", "path": str(model),
            "pipeline": {"class": "FluxPipeline", "source": "diffusers"},
            "transformer": {"class": "FluxTransformer2DModel", "source": "diffusers"},
            "generation": {"prompts": ["a red circle"], "seeds": [0], "height": 32, "width": 32, "steps": 2}}
    for sec, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(sec), dict):
            data[sec] = {**data[sec], **value}
        else:
            data[sec] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def check(capsys, *argv) -> tuple[int, str]:
    code = main(["check", *map(str, argv)])
    return code, capsys.readouterr().err


def noisy(ref: np.ndarray, target_psnr: float, seed: int = 0) -> np.ndarray:
    """``ref`` plus uniform noise whose PSNR against ``ref`` is close to ``target_psnr``."""
    rng = np.random.default_rng(seed)
    sigma = 10 ** (-target_psnr / 20)
    return ref + rng.choice([-1.0, 1.0], size=ref.shape) * sigma


# -- one place for defaults and the README ------------------------------------------------------
def test_readme_card_reference_is_the_settings_table():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- card-reference:[^>]*-->\n(.*?)\n<!-- /card-reference -->", text, re.S)
    assert m, "README lost its generated card reference block"
    assert m.group(1) == reference_table(), "README's card table differs from settings.py: paste python -m ditbook.settings"
    for sec, cls in SECTIONS.items():  # every key documented once
        for f in cls.__dataclass_fields__:
            keys = [f"`{sec}.{f}`"] if f != "gates" else [f"`{sec}.gates.{g}`" for g in Gates.__dataclass_fields__]
            for k in keys:
                assert m.group(1).count(k) == 1, k


# a gate name followed (within a few non-digit characters) by 30, 35 or 0.9, or Gates(...) with a number
GATE_LITERAL = re.compile(
    r"(psnr|ssim|gate)[^\d\n]{0,30}(?<![\w.])((30|35)(\.0+)?(?![\w.])|0\.90?(?!\d))"
    r"|Gates\([^)]*\d", re.I)


def gate_literals(text: str) -> list[str]:
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if GATE_LITERAL.search(line)]


def test_gate_literal_finder_finds_the_old_duplicates():
    # the literals this change removed; the finder must flag each of them
    for old in ('PARALLEL_GATES = Gates(psnr=35.0, ssim=0.90)',
                '"cache": {"psnr_db_min": 30.0, "ssim_min": 0.90, "speedup_min": 1.0},',
                'bq = compare_sets(result.images(name), base, Gates(psnr=30.0, ssim=0.90))',
                'ap.add_argument("--psnr", type=float, default=30.0)',
                'psnr: float = 30.0', 'ssim: float = 0.9'):
        assert gate_literals(old), old
    assert not gate_literals('h = r * 0.9\nseconds = 30\npsnr = card.cache.gates.psnr\n'
                             '{"seconds": 0.9, "psnr_min": 32.0, "ssim_min": 0.93}')


def test_no_gate_literal_outside_settings():
    found = []
    for folder in (ROOT / "lib" / "ditbook", ROOT / "benchmarks"):
        for py in sorted(folder.rglob("*.py")):
            if py == ROOT / "lib" / "ditbook" / "settings.py":
                continue
            found += [f"{py.relative_to(ROOT)}:{hit}" for hit in gate_literals(py.read_text())]
    assert not found, "gate numbers written outside lib/ditbook/settings.py:\n" + "\n".join(found)


# -- the check refuses unknown keys and wrong types, naming the dotted key ------------------------
BAD = [
    ({"generation": {"sampler": "euler"}}, "generation.sampler"),
    ({"generation": {"steps": True}}, "generation.steps"),
    ({"generation": {"steps": "1e12"}}, "generation.steps"),
    ({"generation": {"steps": 10 ** 12}}, "generation.steps"),
    ({"generation": {"steps": 0}}, "generation.steps"),
    ({"generation": {"height": 7}}, "generation.height"),
    ({"generation": {"width": 36}}, "generation.width"),
    ({"generation": {"guidance_scale": "lots"}}, "generation.guidance_scale"),
    ({"generation": {"guidance_scale": True}}, "generation.guidance_scale"),
    ({"generation": {"extra": "notadict"}}, "generation.extra"),
    ({"generation": {"seeds": [0, "one"]}}, "generation.seeds"),
    ({"generation": {"seeds": [True]}}, "generation.seeds"),
    ({"runtime": {"device": "tpu"}}, "runtime.device"),
    ({"runtime": {"threads": 4}}, "runtime.threads"),
    ({"inspect": {"trace_step": 2}}, "inspect.trace_step"),
    ({"inspect": {"trace_steps": "two"}}, "inspect.trace_steps"),
    ({"cache": {"gates": {"psnr": "abc"}}}, "cache.gates.psnr"),
    ({"cache": {"gates": {"psnr_min": 30}}}, "cache.gates.psnr_min"),
    ({"cache": {"gates": 30}}, "cache.gates"),
    ({"cache": {"psnr": 30}}, "cache.psnr"),  # the old flat schema: refused, naming the new key
    ({"cache": {"max_configs": True}}, "cache.max_configs"),
    ({"cache": "fast"}, "cache"),
    ({"parallel": {"gates": {"ssim": 2}}}, "parallel.gates.ssim"),
    ({"parallel": {"plans": "ulysses2"}}, "parallel.plans"),
    ({"parallel": {"nproc": 0}}, "parallel.nproc"),
    ({"runtime": {"compile": {"turbo": 1}}}, "runtime.compile.turbo"),
    ({"runtime": {"compile": 3}}, "runtime.compile"),
    ({"benchmark": {"repeat": 3}}, "benchmark.repeat"),
    ({"benchmark": {"repeats": 0}}, "benchmark.repeats"),
    ({"benchmark": {"warmup": 1.5}}, "benchmark.warmup"),
    ({"benchmark": {"gates": {"cache": {"psnr": 20}}}}, "benchmark.gates"),
]


@pytest.mark.parametrize("sections,key", BAD, ids=[k for _, k in BAD])
def test_check_refuses_bad_section_value(tmp_path, capsys, sections, key):
    code, err = check(capsys, write_card(tmp_path, **sections))
    assert code != 0
    assert re.search(rf"(^|\s){re.escape(key)}: ", err), err


def test_flat_gate_names_its_new_key(tmp_path, capsys):
    _, err = check(capsys, write_card(tmp_path, cache={"psnr": 30}))
    assert "cache.gates.psnr" in err


def test_every_section_problem_listed_at_once(tmp_path, capsys):
    card = write_card(tmp_path, generation={"steps": True, "height": 7}, cache={"gates": {"psnr": "abc"}},
                      benchmark={"repeat": 3}, runtime={"dtype": "float8"})
    code, err = check(capsys, card)
    assert code != 0
    for key in ("generation.steps", "generation.height", "cache.gates.psnr", "benchmark.repeat", "runtime.dtype"):
        assert f"{key}: " in err, key
    assert "5 problems" in err


def test_good_card_with_every_section_passes(tmp_path, capsys):
    card = write_card(tmp_path, runtime={"device": "cuda:1", "dtype": "bfloat16"},
                      inspect={"trace_steps": 3, "trace_size": 16},
                      cache={"gates": {"psnr": 33}, "strategies": ["dbcache"], "max_configs": 2},
                      parallel={"gates": {"ssim": 0.95}, "plans": ["ulysses2"], "cache": {"Fn_compute_blocks": 1}},
                      benchmark={"warmup": 0, "repeats": 2, "peak_tflops": 989.5, "configs": [{"name": "x"}]})
    _, problems = gate_problems(card)  # the card's sections (the empty model folder is `check`'s other half)
    assert problems == []
    c = load_card(card)
    assert c.cache.gates == Gates(psnr=33.0, ssim=CacheSettings().gates.ssim)
    assert c.parallel.gates.psnr == ParallelSettings().gates.psnr and c.parallel.gates.ssim == 0.95
    assert c.benchmark.repeats == 2 and c.inspect.trace_size == 16 and c.runtime.device == "cuda:1"


@pytest.mark.parametrize("override,key", [("benchmark.repeat=3", "benchmark.repeat"),
                                          ("cache.gates.psnr=abc", "cache.gates.psnr"),
                                          ("cache.psnr=33", "cache.psnr"),
                                          ("steps=true", "generation.steps"),
                                          ("generation.sampler=euler", "generation.sampler")])
def test_check_refuses_bad_override(tmp_path, capsys, override, key):
    card = write_card(tmp_path)
    assert check(capsys, card)[0] == 0
    code, err = check(capsys, card, "-p", override)
    assert code != 0
    assert f"{key}: " in err and "(set by -p)" in err, err


def test_override_sets_a_typed_gate(tmp_path, capsys):
    card = write_card(tmp_path)
    assert check(capsys, card, "-p", "cache.gates.psnr=33")[0] == 0
    assert load_card(card, {"cache.gates.psnr": 33}).cache.gates.psnr == 33.0
    with pytest.raises(Exception, match="benchmark.repeat"):
        load_card(card, {"benchmark.repeat": 3})  # load_card (workers, reproduce) refuses too


def test_parse_section_replaces_nothing_silently():
    sec, problems = parse_section(CacheSettings, {"gates": {"ssim": 0.5}}, "cache")
    assert not problems and sec.gates.ssim == 0.5 and sec.gates.psnr == CacheSettings().gates.psnr
    sec, problems = parse_section(ParallelSettings, {"gates": {"ssim": 0.5}}, "parallel")
    assert sec.gates.psnr == ParallelSettings().gates.psnr  # unset fields keep the section's own default


# -- one gate, applied everywhere -----------------------------------------------------------
def gated_card(tmp_path, cache_psnr: float, parallel_psnr: float, with_index=False):
    path = write_card(tmp_path, f"c{cache_psnr}_{parallel_psnr}.yaml", with_index=with_index,
                      cache={"gates": {"psnr": cache_psnr, "ssim": 0.5}},
                      parallel={"gates": {"psnr": parallel_psnr, "ssim": 0.5}})
    return load_card(path)


def tiny_report():
    import diffusers as d

    from ditbook.arch.static import inspect_transformer

    model = d.FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                     pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    return inspect_transformer(model, "FluxPipeline")


def test_plan_md_shows_the_cards_gates(tmp_path):
    from ditbook.inspect.plan import build_plan, render_plan_md

    report = tiny_report()
    a = build_plan(report, None, gated_card(tmp_path, 31, 41))
    b = build_plan(report, None, gated_card(tmp_path, 33, 43))
    assert a["acceptance_gates"]["cache"]["psnr"] == 31 and b["acceptance_gates"]["parallel"]["psnr"] == 43
    assert a["hash"] != b["hash"]  # the approved hash covers the gates
    md = render_plan_md(b)
    assert "cache (`cache.gates`): PSNR > 33 dB" in md and "parallel (`parallel.gates`): PSNR > 43 dB" in md
    assert "PSNR > 31" not in md


def test_cache_stage_decides_with_the_cards_gates(tmp_path, monkeypatch):
    import ditbook.cache.stage as cache_stage
    from ditbook.quality import compare_sets

    monkeypatch.setattr(cache_stage, "build_cache_adapter", lambda *a, **k: SimpleNamespace())
    ref = {"a": np.full((16, 16, 3), 0.5)}
    img = {"a": noisy(ref["a"], 32.0)}
    verdicts = {}
    for psnr in (30, 34):
        card = gated_card(tmp_path, psnr, 40)
        ctx = SimpleNamespace(card=card, dir=tmp_path, baseline=lambda: ref)
        session = cache_stage.CacheSession.open(ctx, report=None, pipe=object())
        assert session.gates == card.cache.gates
        # what evaluate() decides every configuration with
        verdicts[psnr] = compare_sets(img, session.baseline, session.gates).passed
    assert verdicts == {30: True, 34: False}


def fake_launch(tmp_path: Path, psnr_vs_single: float) -> "object":
    from ditbook.parallel.launch import LaunchResult

    base = np.full((16, 16, 3), 0.5)
    images = {"single": base, "single+cache": base, "ulysses2": noisy(base, psnr_vs_single, 1),
              "ulysses2+cache": noisy(base, psnr_vs_single, 2)}
    plans = {}
    for name, img in images.items():
        np.save(tmp_path / f"{name}.npy", img)
        plans[name] = {"images": [{"key": "k", "npy": f"{name}.npy"}], "median_seconds": 1.0,
                       "world_size": 2 if "ulysses" in name else 1}
        if "ulysses" in name:  # a verified split, so that only the gates decide here
            plans[name]["sharding"] = {"error": None, "check": {"degree": 2}}
    return LaunchResult(tmp_path, 2, 1.0, {"plans": plans}, [])


def test_parallel_judge_applies_the_cards_gates(tmp_path, monkeypatch):
    import importlib

    launch_mod = importlib.import_module("ditbook.parallel.launch")  # the package exports a launch() too
    result = fake_launch(tmp_path, 37.0)
    strict, loose = gated_card(tmp_path, 40, 39), gated_card(tmp_path, 36, 35)
    got = {r.name: r for r in launch_mod.judge(result, ["ulysses2", "ulysses2+cache"], strict.parallel.gates,
                                               strict.cache.gates)}
    assert not got["ulysses2"].passed and not got["ulysses2+cache"].baseline_quality.passed
    assert got["ulysses2"].gates["quality"]["psnr"] == 39
    got = {r.name: r for r in launch_mod.judge(result, ["ulysses2", "ulysses2+cache"], loose.parallel.gates,
                                               loose.cache.gates)}
    assert got["ulysses2"].passed and got["ulysses2+cache"].baseline_quality.passed
    # run_plans (the stage and `ditbook parallel`) reads the card's gates, after its overrides
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: result)
    results, _ = launch_mod.run_plans(strict.card_path, ["ulysses2"], 2, tmp_path)
    assert not results[0].passed and "39" in " ".join(results[0].quality.reasons)
    results, _ = launch_mod.run_plans(strict.card_path, ["ulysses2"], 2, tmp_path,
                                      overrides={"parallel.gates.psnr": 35})
    assert results[0].passed


def test_benchmark_summary_and_result_md_apply_the_cards_gates(tmp_path):
    from ditbook.benchmark.inputs import read_inputs
    from ditbook.benchmark.report import write_result_md
    from ditbook.benchmark.stage import measure, save
    from synthetic_run import FakePipeline, make_synthetic_run
    from ditbook.runs import RunFolder

    run_dir = make_synthetic_run(tmp_path, benchmark=False, parallel=False)
    run = RunFolder(run_dir)
    card_path = tmp_path / "synthetic.yaml"
    out = {}
    for psnr in (30, 42):  # the cache stage confirmed "gentle" at 41.5 dB and "brisk" at 43.25 dB held-out
        card = load_card(card_path, {"cache.gates.psnr": psnr})
        ctx = SimpleNamespace(card=card, run=run)
        report = measure(ctx, FakePipeline(), [], warmup=0, repeats=1)  # the baseline only: no timing race
        results = save(ctx, report, read_inputs(run))
        assert results.gates["cache"].psnr == psnr and results.gates["cache+parallel"].psnr == psnr
        assert results.gates["parallel"].psnr == card.parallel.gates.psnr
        out[psnr] = ({r["name"]: r["why_not"] for r in results.verdict.refused}, write_result_md(run_dir).read_text())
    (why30, md30), (why42, md42) = out[30], out[42]
    assert why30["gentle"] == "not timed" and "(gate > 30)" in md30 and "gate > 42" not in md30
    assert "does not pass the gates (PSNR > 42" in why42["gentle"] and why42["brisk"] == "not timed"
    assert "(gate > 42)" in md42  # the verdict judges every candidate by the gates in force


# -- approval covers the gates and the weights ------------------------------------------------
def approved_run(tmp_path):
    from ditbook.approval import approve
    from ditbook.inspect.plan import build_plan, write_plan
    from ditbook.runs import RunFolder

    card = gated_card(tmp_path, 30, 35, with_index=True)
    run = RunFolder.create(card, tmp_path / "outputs", run_id="r1")
    plan = build_plan(tiny_report(), None, card)
    write_plan(run.stage_dir("inspect"), plan)
    from ditbook.records import InspectResults

    run.write_results("inspect", InspectResults(plan_hash=plan["hash"], transformer_class="T"))
    approve(card, run.stage_dir("inspect") / "plan.json")
    return load_card(card.card_path), run


def test_approval_refuses_looser_gates_from_overrides(tmp_path):
    from ditbook.approval import ApprovalError, check_approval

    card, run = approved_run(tmp_path)
    assert check_approval(card, run)
    assert check_approval(load_card(card.card_path, {"cache.gates.psnr": 40}), run)  # stricter: within the approval
    for key, value, named in (("cache.gates.psnr", 5, "cache.gates.psnr 30 -> 5"),
                              ("parallel.gates.ssim", 0.1, "parallel.gates.ssim 0.5 -> 0.1"),
                              ("cache.gates.tile_margin_db", 50, "cache.gates.tile_margin_db 10 -> 50")):
        with pytest.raises(ApprovalError, match=re.escape(named)):
            check_approval(load_card(card.card_path, {key: value}), run)


def test_approval_refuses_changed_weights(tmp_path):
    from ditbook.approval import ApprovalError, check_approval

    card, run = approved_run(tmp_path)
    weights = card.path / "transformer" / "diffusion_pytorch_model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[::-1])  # same size, other bytes (a retrained model)
    with pytest.raises(ApprovalError, match="weights changed.*transformer/diffusion_pytorch_model.safetensors changed"):
        check_approval(card, run)
    weights.write_bytes(original)
    assert check_approval(card, run)
    (card.path / "transformer" / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(ApprovalError, match="extra.safetensors added"):
        check_approval(card, run)
    (card.path / "transformer" / "extra.safetensors").unlink()
    # run folders, bytecode and the card itself are not the model's identity
    (card.path / "transformer" / "__pycache__").mkdir()
    (card.path / "transformer" / "__pycache__" / "x.pyc").write_bytes(b"x")
    (card.path / "outputs").mkdir()
    (card.path / "outputs" / "run.json").write_text("{}")
    assert check_approval(card, run)


def test_parallel_cache_is_typed_and_refuses_unknown_keys(tmp_path):
    from ditbook.settings import ParallelCache

    card = write_card(tmp_path, parallel={"cache": {"residual_diff_threshold": 0.3, "max_warmup_steps": 2}})
    c = load_card(card)
    assert isinstance(c.parallel.cache, ParallelCache)
    assert c.parallel.cache.options() == {"residual_diff_threshold": 0.3, "max_warmup_steps": 2}
    bad = write_card(tmp_path, name="bad.yaml", parallel={"cache": {"residual_diff_treshold": 0.3, "max_warmup_steps": "two"}})
    _, problems = gate_problems(bad)
    text = "; ".join(problems)
    assert "parallel.cache" in text and "residual_diff_treshold: unknown key" in text and "max_warmup_steps" in text


def test_one_dbcache_default_the_cache_strategys():
    # the +cache plans' defaults are the cache strategy's settings, not a second copy
    from ditbook.accel.dbcache import DBCacheSettings
    from ditbook.accel.dbcache import dbcache_config

    d, cfg = DBCacheSettings(), dbcache_config(None)
    assert (cfg.residual_diff_threshold, cfg.max_warmup_steps, cfg.Fn_compute_blocks, cfg.Bn_compute_blocks) == \
        (d.threshold, d.max_warmup_steps, d.Fn, d.Bn)
    assert dbcache_config({"residual_diff_threshold": 0.5}).residual_diff_threshold == 0.5


@pytest.mark.parametrize("suffix", [".safetensors", ".msgpack", ".onnx", ".txt"])
def test_one_weight_file_rule_for_the_load_check_and_the_approval(tmp_path, suffix):
    # a file the approval hash covers as a weight file is one the load check accepts as weights, and back
    from ditbook.approval import _model_files
    from ditbook.loading import component_problems

    comp = tmp_path / "transformer"
    comp.mkdir()
    (comp / "config.json").write_text("{}")
    (comp / f"weights{suffix}").write_bytes(b"\0" * 16)
    covered = [p.name for p in _model_files(comp)] == [f"weights{suffix}"]
    no_weights = any("no weights file" in p for p in component_problems(comp, "transformer"))
    assert covered != no_weights, (covered, no_weights)
