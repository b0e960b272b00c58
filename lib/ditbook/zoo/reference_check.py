"""Evidence that the reference model learned: prompts steer color and position, true CFG runs,
and the first block's residual changes slowly between steps, as in a trained DiT.

    python -m ditbook.zoo.reference_check models/reference/pipeline
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from . import shapes
from .residual_change import first_block_residual_changes
from .train_reference import MAX_SEQUENCE_LENGTH

PROBES = [
    ("a red circle on the left", "red", 0.25),
    ("a blue square in the center", "blue", 0.5),
    ("a green triangle on the right", "green", 0.75),
    ("a yellow circle in the center", "yellow", 0.5),
    ("a purple square on the left", "purple", 0.25),
]


def load_reference(path: str | Path, device: str = "cpu"):
    """Load the saved reference pipeline the way ditbook loads a card: transformer first."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(str(path), subfolder="transformer")
    pipe = FluxPipeline.from_pretrained(str(path), transformer=transformer).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompt: str, seed: int = 0, steps: int = 20, **kwargs) -> np.ndarray:
    """One 64x64 image (H, W, 3) in [0, 1]."""
    kwargs.setdefault("guidance_scale", 3.5)
    return pipe(prompt, **_call(steps, seed), **kwargs).images[0]


def _call(steps: int, seed: int) -> dict:
    """The pipeline call's keywords: 64x64, ``steps`` steps, the seeded CPU generator, numpy output."""
    return dict(height=64, width=64, num_inference_steps=steps, max_sequence_length=MAX_SEQUENCE_LENGTH,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="np")


def check(pipe, seeds=(0, 1), steps: int = 20) -> dict:
    rows = []
    for prompt, color, x in PROBES:
        for seed in seeds:
            img = generate(pipe, prompt, seed, steps)
            fractions = shapes.color_fractions(img)
            rows.append({"prompt": prompt, "seed": seed, "dominant_color": max(fractions, key=fractions.get),
                         "expected_color": color, "x_center": round(shapes.horizontal_center(img), 3),
                         "expected_x": x})
    changes = first_block_residual_changes(pipe, prompt=PROBES[0][0], **_call(steps, 0))
    cfg_img = generate(pipe, PROBES[0][0], 0, steps, negative_prompt="", true_cfg_scale=3.0)
    cfg_fr = shapes.color_fractions(cfg_img)
    return {
        "color_accuracy": float(np.mean([r["dominant_color"] == r["expected_color"] for r in rows])),
        "position_accuracy": float(np.mean([abs(r["x_center"] - r["expected_x"]) < 0.125 for r in rows])),
        "residual_change_steps": steps,
        "residual_change_mean": float(np.mean(changes)),
        "residual_change_median": float(np.median(changes)),
        "residual_change_min": float(np.min(changes)),
        "residual_change_max": float(np.max(changes)),
        "residual_changes": [round(c, 4) for c in changes],
        "true_cfg_dominant_color": max(cfg_fr, key=cfg_fr.get),
        "rows": rows,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sheet", type=Path, default=None, help="write a contact sheet PNG here")
    args = parser.parse_args(argv)
    pipe = load_reference(args.path)
    result = check(pipe, steps=args.steps)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    for r in result["rows"]:
        print(r)
    if args.sheet:
        from PIL import Image

        imgs = [generate(pipe, p, s, args.steps) for p, _, _ in PROBES for s in (0, 1, 2)]
        row = [np.concatenate(imgs[i : i + 3], 1) for i in range(0, len(imgs), 3)]
        Image.fromarray((np.concatenate(row, 0) * 255).round().astype(np.uint8)).save(args.sheet)


if __name__ == "__main__":
    main()
