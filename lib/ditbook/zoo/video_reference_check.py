"""Evidence that the video reference model learned: each prompt's clip has the prompt's color
and its shape moves the prompt's way (the centroid of the colored pixels across frames), with
Wan's CFG (two transformer calls per step, the negative prompt in the second).

    python -m ditbook.zoo.video_reference_check models/video_reference/pipeline [--sheet sheet.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from . import moving_shapes
from .train_video_reference import MAX_SEQUENCE_LENGTH, NEGATIVE_PROMPT

PROBES = [
    ("a red circle moving right", "red", "right"),
    ("a blue square moving left", "blue", "left"),
    ("a green triangle moving up", "green", "up"),
    ("a yellow circle moving down", "yellow", "down"),
    ("a purple square moving right", "purple", "right"),
    ("a red triangle moving down", "red", "down"),
]
GUIDANCE = 5.0


def load_reference(path: str | Path, device: str = "cpu"):
    """Load the saved pipeline the way ditbook loads a card: transformer first."""
    from diffusers import WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(str(path), subfolder="transformer")
    pipe = WanPipeline.from_pretrained(str(path), transformer=transformer).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompt: str, seed: int = 0, steps: int = 20, **kwargs) -> np.ndarray:
    """One clip (frames, H, W, 3) in [0, 1]."""
    kwargs.setdefault("guidance_scale", GUIDANCE)
    kwargs.setdefault("negative_prompt", NEGATIVE_PROMPT)
    return pipe(prompt, height=moving_shapes.SIZE, width=moving_shapes.SIZE, num_frames=moving_shapes.FRAMES,
                num_inference_steps=steps, max_sequence_length=MAX_SEQUENCE_LENGTH,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).frames[0]


def judge(clip: np.ndarray, color: str, direction: str) -> dict:
    """One clip against what its prompt asked: the measured color/direction and whether each is right."""
    seen = moving_shapes.motion(clip)
    return {**seen, "expected_color": color, "expected_direction": direction,
            "color_ok": seen["color"] == color, "motion_ok": seen["direction"] == direction}


def summarize(rows: list[dict]) -> dict:
    """Shares right over judged clips: color, motion, and both at once."""
    return {"clips": len(rows), "color_accuracy": float(np.mean([r["color_ok"] for r in rows])),
            "motion_accuracy": float(np.mean([r["motion_ok"] for r in rows])),
            "accuracy": float(np.mean([r["color_ok"] and r["motion_ok"] for r in rows]))}


def check(pipe, seeds=(0, 1), steps: int = 20, probes=PROBES) -> dict:
    rows = []
    for prompt, color, direction in probes:
        for seed in seeds:
            rows.append({"prompt": prompt, "seed": seed, **judge(generate(pipe, prompt, seed, steps), color, direction)})
    return {**summarize(rows), "steps": steps, "guidance_scale": GUIDANCE, "rows": rows}


def contact_sheet(clips: list[np.ndarray]) -> np.ndarray:
    """One row per clip, its frames side by side, 1-pixel white gaps: (rows*H, F*W, 3) uint8."""
    rows = []
    for clip in clips:
        f, h, w, _ = clip.shape
        row = np.ones((h + 1, f * (w + 1), 3), dtype=np.float32)
        for i in range(f):
            row[:h, i * (w + 1) : i * (w + 1) + w] = clip[i]
        rows.append(row)
    return (np.concatenate(rows, 0) * 255).round().astype(np.uint8)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sheet", type=Path, default=None, help="write a contact sheet PNG here (probes x seeds 0, 1)")
    args = parser.parse_args(argv)
    pipe = load_reference(args.path, args.device)
    result = check(pipe, steps=args.steps)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    for r in result["rows"]:
        print(r)
    if args.sheet:
        from PIL import Image

        clips = [generate(pipe, p, s, args.steps) for p, _, _ in PROBES for s in (0, 1)]
        Image.fromarray(contact_sheet(clips)).save(args.sheet)


if __name__ == "__main__":
    main()
