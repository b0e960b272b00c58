"""The video reference model's parts: the clip renderer draws the motion its prompt names
(deterministically), the check judges color and direction and fails on wrong clips, the quick
training schedule saves a WanPipeline that loads offline and generates a clip, and the card
refuses to pass without its weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ditbook.zoo import moving_shapes
from ditbook.zoo.video_reference_check import judge, summarize

CARD = Path(__file__).resolve().parent.parent / "models" / "video_reference.yaml"


def test_renderer_is_deterministic_and_shows_the_prompted_motion():
    clips, order, scenes = moving_shapes.dataset(120, seed=3)
    again, order2, _ = moving_shapes.dataset(120, seed=3)
    other, _, _ = moving_shapes.dataset(120, seed=4)
    assert clips.shape == (120, moving_shapes.FRAMES, moving_shapes.SIZE, moving_shapes.SIZE, 3)
    assert clips.dtype == np.uint8
    assert order == order2 and np.array_equal(clips, again)
    assert not np.array_equal(clips, other)
    assert len(scenes) == 60 and len({s.prompt for s in scenes}) == 60
    assert {scenes[i].direction for i in order} == set(moving_shapes.DIRECTIONS)
    for clip, i in zip(clips, order):
        seen = moving_shapes.motion(clip)
        assert (seen["color"], seen["direction"]) == (scenes[i].color, scenes[i].direction), (scenes[i], seen)
        assert max(abs(seen["dx"]), abs(seen["dy"])) > 0.35  # about half the picture


def test_motion_refuses_a_still_or_vanished_shape():
    rng = np.random.default_rng(0)
    clip = moving_shapes.render(moving_shapes.MovingScene("circle", "red", "left"), rng)
    still = np.repeat(clip[:1], len(clip), axis=0)
    assert moving_shapes.motion(still)["direction"] is None
    gone = clip.copy()
    gone[4] = moving_shapes.BACKGROUND
    assert moving_shapes.motion(gone)["direction"] is None


@pytest.mark.parametrize("direction,reverse", [("right", "left"), ("left", "right"), ("up", "down"), ("down", "up")])
def test_check_fails_reversed_and_wrong_color_clips(direction, reverse):
    clip = moving_shapes.render(moving_shapes.MovingScene("square", "green", direction), np.random.default_rng(1))
    right = judge(clip, "green", direction)
    assert right["color_ok"] and right["motion_ok"]
    backwards = judge(clip[::-1], "green", direction)
    assert backwards["color_ok"] and not backwards["motion_ok"] and backwards["direction"] == reverse
    wrong_color = judge(moving_shapes.render(moving_shapes.MovingScene("square", "blue", direction),
                                             np.random.default_rng(1)), "green", direction)
    assert wrong_color["motion_ok"] and not wrong_color["color_ok"]
    summary = summarize([right, backwards, wrong_color])
    assert summary["accuracy"] == pytest.approx(1 / 3)
    assert summary["color_accuracy"] == pytest.approx(2 / 3) and summary["motion_accuracy"] == pytest.approx(2 / 3)


def test_quick_training_saves_a_pipeline_that_loads_offline_and_generates(tmp_path, monkeypatch):
    from ditbook.zoo import train_video_reference
    from ditbook.zoo.video_reference_check import generate, load_reference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "video_reference" / "pipeline"
    record = train_video_reference.main(["--quick", "--clips", "8", "--out", str(out)])
    saved = json.loads((tmp_path / "video_reference" / "training.json").read_text())
    assert saved["config"]["steps"] == 2 and saved["config"]["clips"] == 8 and saved["config"]["seed"] == 0
    assert saved["command"].startswith("python -m ditbook.zoo.train_video_reference --quick")
    assert record["transformer_params"] > 5e5 and record["folder_mb"] < 30

    pipe = load_reference(out)
    vae = pipe.vae.config
    assert len(vae.latents_mean) == len(vae.latents_std) == vae.z_dim
    assert vae.latents_std != [1.0] * vae.z_dim, "latents_std was not set from the trained VAE's latents"
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        clip = generate(pipe, "a red circle moving right", steps=2)
    finally:
        handle.remove()
    assert len(calls) == 4, "Wan's CFG: two transformer calls per step"
    assert clip.shape == (moving_shapes.FRAMES, moving_shapes.SIZE, moving_shapes.SIZE, 3)
    assert np.isfinite(clip).all()


def test_card_names_path_until_the_weights_exist(tmp_path):
    from ditbook.card import GateError, gate_check, gate_problems

    weights = CARD.parent / "video_reference" / "pipeline"
    if weights.exists():
        card = gate_check(CARD)
        assert card.pipeline.cls == "WanPipeline" and card.generation.extra["num_frames"] == 9
        return
    _, problems = gate_problems(CARD)
    assert len(problems) == 1 and problems[0].startswith("path:"), problems
    with pytest.raises(GateError, match="path"):
        gate_check(CARD)
    # with a folder at the card's path, nothing else is missing
    copy = tmp_path / CARD.name
    copy.write_text(CARD.read_text())
    (tmp_path / "video_reference" / "pipeline").mkdir(parents=True)
    card = gate_check(copy)
    assert card.generation.extra == {"num_frames": 9, "max_sequence_length": 24}
    assert card.generation.negative_prompt and card.generation.guidance_scale > 1
