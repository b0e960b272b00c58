"""Hostile inputs and faults (issue 18): every case ends in a named refusal and a non-zero exit,
never a traceback, never a silent pass, and never touches what earlier runs wrote.

Most cases call ``ditbook.cli.main`` in-process on tiny cards (the synthetic pipeline of
``synthetic_run``, or one zoo model built once for the module); two spawn real
processes: a 2-process gloo ``ditbook parallel`` stopped by SIGINT, and a ``ditbook run`` whose
stage started a child in a session of its own, stopped by SIGTERM and then resumed.
Card field types, ranges and unknown keys are checked by ``ditbook.settings``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat as nbf
import numpy as np
import pytest
import yaml

from synthetic_run import CARD as SYNTHETIC_CARD
from ditbook.card import load_card
from ditbook.cli import main
from ditbook.runs import RunError, RunFolder
from ditbook.settings import CacheSettings

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "lib"


# ---------------------------------------------------------------------------------------------
# helpers


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out, err
    return code, out, err


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes (lock files aside)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name != ".lock"}


def synthetic_card(tmp_path: Path, edit=None, name: str = "card.yaml") -> Path:
    """A complete card of the synthetic pipeline; ``edit(mapping)`` changes it."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    data = yaml.safe_load(SYNTHETIC_CARD.format(path=model))
    if edit:
        edit(data)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def raw_card(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "card.yaml"
    p.write_text(text)
    return p


def make_run(tmp_path: Path, card_path: Path, status: str = "running", run_id: str = "r1") -> RunFolder:
    run = RunFolder.create(load_card(card_path), tmp_path / "outputs", run_id)
    meta = run.read_meta()
    meta["status"] = status
    meta["stages"] = {"intake": {"status": "passed", "notebook": "01_intake.ipynb"}}
    run.write_meta(meta)
    from ditbook.records import CacheResults, IntakeResults
    from ditbook.settings import Gates

    run.write_results("intake", IntakeResults(images=[], placement={"device": "cpu", "dtype": "float32"}))
    run.write_results("cache", CacheResults(adapter_module="kept.py", gates=Gates()))
    (run.path / "03_cache.ipynb").write_text('{"cells": [], "note": "executed before"}')
    return run


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """The tiny FLUX zoo model and its card, built once for the module."""
    d = tmp_path_factory.mktemp("zoo")
    assert main(["zoo", "build", "flux", str(d)]) == 0
    return d


def zoo_card(tmp_path: Path, zoo: Path, copy_model: bool = False, edit=None) -> Path:
    data = yaml.safe_load((zoo / "flux.yaml").read_text())
    model = zoo / "flux"
    if copy_model:
        shutil.copytree(model, tmp_path / "flux")
        model = tmp_path / "flux"
    data["path"] = str(model)
    if edit:
        edit(data)
    p = tmp_path / "flux.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture(autouse=True)
def _outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("DITBOOK_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.delenv("DITBOOK_GPUS", raising=False)


# ---------------------------------------------------------------------------------------------
# cards


def test_card_missing_file(tmp_path, capsys):
    code, _, err = cli(capsys, "check", tmp_path / "nope.yaml")
    assert code == 2 and "not found" in err


def test_card_invalid_yaml(tmp_path, capsys):
    code, _, err = cli(capsys, "check", raw_card(tmp_path, "name: [x\npath: y\n"))
    assert code == 2 and "not valid YAML" in err


def test_card_top_level_list(tmp_path, capsys):
    code, _, err = cli(capsys, "check", raw_card(tmp_path, "- a\n- b\n"))
    assert code == 2 and "mapping" in err


def test_card_empty_file_names_every_missing_field(tmp_path, capsys):
    code, _, err = cli(capsys, "check", raw_card(tmp_path, ""))
    assert code == 2
    for field in ("path: missing", "pipeline: missing", "transformer: missing", "generation.prompts"):
        assert field in err


def test_card_missing_transformer_class(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["transformer"].pop("class"))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "transformer.class: missing" in err


def test_card_source_file_missing(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["transformer"].update(source="code/nope.py"))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "transformer.source" in err and "does not exist" in err


def test_card_source_file_calling_sys_exit_is_reported_not_fatal(tmp_path, capsys):
    (tmp_path / "evil.py").write_text("import sys\nsys.exit(3)\n")
    card = synthetic_card(tmp_path, lambda d: d["transformer"].update({"class": "X", "source": "evil.py"}))
    code, _, err = cli(capsys, "check", card)  # old code: SystemExit ended the process
    assert code == 2 and "SystemExit" in err and "transformer.source" in err


def test_card_source_file_raising_on_import(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("raise RuntimeError('model code broke at import')\n")
    card = synthetic_card(tmp_path, lambda d: d["transformer"].update({"class": "X", "source": "broken.py"}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "model code broke at import" in err


@pytest.mark.parametrize("body", ["import time\nwhile True:\n    time.sleep(0.05)\n", "while True:\n    pass\n"])
def test_card_source_file_that_never_finishes_importing(tmp_path, body):
    (tmp_path / "forever.py").write_text(body)
    card = synthetic_card(tmp_path, lambda d: d["transformer"].update({"class": "X", "source": "forever.py"}))
    done = subprocess.run([sys.executable, "-m", "ditbook", "check", str(card)], capture_output=True, text=True,
                          # 10 s, not less: the card's pipeline source (synthetic_run, which imports torch and
                          # diffusers) is imported first under the same limit; on a loaded 2-core machine that
                          # took over 2 s, the alarm cut torch's import, and the check reported that instead
                          timeout=90, env=_env(tmp_path, DITBOOK_IMPORT_TIMEOUT="10"))  # old code: waits forever
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "forever.py" in done.stderr and "did not finish within 10s" in done.stderr
    assert "transformer.source" in done.stderr  # and it ended: subprocess.run's timeout (90 s) did not fire


def test_card_yaml_alias_bomb_is_refused(tmp_path, capsys):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 7):  # 9**6 values once expanded; the text is a few hundred bytes
        lines.append(f"a{i}: &a{i} [{', '.join(f'*a{i - 1}' for _ in range(9))}]")
    text = synthetic_card(tmp_path).read_text().replace("generation:\n", "generation:\n  extra:\n    bomb:\n"
                                                        + "".join(f"      {ln}\n" for ln in lines) + "", 1)
    card = raw_card(tmp_path, text)
    assert "*a5" in card.read_text()
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "aliases expand to" in err  # old code: passed after materializing every alias


def test_environment_is_expanded_in_paths_only_not_in_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("DITBOOK_TEST_DIR", str(tmp_path))
    card = synthetic_card(tmp_path, lambda d: (d.update(path="${DITBOOK_TEST_DIR}/model"),
                                              d["generation"].update(prompts=["a ${HOME} sign", "${DITBOOK_TEST_DIR}"])))
    c = load_card(card)
    assert c.path == tmp_path / "model"
    assert c.generation.prompts == ["a ${HOME} sign", "${DITBOOK_TEST_DIR}"]  # old code: the home folder's path


def test_batch_goes_on_past_a_source_that_exits(tmp_path, capsys):
    (tmp_path / "evil.py").write_text("import sys\nsys.exit(0)\n")
    a = synthetic_card(tmp_path, lambda d: d["pipeline"].update({"class": "X", "source": "evil.py"}), "a.yaml")
    b = synthetic_card(tmp_path, lambda d: d.pop("path"), "b.yaml")
    code, out, _ = cli(capsys, "batch", a, b)
    assert code == 1
    assert "SystemExit" in out and "path: missing" in out  # both cards reached the table


def test_card_class_not_in_module(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["pipeline"].update({"class": "NoSuchPipeline"}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "NoSuchPipeline" in err


def test_card_unknown_module(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["pipeline"].update({"source": "no_such_module_xyz"}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "no_such_module_xyz" in err


def test_card_unset_environment_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DITBOOK_NO_SUCH_VAR", raising=False)
    card = synthetic_card(tmp_path, lambda d: d.update(path="${DITBOOK_NO_SUCH_VAR}/model"))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "DITBOOK_NO_SUCH_VAR" in err


def test_card_path_does_not_exist(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d.update(path=str(tmp_path / "gone")))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "does not exist" in err


def test_card_path_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    card = synthetic_card(tmp_path, lambda d: d.update(path=str(tmp_path / "afile")))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "not a folder" in err


@pytest.mark.parametrize("field,value", [("height", 0), ("width", -8), ("steps", -1)])
def test_card_non_positive_sizes(tmp_path, capsys, field, value):
    card = synthetic_card(tmp_path, lambda d: d["generation"].update({field: value}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and f"generation.{field}" in err


def test_card_seeds_not_integers(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["generation"].update(seeds=["a"]))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "generation.seeds" in err


def test_card_unknown_generation_field(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["generation"].update(stepz=4))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "stepz" in err


def test_card_unknown_top_level_field(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d.update(cahce={"psnr": 30}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "cahce" in err


@pytest.mark.parametrize("key,value", [("device", "tpu"), ("dtype", "float8")])
def test_card_runtime_values(tmp_path, capsys, key, value):
    card = synthetic_card(tmp_path, lambda d: d.update(runtime={key: value}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and f"runtime.{key}" in err


def test_card_steps_as_a_float(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d["generation"].update(steps=1e12))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "generation.steps" in err


@pytest.mark.parametrize("field,value", [("steps", True), ("height", 7), ("steps", 10**12),
                                         ("guidance_scale", "lots"), ("extra", "notadict")])
def test_card_types_and_ranges(tmp_path, capsys, field, value):
    card = synthetic_card(tmp_path, lambda d: d["generation"].update({field: value}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and f"generation.{field}" in err


# ---------------------------------------------------------------------------------------------
# overrides


def test_override_unbalanced_yaml_is_named(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "steps=[1")
    assert code == 2 and "steps=[1" in err and "not valid YAML" in err


def test_override_without_equals(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "novalue")
    assert code == 2 and "-p expects key=value" in err


def test_override_zero_steps(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "generation.steps=0")
    assert code == 2 and "generation.steps" in err


def test_override_misspelled_generation_key(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "generation.stepz=4")
    assert code == 2 and "stepz" in err


def test_override_unknown_section(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "nosuchsection.x=1")
    assert code == 2 and "nosuchsection" in err


def test_override_section_replaced_by_scalar(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "generation=5")
    assert code == 2 and "generation" in err


def test_override_dtype_shorthand(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "dtype=float8")
    assert code == 2 and "runtime.dtype" in err


def test_override_gate_type(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "cache.psnr=lots")
    assert code == 2 and "cache.psnr" in err


def test_override_misspelled_cache_key(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "cache.psnrr=10")
    assert code == 2 and "psnrr" in err


def test_override_yaml_error_on_run_creates_nothing(tmp_path, capsys):
    code, _, err = cli(capsys, "run", synthetic_card(tmp_path), "-p", "seeds={0")
    assert code == 2 and "seeds={0" in err
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------------------
# model folders (ditbook check reads what the stages will need)


def test_model_folder_complete_passes(tmp_path, capsys, zoo):
    code, out, _ = cli(capsys, "check", zoo_card(tmp_path, zoo))
    assert code == 0 and "gate check passed" in out


def test_model_folder_empty(tmp_path, capsys, zoo):
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "check", zoo_card(tmp_path, zoo, edit=lambda d: d.update(path=str(tmp_path / "empty"))))
    assert code == 2 and "model_index.json" in err


def test_model_folder_index_not_json(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, copy_model=True)
    (tmp_path / "flux" / "model_index.json").write_text('{"_class_name": "FluxPip')
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "model_index.json" in err and "JSON" in err


def test_model_folder_component_missing(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, copy_model=True)
    shutil.rmtree(tmp_path / "flux" / "vae")
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "vae" in err and "missing" in err


def test_model_folder_weights_missing(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, copy_model=True)
    (tmp_path / "flux" / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "transformer" in err and "no weights" in err


def test_model_folder_weights_truncated(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, copy_model=True)
    w = tmp_path / "flux" / "vae" / "diffusion_pytorch_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "vae" in err and "does not open" in err


def test_model_folder_weights_empty(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, copy_model=True)
    (tmp_path / "flux" / "text_encoder" / "model.safetensors").write_bytes(b"")
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "text_encoder" in err and "empty" in err


def test_model_folder_config_corrupt(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, copy_model=True)
    (tmp_path / "flux" / "transformer" / "config.json").write_text("{not json")
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "config.json" in err


def test_model_folder_wrong_transformer_subfolder(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo, edit=lambda d: d["transformer"].update(subfolder="nope"))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "nope" in err


# ---------------------------------------------------------------------------------------------
# runs: never overwritten, never raced, never outside the outputs folder


@pytest.mark.parametrize("run_id", [".", "..", "../escape", "ABSOLUTE", "a/b", ""])
def test_run_id_must_be_one_safe_component(tmp_path, capsys, run_id):
    run_id = str(tmp_path / "abs") if run_id == "ABSOLUTE" else run_id
    code, _, err = cli(capsys, "run", synthetic_card(tmp_path), "--run-id", run_id, "--stages", "intake")
    assert code == 2 and "run id" in err
    assert not (tmp_path / "outputs" / "synthetic").exists() or not any((tmp_path / "outputs" / "synthetic").iterdir())
    assert not (tmp_path / "escape").exists() and not (tmp_path / "abs").exists()


@pytest.mark.parametrize("name", ["../../x", "ABSOLUTE", "a/b", "."])
def test_model_name_must_be_one_safe_component(tmp_path, capsys, name):
    absolute = tmp_path / "elsewhere" / "abs-name"  # old code wrote its run folder here
    name = str(absolute) if name == "ABSOLUTE" else name
    card = synthetic_card(tmp_path, lambda d: d.update(name=name))
    code, _, err = cli(capsys, "run", card, "--stages", "intake")
    assert code == 2 and "model name" in err
    assert not (tmp_path.parent / "x").exists() and not absolute.exists()


# ``ditbook check`` refuses what ``ditbook run`` refuses at its start (old code: check passed these)
@pytest.mark.parametrize("name", ["../../x", "ABSOLUTE", "a/b"])
def test_check_refuses_the_names_run_refuses(tmp_path, capsys, name):
    name = str(tmp_path / "abs-name") if name == "ABSOLUTE" else name
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path, lambda d: d.update(name=name)))
    assert code == 2 and "name:" in err and "model name" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_check_refuses_a_device_this_machine_lacks(tmp_path, capsys):
    card = synthetic_card(tmp_path, lambda d: d.update(runtime={"device": "cuda"}))
    code, _, err = cli(capsys, "check", card)
    assert code == 2 and "runtime.device" in err and "0 CUDA device" in err


@pytest.mark.parametrize("value", ["[nosuch]", "[]"])
def test_unknown_cache_strategies_through_the_card_route(tmp_path, capsys, value):
    card = synthetic_card(tmp_path)
    code, _, err = cli(capsys, "check", card, "-p", f"cache.strategies={value}")
    assert code == 2 and "cache.strategies" in err and "registered" in err
    code, _, err = cli(capsys, "run", card, "--stages", "intake", "-p", f"cache.strategies={value}")
    assert code == 2 and "cache.strategies" in err and not (tmp_path / "outputs").exists()


def test_empty_override_is_refused_not_read_as_the_default(tmp_path, capsys):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path), "-p", "generation.steps=")
    assert code == 2 and "generation.steps=" in err and "empty" in err
    from ditbook.card import parse_overrides

    assert parse_overrides(["generation.steps=null"]) == {"generation.steps": None}  # an explicit null still can


@pytest.mark.parametrize("seeds", [[2**64], [-1]])
def test_seeds_out_of_range_are_named(tmp_path, capsys, seeds):
    code, _, err = cli(capsys, "check", synthetic_card(tmp_path, lambda d: d["generation"].update(seeds=seeds)))
    assert code == 2 and "generation.seeds" in err and "between 0 and" in err


@pytest.mark.parametrize("flag,value", [("--size", 7), ("--size", 0), ("--steps", 0)])
def test_inspect_size_and_steps_are_named(tmp_path, capsys, flag, value):
    code, _, err = cli(capsys, "inspect", synthetic_card(tmp_path), flag, value, "--no-save")
    assert code == 2 and flag in err  # old code: torch's "Calculated padded input size" for --size 7


def test_check_names_an_extra_argument_of_the_wrong_type(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo)
    code, _, err = cli(capsys, "check", card, "-p", "generation.extra.max_sequence_length=[1]")
    assert code == 2 and "generation.extra.max_sequence_length" in err and "int" in err
    code, _, _ = cli(capsys, "check", card, "-p", "generation.extra.max_sequence_length=64")
    assert code == 0


def test_run_id_taken_is_refused_and_kept(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card, status="finished", run_id="taken")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "run", card, "--run-id", "taken", "--stages", "intake")
    assert code == 2 and "already exists" in err
    assert snapshot(run.path) == before


def test_outputs_is_a_file(tmp_path, capsys):
    (tmp_path / "outfile").write_text("x")
    code, _, err = cli(capsys, "run", synthetic_card(tmp_path), "--outputs", tmp_path / "outfile", "--stages", "intake")
    assert code == 2 and "outfile" in err and "not a folder" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_outputs_read_only(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, _, err = cli(capsys, "run", synthetic_card(tmp_path), "--outputs", ro, "--stages", "intake")
    finally:
        ro.chmod(0o700)
    assert code == 2 and "cannot create" in err and str(ro) in err


def test_resume_finished_run_refused_and_intact(tmp_path, capsys):
    run = make_run(tmp_path, synthetic_card(tmp_path), status="finished")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "run", "--resume", run.path)
    assert code == 2 and "finished" in err
    assert snapshot(run.path) == before


@pytest.mark.parametrize("flags,named", [(["--stages", "cache"], "--stages"), (["-p", "steps=2"], "-p"),
                                         (["--run-id", "x"], "--run-id")])
def test_resume_refuses_flags_it_would_ignore(tmp_path, capsys, flags, named):
    run = make_run(tmp_path, synthetic_card(tmp_path), status="failed")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "run", "--resume", run.path, *flags)
    assert code == 2 and named in err and "ignored" in err
    assert snapshot(run.path) == before


def test_resume_truncated_run_json_names_the_file(tmp_path, capsys):
    run = make_run(tmp_path, synthetic_card(tmp_path), status="failed")
    run.meta_path.write_text('{"model": "synthetic", "sta')
    code, _, err = cli(capsys, "run", "--resume", run.path)
    assert code == 2 and str(run.meta_path) in err and "not valid JSON" in err


def test_resume_run_json_not_an_object(tmp_path, capsys):
    run = make_run(tmp_path, synthetic_card(tmp_path), status="failed")
    run.meta_path.write_text("[1, 2]")
    code, _, err = cli(capsys, "run", "--resume", run.path)
    assert code == 2 and "JSON object" in err


def test_resume_of_a_run_locked_by_a_live_process(tmp_path, capsys):
    run = make_run(tmp_path, synthetic_card(tmp_path), status="running")
    holder = sleeper()
    try:
        run.lock_path.write_text(f"{holder.pid} ditbook run\n")
        before = snapshot(run.path)
        code, _, err = cli(capsys, "run", "--resume", run.path)
        assert code == 2 and f"process {holder.pid}" in err
        assert snapshot(run.path) == before
        assert run.lock_path.read_text().startswith(str(holder.pid))  # not taken from its holder
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    run = make_run(tmp_path, synthetic_card(tmp_path))
    run.lock_path.write_text(f"{dead_pid()} ditbook run\n")
    with run.acquire("test"):
        assert run.lock_path.read_text().split()[0] == str(os.getpid())
    assert not run.lock_path.exists()


def test_lock_is_reentrant_in_one_process_and_released(tmp_path):
    run = make_run(tmp_path, synthetic_card(tmp_path))
    with run.acquire("outer"):
        with run.acquire("inner"):
            pass
        assert run.lock_path.exists()  # the outer holder still holds it
    assert not run.lock_path.exists()


def test_two_creators_of_one_run_id(tmp_path):
    card = load_card(synthetic_card(tmp_path))
    outcomes, barrier = [], threading.Barrier(2)

    def create():
        barrier.wait()
        try:
            outcomes.append(RunFolder.create(card, tmp_path / "outputs", "same"))
        except RunError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=create) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(type(o).__name__ for o in outcomes) == ["RunError", "RunFolder"]
    assert "already exists" in str(next(o for o in outcomes if isinstance(o, RunError)))


def test_two_runs_in_one_second_get_two_folders(tmp_path, monkeypatch):
    import ditbook.runs as runs

    monkeypatch.setattr(runs, "new_run_id", lambda: "20260101-000000")
    card = load_card(synthetic_card(tmp_path))
    a = RunFolder.create(card, tmp_path / "outputs")
    b = RunFolder.create(card, tmp_path / "outputs")
    assert a.path != b.path and a.read_meta()["run_id"] == a.path.name and b.read_meta()["run_id"] == b.path.name


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_every_file_of_a_run_has_one_mode(tmp_path):
    run = make_run(tmp_path, synthetic_card(tmp_path))
    (run.path / "other.txt").write_text("x")  # what any plain write of a stage gives
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in run.path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert set(modes.values()) == {oct(0o666 & ~_umask())}, modes  # old code: run.json, results.json 0600


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    run = make_run(tmp_path, synthetic_card(tmp_path))
    meta = run.read_meta()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        run.write_meta({**meta, "status": "finished"})
    monkeypatch.undo()
    left = [p.name for p in run.path.iterdir() if p.name.startswith(".run.json")]
    assert left == [] and run.read_meta()["status"] == meta["status"]  # old code: a .run.json.* left behind


def test_truncated_results_json_names_the_file(tmp_path):
    run = make_run(tmp_path, synthetic_card(tmp_path))
    run.results_path("intake").write_text('{"images": [')
    with pytest.raises(RunError, match="intake.*not valid JSON"):
        run.read_results("intake")


def test_latest_run_skips_an_unreadable_run_json(tmp_path):
    from ditbook.runs import latest_run

    card = synthetic_card(tmp_path)
    good = make_run(tmp_path, card, run_id="a")
    bad = make_run(tmp_path, card, run_id="b")
    bad.meta_path.write_text("{")
    # the newer run's run.json is unreadable: it neither raises nor hides the readable one
    assert latest_run(tmp_path / "outputs", "synthetic").path == good.path
    assert latest_run(tmp_path / "outputs", "synthetic", with_stage="intake").path == good.path


def test_compare_with_a_truncated_run_json(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    a, b = make_run(tmp_path, card, run_id="a"), make_run(tmp_path, card, run_id="b")
    b.meta_path.write_text('{"model"')
    code, _, err = cli(capsys, "compare", a.path, b.path)
    assert code == 2 and "run.json" in err


def test_stage_refuses_to_write_a_finished_run(tmp_path):
    from ditbook.context import open_stage

    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card, status="finished")
    before = snapshot(run.path)
    with pytest.raises(RunError, match="finished"):
        open_stage(str(card), str(run.path), "cache", {})
    assert snapshot(run.path) == before


def test_stage_refuses_a_run_locked_by_another_process(tmp_path):
    from ditbook.context import open_stage

    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card)
    holder = sleeper()
    try:
        run.lock_path.write_text(f"{holder.pid} ditbook run\n")
        with pytest.raises(RunError, match=f"process {holder.pid}"):
            open_stage(str(card), str(run.path), "cache", {})
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------------------------
# approval


def _inspected_run(tmp_path: Path, card: Path) -> RunFolder:
    run = RunFolder.create(load_card(card), tmp_path / "outputs", "inspected")
    (run.stage_dir("inspect") / "plan.json").write_text(json.dumps({"risks": [], "steps": ["wrap blocks"]}))
    return run


def test_approve_flow_style_card_stays_valid_yaml(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    card = raw_card(tmp_path, "{name: flow, path: %s, pipeline: {class: FakePipeline, source: synthetic_run},"
                              " transformer: {class: FakeTransformer, source: synthetic_run},"
                              " generation: {prompts: [a], seeds: [0], height: 8, width: 8, steps: 3}}\n" % model)
    run = _inspected_run(tmp_path, card)
    code, out, _ = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 0, out
    data = yaml.safe_load(card.read_text())  # old code: a line after the flow mapping -> invalid YAML
    assert data["name"] == "flow" and data["generation"]["steps"] == 3
    assert isinstance(data["approved_plan"], str) and data["approved_plan"]
    from ditbook.card import gate_problems

    assert gate_problems(card)[1] == []


def test_approve_block_card_keeps_comments(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    card.write_text("# my model, my notes\n" + card.read_text())
    run = _inspected_run(tmp_path, card)
    code, _, _ = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 0
    text = card.read_text()
    assert text.startswith("# my model, my notes") and yaml.safe_load(text)["approved_plan"]


def test_approve_flow_style_card_keeps_every_comment(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    text = ("# ticket: DIT-1234 -- do not change the seeds without asking\n"
            "{name: flow, path: %s,  # the model folder\n"
            " pipeline: {class: FakePipeline, source: synthetic_run},\n"
            " transformer: {class: FakeTransformer, source: synthetic_run},\n"
            " generation: {prompts: ['a cat'], seeds: [0], height: 8, width: 8, steps: 3}  # keep\n"
            "}\n# end of card\n" % model)
    card = raw_card(tmp_path, text)
    run = _inspected_run(tmp_path, card)
    code, out, _ = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 0, out
    after = card.read_text()
    for comment in ("# ticket: DIT-1234 -- do not change the seeds without asking", "# the model folder", "# keep",
                    "# end of card"):
        assert comment in after, after  # old code: re-dumped the mapping, every comment gone
    h = yaml.safe_load(after)["approved_plan"]
    assert after.replace(f", approved_plan: {h}", "").replace(f', approved_plan: "{h}"', "") == text


def test_approve_block_card_keeps_the_comment_on_the_approved_plan_line(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    card.write_text(card.read_text() + "approved_plan: 0000  # approved by J. at review 12\n")
    run = _inspected_run(tmp_path, card)
    code, _, _ = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 0
    last = card.read_text().splitlines()[-1]
    assert last.endswith("# approved by J. at review 12") and "0000" not in last  # old code: comment deleted


def test_approve_refuses_another_models_run(tmp_path, capsys):
    mine = synthetic_card(tmp_path)
    other = synthetic_card(tmp_path, lambda d: d.update(name="other"), name="other.yaml")
    other.write_text(other.read_text() + "approved_plan: abcdef  # its own approval\n")
    run = _inspected_run(tmp_path, mine)  # a run (and plan) of model 'synthetic'
    before = other.read_text()
    code, _, err = cli(capsys, "approve", other, "--run", run.path, "--yes")
    assert code == 2 and "'synthetic'" in err and "'other'" in err  # old code: wrote synthetic's hash into it
    assert other.read_text() == before


def test_approve_refuses_a_card_that_fails_its_gate(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = _inspected_run(tmp_path, card)
    card.write_text(card.read_text().replace("FakeTransformer", "NoSuchTransformer"))
    before = card.read_text()
    code, _, err = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 2 and "gate check" in err and "NoSuchTransformer" in err  # old code: approved it
    assert card.read_text() == before


def test_approve_without_yes_and_no_terminal(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = _inspected_run(tmp_path, card)
    before = card.read_text()
    code, _, err = cli(capsys, "approve", card, "--run", run.path)
    assert code == 2 and "--yes" in err and card.read_text() == before


def test_approve_a_run_without_a_plan(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card)
    before = card.read_text()
    code, _, err = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 2 and card.read_text() == before


def test_approve_a_truncated_plan(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = _inspected_run(tmp_path, card)
    (run.stage_dir("inspect") / "plan.json").write_text('{"risks": [')
    before = card.read_text()
    code, _, err = cli(capsys, "approve", card, "--run", run.path, "--yes")
    assert code == 2 and "JSON" in err and card.read_text() == before


# ---------------------------------------------------------------------------------------------
# parallel


def test_parallel_nproc_above_the_gpus_present(tmp_path, capsys, zoo, monkeypatch):
    monkeypatch.setenv("DITBOOK_GPUS", "1")
    out = tmp_path / "pr"
    code, _, err = cli(capsys, "parallel", zoo_card(tmp_path, zoo), "--plan", "ulysses2", "--nproc", "2", "--out", out)
    assert code == 2 and "needs 2 GPUs, 1 present" in err
    assert not out.exists()  # nothing launched


def test_parallel_infeasible_plan_refused_without_a_run(tmp_path, capsys, zoo):
    out = tmp_path / "pr"
    code, _, err = cli(capsys, "parallel", zoo_card(tmp_path, zoo), "--plan", "ulysses3", "--nproc", "3", "--out", out)
    assert code == 3 and "ulysses3" in err and "not divisible" in err
    assert not out.exists()


def test_parallel_token_split_checked_before_launch_with_the_numbers(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo)
    assert cli(capsys, "inspect", card)[0] == 0  # an inspected run traced at the card's size
    out = tmp_path / "pr"
    code, _, err = cli(capsys, "parallel", card, "--plan", "ring3", "--nproc", "3", "--out", out)
    assert code == 3 and "16 image tokens" in err and "not divisible by 3" in err  # old code: 3 ranks launched
    assert not out.exists()


def test_parallel_unknown_plan_name(tmp_path, capsys, zoo):
    code, _, err = cli(capsys, "parallel", zoo_card(tmp_path, zoo), "--plan", "nosuch", "--nproc", "2",
                       "--out", tmp_path / "pr")
    assert code == 2 and "nosuch" in err


def test_parallel_world_size_and_nproc_disagree(tmp_path, capsys, zoo):
    code, _, err = cli(capsys, "parallel", zoo_card(tmp_path, zoo), "--plan", "ulysses2", "--nproc", "4",
                       "--out", tmp_path / "pr")
    assert code == 3 and "needs 2 processes" in err


def test_parallel_zero_processes(tmp_path, capsys, zoo):
    code, _, err = cli(capsys, "parallel", zoo_card(tmp_path, zoo), "--plan", "ulysses2", "--nproc", "0")
    assert code == 2 and "--nproc 0" in err


def test_parallel_into_a_finished_run(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo)
    run = make_run(tmp_path, card, status="finished")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "parallel", card, "--plan", "ulysses2", "--nproc", "2", "--run", run.path)
    assert code == 2 and "finished" in err
    assert snapshot(run.path) == before


def _approved_zoo_run(tmp_path, zoo, overrides=None):
    """A run of a copy of the zoo model whose plan (with the model's weights) the card approves."""
    from ditbook.approval import acceptance_gates, approve, plan_hash, weights_identity

    card = zoo_card(tmp_path, zoo, copy_model=True)
    c = load_card(card)
    run = RunFolder.create(c, tmp_path / "outputs", "approved", overrides=overrides)
    plan = {"model": c.name, "risks": [], "acceptance_gates": acceptance_gates(load_card(card, overrides)),
            "weights": weights_identity(c.path, [card])}
    (run.stage_dir("inspect") / "plan.json").write_text(json.dumps({**plan, "hash": plan_hash(plan)}))
    approve(c, run.stage_dir("inspect") / "plan.json")
    return card, run


def test_parallel_into_a_run_whose_weights_changed_since_approval(tmp_path, capsys, zoo):
    card, run = _approved_zoo_run(tmp_path, zoo)
    w = tmp_path / "flux" / "transformer" / "diffusion_pytorch_model.safetensors"
    w.write_bytes(w.read_bytes()[:-4] + b"\0\0\0\0")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "parallel", card, "--plan", "ulysses2", "--nproc", "2", "--run", run.path)
    assert code == 2 and "weights changed" in err  # old code: launched, wrote into the run, exit 0
    assert snapshot(run.path) == before


def test_parallel_into_a_run_without_an_approved_plan(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo)
    run = make_run(tmp_path, card)
    before = snapshot(run.path)
    code, _, err = cli(capsys, "parallel", card, "--plan", "ulysses2", "--nproc", "2", "--run", run.path)
    assert code == 2 and "ditbook approve" in err
    assert snapshot(run.path) == before


def test_parallel_into_a_run_refuses_overrides_that_contradict_the_runs(tmp_path, capsys, zoo):
    card, run = _approved_zoo_run(tmp_path, zoo, overrides={"generation.steps": 2})
    before = snapshot(run.path)
    code, _, err = cli(capsys, "parallel", card, "--plan", "ulysses2", "--nproc", "2", "--run", run.path,
                       "-p", "steps=3")
    assert code == 2 and "generation.steps=3" in err and "the run has 2" in err
    assert snapshot(run.path) == before


def test_parallel_into_another_models_run(tmp_path, capsys, zoo):
    card = zoo_card(tmp_path, zoo)
    run = make_run(tmp_path, synthetic_card(tmp_path))  # a run of model 'synthetic'
    code, _, err = cli(capsys, "parallel", card, "--plan", "ulysses2", "--nproc", "2", "--run", run.path)
    assert code == 2 and "'synthetic'" in err


def test_cache_on_a_run_uses_the_runs_own_overrides(tmp_path, capsys, monkeypatch):
    import ditbook.runner as runner

    card = synthetic_card(tmp_path)
    run = RunFolder.create(load_card(card, {"generation.steps": 2}), tmp_path / "outputs", "r",
                           overrides={"generation.steps": 2})
    seen = {}

    def execute_stage(stage, run, card, overrides, **kw):
        seen.update(overrides)
        return SimpleNamespace(status="failed", error="stopped by the test", failing_cell=None)

    monkeypatch.setattr(runner, "execute_stage", execute_stage)
    code, _, _ = cli(capsys, "cache", card, "--run", run.path)
    assert code == 1 and seen.get("generation.steps") == 2  # old code: the run's steps dropped


def test_a_linked_model_folder_never_puts_a_run_outside_the_outputs_root(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "synthetic").symlink_to(elsewhere)
    code, _, err = cli(capsys, "run", synthetic_card(tmp_path), "--stages", "intake", "--run-id", "r")
    assert code == 2 and "outside the outputs folder" in err
    assert list(elsewhere.iterdir()) == []  # old code: the run landed in elsewhere/r, exit 0


def test_a_stage_of_a_run_without_its_inspection_names_the_missing_stage(tmp_path):
    from ditbook.arch.report import ArchReport

    run = make_run(tmp_path, synthetic_card(tmp_path))  # approved elsewhere, never inspected itself
    with pytest.raises(FileNotFoundError, match="this run has no inspection.*run the inspect stage in this run"):
        ArchReport.load(run.stage_dir("inspect", create=False) / "arch.json")  # old code: a bare errno message


class _Table:
    def feasible_plans(self, n):
        return ["single", "ulysses2", "cfg2"] if n == 2 else ["single"]

    def check(self, p):
        return SimpleNamespace(feasible=True, launchable=True, reason="ok")


def test_stage_lists_plans_the_gpus_cannot_hold():
    from ditbook.parallel.stage import choose_plans

    run, not_run = choose_plans(_Table(), 2, present=1)
    assert run == []
    assert [r["name"] for r in not_run] == ["ulysses2", "cfg2"]
    assert all(r["reason"] == "not run: needs 2 GPUs, 1 present" for r in not_run)


def test_stage_runs_every_plan_when_the_gpus_are_there():
    from ditbook.parallel.stage import choose_plans

    assert choose_plans(_Table(), 2, present=2) == choose_plans(_Table(), 2, present=None) == (["ulysses2", "cfg2"], [])


def test_gpu_count_is_injectable(monkeypatch):
    from ditbook.parallel.launch import ranks_present

    assert ranks_present("cpu") is None  # gloo ranks on the CPU: any number
    monkeypatch.setenv("DITBOOK_GPUS", "1")
    assert ranks_present("cpu") == 1 and ranks_present("cuda") == 1
    monkeypatch.setenv("DITBOOK_GPUS", "one")
    with pytest.raises(ValueError, match="DITBOOK_GPUS"):
        ranks_present("cuda")


TORCHRUN_TAIL = """
[default0]:rank0 waiting
[default1]:ditbook parallel: rank 1 failed: RuntimeError: CUDA error: invalid device ordinal
[default1]:Traceback (most recent call last):
[default1]:  File "worker.py", line 199, in run
[default1]:RuntimeError: CUDA error: invalid device ordinal
W1201 api.py:1028] Sending process 14850 closing signal SIGTERM
E1201 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 14851) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
ditbook.parallel.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:10:22
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 14850)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14850
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:10:22
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 14851)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_rank_stopped_by_torchrun_is_not_the_cause():
    from ditbook.parallel.launch import _failure_message

    msg = _failure_message(TORCHRUN_TAIL, 1)
    assert msg.startswith("rank 1 failed")  # old code: "rank 0 ended (killed by signal 15)"
    assert "invalid device ordinal" in msg
    assert "rank 0 ended" not in msg and "stopped by torchrun" in msg


def _eight_rank_log(failing: int) -> str:
    blocks = []
    for r in range(8):
        if r != failing:
            blocks.append(f"[{len(blocks) + 1}]:\n  rank      : {r} (local_rank: {r})\n  exitcode  : -15 (pid: {100 + r})  (SIGTERM)\n")
    root = f"Root Cause (first observed failure):\n[0]:\n  rank      : {failing} (local_rank: {failing})\n  exitcode  : 1 (pid: 200)\n"
    lines = f"[default{failing}]:ditbook parallel: rank {failing} failed: ValueError: shapes do not match\n"
    return lines + "Failures:\n" + "".join(blocks) + "------\n" + root


def test_eight_ranks_root_cause_comes_first():
    from ditbook.parallel.launch import _failure_message

    msg = _failure_message(_eight_rank_log(5), 1)
    assert msg.startswith("rank 5 failed (exit code 1)") and "shapes do not match" in msg
    assert "ranks 0, 1, 2, 3, 4, 6, 7 stopped by torchrun" in msg


def test_every_rank_stopped_from_outside():
    from ditbook.parallel.launch import _failure_message

    log = "Failures:\n" + "".join(f"  rank      : {r} (local_rank: {r})\n  exitcode  : -15 (pid: 1)\n" for r in range(2))
    assert "every rank was stopped by SIGTERM" in _failure_message(log, 1)


def test_a_killed_rank_is_named_before_the_peer_that_noticed():
    from ditbook.parallel.launch import _failure_message

    log = ("[default0]:ditbook parallel: rank 0 failed: RuntimeError: Connection closed by peer\n"
           "Failures:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 11)  (SIGKILL)\n"
           "Root Cause (first observed failure):\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 10)\n")
    msg = _failure_message(log, 1)
    assert msg.startswith("rank 1 ended (killed by signal 9)") and "Connection closed by peer" in msg


# ---------------------------------------------------------------------------------------------
# cache


def test_cache_unknown_strategy_on_a_finished_run(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card, status="finished")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "cache", card, "--run", run.path, "--strategies", "nosuch")
    assert code == 2 and "nosuch" in err  # old code: exit 0, the finished run's cache results rewritten
    assert snapshot(run.path) == before


def test_cache_known_strategy_on_a_finished_run(tmp_path, capsys):
    from ditbook import accel

    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card, status="finished")
    before = snapshot(run.path)
    code, _, err = cli(capsys, "cache", card, "--run", run.path, "--strategies", accel.names("cache")[0])
    assert code == 2 and "finished" in err
    assert snapshot(run.path) == before


def test_cache_empty_strategy_list(tmp_path, capsys):
    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card)
    code, _, err = cli(capsys, "cache", card, "--run", run.path, "--strategies", ",")
    assert code == 2 and "strateg" in err


def test_cache_on_a_run_another_process_writes(tmp_path, capsys):
    from ditbook import accel

    card = synthetic_card(tmp_path)
    run = make_run(tmp_path, card)
    before = snapshot(run.path)
    holder = sleeper()
    try:
        run.lock_path.write_text(f"{holder.pid} ditbook run\n")
        code, _, err = cli(capsys, "cache", card, "--run", run.path, "--strategies", accel.names("cache")[0])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and f"process {holder.pid}" in err
    assert snapshot(run.path) == before


def _cache_session(monkeypatch, passed: bool):
    import ditbook.cache.stage as cs

    floor = {"rerun_vs_intake": {"passed": passed, "reasons": [] if passed else ["p0_s0: PSNR 11.2 dB < 30"]}}
    monkeypatch.setattr(cs, "noise_floor", lambda *a, **k: (floor, {}, {}))
    monkeypatch.setattr(cs, "counted_render", lambda *a, **k: ({}, {}))
    card = SimpleNamespace(generation=SimpleNamespace(prompts=["a"], seeds=[0], holdout_prompts=[], holdout_seeds=[]),
                           cache=CacheSettings())
    s = cs.CacheSession(ctx=SimpleNamespace(card=card), report=None, pipe=None, adapter=None, gates=None, baseline={})
    return s, cs


def test_failed_noise_floor_stops_the_cache_stage(monkeypatch):
    s, cs = _cache_session(monkeypatch, passed=False)
    with pytest.raises(cs.NoiseFloorError, match="PSNR 11.2"):
        s.noise_floor()


def test_passing_noise_floor_goes_on(monkeypatch):
    """A passing floor goes on to render the held-out references (the card's seeds shifted by
    ``cache.holdout_shift``, every later quality claim is judged on them) and keeps them."""
    s, cs = _cache_session(monkeypatch, passed=True)
    asked, refs = [], {"p0_s1000": "held-out image"}
    monkeypatch.setattr(cs, "counted_render", lambda pipe, card, adapter, prompts, seeds: (
        asked.append((list(prompts), list(seeds))), (refs, {"p0_s1000": 3}))[1])
    floor = s.noise_floor()
    assert floor["rerun_vs_intake"]["passed"] and s.floor is floor
    shift = s.card.cache.holdout_shift
    assert shift and asked == [(["a"], [0 + shift])], asked
    assert s.holdout_refs is refs and s.holdout_counts == {"p0_s1000": 3}


# ---------------------------------------------------------------------------------------------
# intake: bad baselines stop the stage


def _render(image, key="p0_s0"):
    return SimpleNamespace(key=key, prompt="a red circle", seed=0, image=image)


def test_nan_baseline_is_named():
    from ditbook.intake.stage import BaselineError, check_baseline

    img = np.random.default_rng(0).random((8, 8, 3)).astype(np.float32)
    img[2, 3, 1] = np.nan
    with pytest.raises(BaselineError, match="p0_s1.*NaN/Inf"):
        check_baseline([_render(np.zeros((8, 8, 3)) + 0.5 + 0.1 * np.eye(8)[..., None], "p0_s0"), _render(img, "p0_s1")])


def test_inf_baseline_is_named():
    from ditbook.intake.stage import BaselineError, check_baseline

    img = np.full((8, 8, 3), np.inf, dtype=np.float32)
    with pytest.raises(BaselineError, match="p0_s0.*NaN/Inf"):
        check_baseline([_render(img)])


def test_blank_baseline_is_named():
    from ditbook.intake.stage import BaselineError, check_baseline

    with pytest.raises(BaselineError, match="blank"):
        check_baseline([_render(np.zeros((8, 8, 3), dtype=np.float32))])


def test_a_real_picture_passes():
    from ditbook.intake.stage import check_baseline

    check_baseline([_render(np.random.default_rng(1).random((8, 8, 3)))])


def test_intake_of_a_transformer_returning_nan_writes_no_results(tmp_path):
    from synthetic_run import FakePipeline
    from ditbook.intake.stage import BaselineError, run_intake

    card_path = synthetic_card(tmp_path)
    card = load_card(card_path)
    run = RunFolder.create(card, tmp_path / "outputs", "nan")
    pipe = FakePipeline()
    pipe.transformer.forward = lambda hidden_states, timestep=None: hidden_states * float("nan")
    ctx = SimpleNamespace(card=card, run=run, placement=SimpleNamespace(to_dict=lambda: {}),
                          dir=run.stage_dir("intake"), load_pipeline=lambda: pipe,
                          write_results=lambda r: run.write_results("intake", r))
    with pytest.raises(BaselineError, match="NaN"):
        run_intake(ctx)
    assert not run.has_results("intake")


# ---------------------------------------------------------------------------------------------
# the CLI's own error paths


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["--debug", "run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "not a run folder" in err


def test_unexpected_error_is_one_line(monkeypatch, capsys):
    import ditbook.cli as cli_module

    def boom(args):
        raise RuntimeError("a bug deep inside")

    monkeypatch.setattr(cli_module, "cmd_stages", boom)
    code, _, err = cli(capsys, "stages")
    assert code == 1 and "RuntimeError: a bug deep inside" in err and "--debug" in err
    assert len(err.strip().splitlines()) == 1


def test_keyboard_interrupt_is_one_line(monkeypatch, capsys):
    import ditbook.cli as cli_module

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "cmd_stages", interrupted)
    code, _, err = cli(capsys, "stages")
    assert code == 130 and "interrupted" in err and len(err.strip().splitlines()) == 1


def test_signal_handlers_are_restored_after_a_command(capsys):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["stages"]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# ---------------------------------------------------------------------------------------------
# signals with real processes


def _env(tmp_path: Path, **extra) -> dict:
    # the synthetic card's classes live in tests/synthetic_run.py: the child imports them from there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LIB), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "DITBOOK_OUTPUTS": str(tmp_path / "outputs")}
    env.pop("DITBOOK_GPUS", None)
    env.update(extra)
    return env


def _alive(pids) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_for(pred, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _parallel_proc(tmp_path, zoo, *extra):
    card = zoo_card(tmp_path, zoo)
    return subprocess.Popen([sys.executable, "-m", "ditbook", "parallel", str(card), "--plan", "ulysses2", "--nproc", "2",
                             "--timeout", "60", "-p", "generation.steps=200", "-p", "device=cpu", *map(str, extra)],
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks_of(proc) -> list[int]:
    """The pids below ``proc`` once its two ranks are up (torchrun and both ranks)."""
    import psutil

    def ranks_up():
        kids = psutil.Process(proc.pid).children(recursive=True)
        workers = [k for k in kids if "ditbook.parallel.worker" in " ".join(k.cmdline())]
        return kids if len(workers) >= 2 else None

    pids = [k.pid for k in _wait_for(ranks_up, 120, "two ranks")]
    time.sleep(2)  # the ranks are loading / rendering
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_sigint_or_sighup_on_ditbook_parallel_ends_torchrun_and_its_ranks(tmp_path, zoo, sig):
    out = tmp_path / "pr"
    proc = _parallel_proc(tmp_path, zoo, "--out", out)
    try:
        pids = _ranks_of(proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err  # old code: SIGHUP had no handler, ditbook exited 129, ranks ran on
    assert "Traceback" not in err and f"interrupted by {sig.name}" in err
    assert _alive(pids) == [], f"left running: {_alive(pids)}"
    assert not (out / "worker.json").exists()
    assert not (out / "torchrun-logs").exists()  # torchrun's log folder goes with the launch


@pytest.mark.slow
def test_sigkill_of_ditbook_parallel_ends_torchrun_and_its_ranks_within_10s(tmp_path, zoo):
    out = tmp_path / "pr"
    proc = _parallel_proc(tmp_path, zoo, "--out", out)
    try:
        pids = _ranks_of(proc)
        proc.kill()  # no handler runs: the kernel's parent-death signal and the ranks' watch do the work
        proc.wait(timeout=10)
        _wait_for(lambda: not _alive(pids), 10, "torchrun and the ranks to end")  # old code: they ran on
    finally:
        import psutil

        for pid in _alive(pids if "pids" in locals() else []):
            psutil.Process(pid).kill()
    before = snapshot(out)
    time.sleep(1)
    assert snapshot(out) == before and not (out / "worker.json").exists()


_MIDDLE = """
import os, subprocess, sys, time
from ditbook.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, preexec_fn=die_with_parent(),
                         env={**os.environ, "DITBOOK_LAUNCHER_PID": str(os.getpid())})  # as launch() sets it
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("grandchild", [
    "import time; time.sleep(60)",  # dies by the parent-death signal set in preexec
    # a child of the child (a rank of torchrun): its own watch on its parent ends it
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    "'from ditbook.processes import watch_parent; import time; watch_parent(0.1); time.sleep(60)']); time.sleep(60)",
])
def test_children_in_their_own_session_die_with_a_killed_parent(tmp_path, grandchild):
    import psutil

    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE, grandchild], env=_env(tmp_path), stdout=subprocess.PIPE,
                              text=True)
    child = psutil.Process(int(middle.stdout.readline()))
    # the middle process dies at once, maybe before the grandchild (a rank) has started its watch
    tree = [child] + _wait_for(lambda: child.children() if "subprocess" in grandchild else [child], 20, "the tree")
    tree = list({p.pid: p for p in tree}.values())
    middle.kill()
    middle.wait()
    try:
        _wait_for(lambda: not _alive([p.pid for p in tree]), 10, "the children to end")
    finally:
        for p in tree:
            if p.is_running():
                p.kill()


def _notebook(path: Path, body: str) -> None:
    nb = nbf.v4.new_notebook()
    params = nbf.v4.new_code_cell('CARD = ""\nRUN_DIR = ""\nOVERRIDES = {}\nINTERACTIVE = False')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbf.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, path)


@pytest.mark.slow
def test_sigterm_on_ditbook_run_ends_the_kernel_and_its_session_then_resume_continues(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(nbs / "01_first.ipynb", "import pathlib\n(pathlib.Path(RUN_DIR) / 'first.txt').write_text('done')")
    # the second stage starts a child in a session of its own (as launch starts torchrun) and waits
    _notebook(nbs / "02_second.ipynb", """
import os, pathlib, subprocess, sys, time
flag = pathlib.Path(os.environ["DITBOOK_TEST_HANG"])
if flag.exists():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    (pathlib.Path(RUN_DIR) / "child.pid").write_text(str(child.pid))
    time.sleep(120)
(pathlib.Path(RUN_DIR) / "second.txt").write_text("done")
""")
    hang = tmp_path / "hang.flag"
    hang.write_text("1")
    card = synthetic_card(tmp_path)
    env = _env(tmp_path, DITBOOK_NOTEBOOKS=str(nbs), DITBOOK_TEST_HANG=str(hang))
    proc = subprocess.Popen([sys.executable, "-m", "ditbook", "run", str(card), "--run-id", "r"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = RunFolder(tmp_path / "outputs" / "synthetic" / "r")
    try:
        pid_file = run.path / "child.pid"
        _wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 180, "the stage's child")
        child = int(pid_file.read_text())
        import psutil

        ours = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)] + [child]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted by SIGTERM" in err and "--resume" in err
    assert _alive(ours) == [], f"left running: {_alive(ours)}"
    meta = run.read_meta()
    assert meta["status"] == "interrupted"
    assert meta["stages"]["first"]["status"] == "passed" and meta["stages"]["second"]["status"] == "interrupted"
    assert (run.path / "first.txt").read_text() == "done"
    assert not run.lock_path.exists()

    hang.unlink()
    done = subprocess.run([sys.executable, "-m", "ditbook", "run", "--resume", str(run.path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    meta = run.read_meta()
    assert meta["status"] == "finished" and meta["stages"]["second"]["status"] == "passed"
    assert (run.path / "second.txt").read_text() == "done"


@pytest.mark.slow
def test_the_kernels_connection_file_lies_in_the_stage_temp_folder_and_goes_with_it(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(nbs / "01_only.ipynb", "import pathlib\nfrom ipykernel import get_connection_file\n"
                                     "(pathlib.Path(RUN_DIR) / 'cf.txt').write_text(get_connection_file())")
    env = _env(tmp_path, DITBOOK_NOTEBOOKS=str(nbs))
    done = subprocess.run([sys.executable, "-m", "ditbook", "run", str(synthetic_card(tmp_path)), "--run-id", "r"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cf = Path((tmp_path / "outputs" / "synthetic" / "r" / "cf.txt").read_text())
    assert cf.parent.name.startswith("ditbook-kernel-")  # old code: the user's jupyter runtime folder
    assert not cf.parent.exists()

