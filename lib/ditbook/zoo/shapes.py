"""The reference model's training images, rendered by the repo itself: one colored shape
(circle, square, triangle) on a light background, on the left, in the center or on the right,
described by a prompt such as "a red circle on the left".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
BACKGROUND = (235, 235, 235)
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 40, 180),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"on the left": 0.25, "in the center": 0.5, "on the right": 0.75}


@dataclass(frozen=True)
class ShapeScene:
    shape: str
    color: str
    position: str

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} {self.position}"


def all_scenes() -> list[ShapeScene]:
    return [ShapeScene(s, c, p) for c in COLORS for s in SHAPES for p in POSITIONS]


def render(scene: ShapeScene, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """One image (H, W, 3) uint8; size and exact place jitter with ``rng``. Drawn at 4x and
    downsampled so edges are smooth."""
    k = 4
    big = size * k
    img = Image.new("RGB", (big, big), BACKGROUND)
    cx = (POSITIONS[scene.position] + rng.uniform(-0.04, 0.04)) * big
    cy = (0.5 + rng.uniform(-0.08, 0.08)) * big
    draw_shape(ImageDraw.Draw(img), scene.shape, cx, cy, rng.uniform(0.13, 0.18) * big, COLORS[scene.color])
    return np.asarray(img.resize((size, size), Image.LANCZOS))


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, color) -> None:
    """One filled circle, square or triangle of radius ``r`` around (cx, cy)."""
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        h = r * 0.9
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=color)
    else:
        draw.polygon([(cx, cy - r), (cx - r * 1.1, cy + r * 0.8), (cx + r * 1.1, cy + r * 0.8)], fill=color)


def dataset(n: int, seed: int) -> tuple[np.ndarray, list[int], list[ShapeScene]]:
    """``n`` images (n, H, W, 3) uint8, each one's scene index, and the scene list (cycled so
    every scene appears equally often)."""
    rng = np.random.default_rng(seed)
    scenes = all_scenes()
    order = [i % len(scenes) for i in range(n)]
    rng.shuffle(order)
    images = np.stack([render(scenes[i], rng) for i in order])
    return images, order, scenes


def unit_float(image: np.ndarray) -> np.ndarray:
    """``image`` as float32 in [0, 1] (uint8 values scaled down)."""
    arr = np.asarray(image, dtype=np.float32)
    return arr / 255.0 if arr.max() > 1.5 else arr


def color_fractions(image: np.ndarray) -> dict[str, float]:
    """Fraction of pixels nearest to each shape color (background pixels excluded); ``image``
    is (H, W, 3) in [0, 1] or uint8. Used by the tests to check that prompts steer colors."""
    img = unit_float(image)
    palette = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32) / 255.0
    dist = ((img[..., None, :] - palette) ** 2).sum(-1)
    nearest = dist.argmin(-1)
    counts = np.bincount(nearest.ravel(), minlength=len(palette))[1:]
    total = max(int(counts.sum()), 1)
    return {name: counts[i] / total for i, name in enumerate(COLORS)}


def horizontal_center(image: np.ndarray) -> float:
    """Horizontal center of mass (0 = left edge, 1 = right edge) of non-background pixels."""
    img = unit_float(image)
    fg = np.abs(img - np.array(BACKGROUND, dtype=np.float32) / 255.0).sum(-1)
    fg = np.where(fg > 0.3, fg, 0.0)
    xs = (np.arange(img.shape[1]) + 0.5) / img.shape[1]
    return float((fg.sum(0) * xs).sum() / max(fg.sum(), 1e-6))
