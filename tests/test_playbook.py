"""The whole playbook on the shipped reference model, every stage through papermill, with light
settings: the wiring between stages (files in the run folder) is what is under test here."""

import json
from pathlib import Path

import pytest

from ditbook.runner import start_run

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "models" / "reference.yaml"

pytestmark = pytest.mark.slow

LIGHT = {
    "device": "cpu",
    "generation.prompts": ["a red circle on the left"],
    "generation.seeds": [0],
    "generation.steps": 8,
    "cache.strategies": ["scm"],
    "cache.max_configs": 1,
    "parallel.plans": ["ulysses2"],
    "benchmark.repeats": 1,
}


def test_every_stage_on_the_reference_model(tmp_path, monkeypatch):
    monkeypatch.delenv("DITBOOK_NOTEBOOKS", raising=False)
    lines = []
    outcome = start_run(CARD, overrides=LIGHT, run_id="all", outputs_root=tmp_path, log=lines.append)
    assert outcome.ok, (outcome.failure, lines)
    run = outcome.run
    meta = run.read_meta()
    assert meta["status"] == "finished"
    assert [s.stage for s in outcome.stages] == ["intake", "inspect", "cache", "parallel", "benchmark"]
    # each stage read what the earlier ones wrote
    assert run.read_results("inspect").plan_hash
    cache = run.read_results("cache")
    assert cache.chosen.name == "scm"
    assert (run.path / "cache" / cache.adapter_module).is_file()
    par = run.read_results("parallel")
    assert [p.name for p in par.plans] == ["ulysses2"] and par.plans[0].passed
    bench = json.loads((run.path / "benchmark" / "results.json").read_text())
    measured = [r for r in bench["summary"] if r["source"] == "measured here"]
    # the tuned cache configuration was re-measured in the benchmark's own process
    scm = [r for r in measured if r["name"].startswith("scm[")]
    assert scm and scm[0]["speedup"] and scm[0]["psnr_min"] is not None, measured
    html = (run.path / "report.html").read_text()
    assert "<table" in html and "data:image/png;base64," in html
    assert (run.path / "result.md").read_text().count("| passed |") >= 1
