"""Rendering images from a pipeline with a card's generation settings, reproducibly.

Every stage renders through here, so baseline, cached and parallel images come from the same
call with the same seeds. Images are float32 arrays in [0, 1], shape (H, W, 3); a video (a
pipeline output with ``.frames``, or any 5-d output) keeps every frame: (F, H, W, 3). Its ``.npy``
holds all frames, its PNG a row of at most ``PREVIEW_FRAMES`` of them, evenly spaced from the first
to the last (``preview_frames``, ``frame_strip``): 81 frames of 480x832 in one PNG are 97 M pixels,
seconds to compress per video on every stage that saves one; ``quality.compare`` judges every frame
from the ``.npy``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .card import ModelCard


@dataclass
class Render:
    prompt: str
    seed: int
    image: np.ndarray
    seconds: float
    key: str = ""

    def to_dict(self) -> dict:
        d = {"prompt": self.prompt, "seed": self.seed, "seconds": round(self.seconds, 4), "key": self.key,
             "shape": list(self.image.shape)}
        if is_video(self.image):
            d["frames"] = int(self.image.shape[0])
        return d


def is_video(arr) -> bool:
    """A rendered video is (frames, H, W, C); an image is (H, W, C)."""
    return np.ndim(arr) == 4


# the most frames a video's picture (its PNG, a contact sheet's row) shows
PREVIEW_FRAMES = 9


def preview_frames(count: int, most: int = PREVIEW_FRAMES) -> list[int]:
    """Indices of the frames a video's picture shows: all of them up to ``most``, else ``most``
    evenly spaced ones, the first and the last among them."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def frame_strip(arr, gap: int = 1, fill: float = 1.0, frames: list[int] | None = None) -> np.ndarray:
    """A video's frames side by side in one (H, F*(W+gap)-gap, C) picture, ``gap`` columns of
    ``fill`` between frames (``frames``: those indices only); an image is returned as it is."""
    arr = np.asarray(arr)
    if not is_video(arr):
        return arr
    if frames is not None:
        arr = arr[list(frames)]
    f, h, w = arr.shape[:3]
    out = np.full((h, f * (w + gap) - gap) + arr.shape[3:], fill, dtype=arr.dtype)
    for i in range(f):
        out[:, i * (w + gap): i * (w + gap) + w] = arr[i]
    return out


def render_key(prompt_index: int, seed: int) -> str:
    return f"p{prompt_index}_s{seed}"


def call_kwargs(pipe, card: ModelCard, **overrides: Any) -> dict:
    """The pipeline's ``__call__`` arguments from the card, keeping only names it accepts."""
    gen = card.generation
    wanted = {
        "num_inference_steps": gen.steps,
        "height": gen.height,
        "width": gen.width,
        "guidance_scale": gen.guidance_scale,
        "true_cfg_scale": gen.true_cfg_scale,
        "negative_prompt": gen.negative_prompt,
        "output_type": "np",
    }
    wanted.update(gen.extra or {})
    wanted.update(overrides)
    params = inspect.signature(pipe.__call__).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in wanted.items() if v is not None and (k in params or takes_kwargs and k in overrides)}


def to_image(output) -> np.ndarray:
    """Turn a pipeline output into float32 in [0, 1]: an image (H, W, 3), or, for a video (an
    output with ``.frames``, or a 5-d batch), every frame of the first video (F, H, W, 3)."""
    arr = getattr(output, "images", None)
    if arr is None:
        arr = getattr(output, "frames", None)
    if arr is None and isinstance(output, (tuple, list)):
        arr = output[0]
    if hasattr(arr, "detach"):
        arr = arr.detach().float().cpu().numpy()
    arr = np.asarray(arr, dtype=np.float32)
    video = arr.ndim == 5 or (arr.ndim == 4 and getattr(output, "images", None) is None
                              and getattr(output, "frames", None) is not None)
    if video:
        arr = arr[0] if arr.ndim == 5 else arr  # (batch, frames, H, W, C) -> the first video
        if arr.shape[1] in (1, 3) and arr.shape[-1] not in (1, 3):  # (F, C, H, W)
            arr = np.transpose(arr, (0, 2, 3, 1))
    else:
        if arr.ndim == 4:
            arr = arr[0]
        if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
            arr = np.transpose(arr, (1, 2, 0))
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return arr


def make_generator(seed: int):
    import torch

    # a CPU generator gives the same initial noise on every device
    return torch.Generator(device="cpu").manual_seed(int(seed))


def render_one(pipe, card: ModelCard, prompt: str, seed: int, *, sync: Callable[[], None] | None = None, **overrides) -> Render:
    kwargs = call_kwargs(pipe, card, **overrides)
    start = time.perf_counter()
    out = pipe(prompt=prompt, generator=make_generator(seed), **kwargs)
    if sync is not None:
        sync()
    seconds = time.perf_counter() - start
    return Render(prompt=prompt, seed=seed, image=to_image(out), seconds=seconds)


def cases(card: ModelCard, prompts: Iterable[str] | None = None, seeds: Iterable[int] | None = None) -> list[tuple[str, str, int]]:
    """(key, prompt, seed) for every prompt x seed; keys index prompts in the card's list."""
    prompts = list(prompts if prompts is not None else card.generation.prompts)
    seeds = list(seeds if seeds is not None else card.generation.seeds)
    return [(render_key(i, s), p, s) for i, p in enumerate(prompts) for s in seeds]


def render_all(pipe, card: ModelCard, prompts=None, seeds=None, progress=None, **overrides) -> list[Render]:
    """Render every prompt x seed; ``progress`` is called with (done, total, render)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    todo = cases(card, prompts, seeds)
    renders = []
    for n, (key, prompt, seed) in enumerate(todo, 1):
        r = render_one(pipe, card, prompt, seed, sync=sync, **overrides)
        r.key = key
        renders.append(r)
        if progress is not None:
            progress(n, len(todo), r)
    return renders


def save_renders(renders: list[Render], folder: Path, prefix: str = "") -> list:
    """PNG and float .npy per render; returns ``records.ImageRow``s with paths relative to
    ``folder``'s parent."""
    from PIL import Image

    from .records import ImageRow

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in renders:
        stem = f"{prefix}{r.key}"
        np.save(folder / f"{stem}.npy", r.image.astype(np.float32))  # a video: every frame
        shown = preview_frames(len(r.image)) if is_video(r.image) else None
        picture = frame_strip(np.clip(r.image[shown] if shown else r.image, 0, 1))  # a video: a row of frames
        Image.fromarray((picture * 255).round().astype(np.uint8)).save(folder / f"{stem}.png")
        rel = folder.name
        rows.append(ImageRow(**r.to_dict(), png=f"{rel}/{stem}.png", npy=f"{rel}/{stem}.npy", png_frames=shown))
    return rows


def load_images(stage_dir: Path, rows: list) -> dict[str, np.ndarray]:
    """Read back the float images of a stage's ``ImageRow``s (key -> array)."""
    return {row.key: np.load(Path(stage_dir) / row.npy) for row in rows}
