"""The shipped reference model learned: prompts steer color and position, true CFG runs as two
calls per step, and the first block's residual changes slowly between steps (trained range),
unlike the same architecture random-initialized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ditbook.zoo import shapes
from ditbook.zoo.residual_change import first_block_residual_changes

CARD = Path(__file__).resolve().parent.parent / "models" / "reference.yaml"
STEPS = 12  # fewer than the card's 20, to keep the tests fast; the model is fine at both


@pytest.fixture(scope="module")
def reference():
    from ditbook.card import gate_check
    from ditbook.loading import load_pipeline

    card = gate_check(CARD)
    return load_pipeline(card), card


def _image(pipe, card, prompt, seed=0, steps=STEPS, **kwargs):
    out = pipe(
        prompt,
        height=card.generation.height,
        width=card.generation.width,
        num_inference_steps=steps,
        guidance_scale=card.generation.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        **card.generation.extra,
        **kwargs,
    )
    return out.images[0]


def test_card_and_size():
    from ditbook.card import gate_check

    card = gate_check(CARD)
    assert card.path == (CARD.parent / "reference" / "pipeline").resolve()
    total = sum(f.stat().st_size for f in card.path.rglob("*") if f.is_file())
    assert total <= 30e6, f"reference weights are {total / 1e6:.1f} MB"


def test_prompts_steer_color_and_position(reference):
    pipe, card = reference
    red_left = _image(pipe, card, "a red circle on the left")
    blue_center = _image(pipe, card, "a blue square in the center")
    green_right = _image(pipe, card, "a green triangle on the right", seed=1)
    for img, color in [(red_left, "red"), (blue_center, "blue"), (green_right, "green")]:
        fractions = shapes.color_fractions(img)
        assert max(fractions, key=fractions.get) == color, fractions
        assert fractions[color] > 0.6, fractions
    assert shapes.horizontal_center(red_left) < 0.35
    assert 0.4 < shapes.horizontal_center(blue_center) < 0.6
    assert shapes.horizontal_center(green_right) > 0.65


def test_true_cfg_runs_two_calls_per_step(reference):
    pipe, card = reference
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        cfg = _image(pipe, card, "a yellow circle in the center", negative_prompt="", true_cfg_scale=3.0)
    finally:
        handle.remove()
    assert len(calls) == 2 * STEPS
    plain = _image(pipe, card, "a yellow circle in the center")
    fractions = shapes.color_fractions(cfg)
    assert np.isfinite(cfg).all() and max(fractions, key=fractions.get) == "yellow", fractions
    assert np.abs(cfg - plain).mean() > 1e-3, "true CFG changed nothing"


def test_first_block_residual_change_is_in_trained_range(reference):
    from ditbook.zoo import flux, train_reference

    pipe, card = reference
    kwargs = dict(
        prompt="a purple square on the left",
        height=64,
        width=64,
        num_inference_steps=20,
        max_sequence_length=16,
        output_type="np",
    )
    trained = first_block_residual_changes(pipe, generator=torch.Generator().manual_seed(0), **kwargs)
    assert len(trained) == 19
    assert 0.03 < float(np.median(trained)) < 0.15, trained
    assert float(np.mean(trained)) < 0.2, trained

    random_pipe = flux.build_pipeline(train_reference.SIZE, seed=0)
    random_pipe.set_progress_bar_config(disable=True)
    untrained = first_block_residual_changes(random_pipe, generator=torch.Generator().manual_seed(0), **kwargs)
    assert float(np.median(untrained)) > 2 * float(np.median(trained)), (untrained, trained)


def test_training_command_runs_end_to_end_tiny(tmp_path):
    """The documented training entry point, with a tiny schedule: saves a loadable pipeline
    and its training record."""
    import json

    from diffusers import FluxPipeline, FluxTransformer2DModel

    from ditbook.zoo import train_reference

    out = tmp_path / "reference" / "pipeline"
    train_reference.main(
        ["--out", str(out), "--images", "64", "--vae-steps", "2", "--vae-batch", "4", "--steps", "2", "--batch", "8"]
    )
    record = json.loads((tmp_path / "reference" / "training.json").read_text())
    assert record["config"]["steps"] == 2 and record["config"]["seed"] == 0
    assert record["transformer_params"] > 1e6 and record["folder_mb"] < 30
    transformer = FluxTransformer2DModel.from_pretrained(str(out), subfolder="transformer")
    pipe = FluxPipeline.from_pretrained(str(out), transformer=transformer)
    assert pipe.vae.config.scaling_factor != 1.0, "scaling factor set from the trained VAE's latents"
