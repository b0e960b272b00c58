"""Reference intake: license and model card found in the model folder (or said missing), the
pipeline's defaults from its signature, the exact baseline command (re-run here: it reproduces
the baseline; a dropped argument does not), and ``device: cuda`` on a machine without a GPU
stopping with a named error instead of falling back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ditbook.settings import RuntimeSettings

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_cache import tiny_card  # noqa: E402


def _intake(card, outputs):
    from ditbook.context import open_stage
    from ditbook.intake.stage import run_intake

    ctx = open_stage(str(card), None, "intake", {}, outputs_root=outputs)
    result, pipe = run_intake(ctx)
    return ctx, result, pipe


def test_reference_found_defaults_and_exact_command(tmp_path):
    from ditbook.render import make_generator, to_image

    card = tiny_card(tmp_path, steps=4, seeds=(3,), prompts=("a red square",))
    model = tmp_path / "model"
    (model / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: tiny/upstream\n---\n# Tiny GQA\n\ntext\n")
    (model / "LICENSE").write_text("Apache License\nVersion 2.0\n")
    index = json.loads((model / "model_index.json").read_text())
    index["_name_or_path"] = "tiny/upstream"
    (model / "model_index.json").write_text(json.dumps(index))
    ctx, result, pipe = _intake(card, tmp_path / "outputs")
    ref = result.reference
    assert json.loads((ctx.dir / "reference.json").read_text()) == json.loads(json.dumps(ref, default=str))
    assert ref["model_card"]["found"] and ref["model_card"]["title"] == "Tiny GQA"
    assert ref["license"]["declared"] == "apache-2.0" and ref["license"]["files"] == ["LICENSE"]
    assert ref["model_index"]["_name_or_path"] == "tiny/upstream"
    # the defaults of TinyPipeline.__call__, read from its signature
    d = ref["pipeline_defaults"]
    assert (d["num_inference_steps"], d["height"], d["width"]) == (8, 16, 16)
    assert ref["card_differs"] == ["generation.steps 4 (pipeline default num_inference_steps=8)"]
    assert ref["placement"]["chosen"] == "cpu"
    cli = ref["baseline_command"]["cli"]
    assert cli.startswith("ditbook run ") and str(card) in cli and "--stages intake" in cli
    # the recorded call is exact: re-running it gives the baseline bit for bit ...
    kwargs = ref["baseline_command"]["call_kwargs"]
    base = np.load(ctx.dir / result.images[0].npy)
    again = to_image(pipe(prompt="a red square", generator=make_generator(3), **kwargs))
    assert np.array_equal(again, base)
    # ... and a call that drops an argument (the pipeline default steps instead) does not
    dropped = {k: v for k, v in kwargs.items() if k != "num_inference_steps"}
    assert not np.allclose(to_image(pipe(prompt="a red square", generator=make_generator(3), **dropped)), base)


def test_reference_says_when_nothing_was_found(tmp_path):
    from ditbook.intake.reference import read_license, read_model_card, read_model_index

    card = tiny_card(tmp_path)
    model = tmp_path / "model"
    doc = read_model_card(model)
    assert not doc["found"] and "no model card" in doc["note"]
    lic = read_license(model, doc)
    assert not lic["found"] and "no license found" in lic["note"]
    assert read_model_index(model)["_name_or_path"] is None  # save_pretrained records none
    # a README that declares no license is a card without a license
    (model / "README.md").write_text("# a model\n")
    doc = read_model_card(model)
    assert doc["found"] and not read_license(model, doc)["found"]
    assert card.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_gpu_is_a_named_error(tmp_path):
    from ditbook.context import open_stage
    from ditbook.loading import DeviceUnavailableError, choose_placement

    card = tiny_card(tmp_path)
    data = yaml.safe_load(card.read_text())
    data["runtime"]["device"] = "cuda"
    card.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(DeviceUnavailableError, match=r"runtime\.device is 'cuda'"):
        open_stage(str(card), None, "intake", {}, outputs_root=tmp_path / "outputs")
    with pytest.raises(DeviceUnavailableError, match="runtime.device"):
        choose_placement(device="cuda:1")
    # auto still picks the CPU, and the intake records why
    assert choose_placement(device="auto").device == "cpu"
    from ditbook.intake.reference import placement_facts
    from types import SimpleNamespace

    ctx = SimpleNamespace(card=SimpleNamespace(runtime=RuntimeSettings(device="auto")), placement=choose_placement(device="auto"))
    assert "no CUDA device" in placement_facts(ctx)["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_names_runtime_device(tmp_path):
    import subprocess

    card = tiny_card(tmp_path)
    data = yaml.safe_load(card.read_text())
    data["runtime"]["device"] = "cuda"
    card.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "ditbook", "inspect", str(card)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "runtime.device" in proc.stdout + proc.stderr


def test_auto_dtype_is_bf16_on_cuda_only_for_a_diffusers_pipeline(tmp_path, monkeypatch):
    """A pipeline from the user's own code makes its tensors in its own dtype (the FLUX, SD3.5 and
    minRF reference samplers pass fp32 latents; a bf16 model's first layer refused them on the GPU):
    ``auto`` keeps fp32 there; a diffusers pipeline casts what it hands the transformer: bf16."""
    import torch

    from ditbook.card import load_card
    from ditbook.loading import choose_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    own = load_card(str(tiny_card(tmp_path)), {})  # TinyPipeline from a .py file
    assert own.pipeline.source != "diffusers" and choose_placement(own, device="cuda").dtype == "float32"
    diffusers_card = load_card(str(Path(__file__).resolve().parents[1] / "models" / "reference.yaml"), {})
    assert choose_placement(diffusers_card, device="cuda").dtype == "bfloat16"
    assert choose_placement(own, device="cuda", dtype="bfloat16").dtype == "bfloat16"  # the card or caller decides
