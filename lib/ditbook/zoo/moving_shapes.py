"""The video reference model's training clips, rendered by the repo itself: one colored shape
(circle, square, triangle; the colors of ``shapes.py``) on a light background, moving left,
right, up or down across the picture, described by a prompt such as "a red circle moving right".

A clip is (frames, H, W, 3) uint8. The shape starts near one side and travels about half the
picture in a straight line at constant speed; start, speed, size and the cross position jitter
with the seed. ``motion`` measures what a clip shows (its dominant color and the direction its
colored pixels move), so generated clips can be judged by the same rules the renderer follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .shapes import BACKGROUND, COLORS, SHAPES, color_fractions, draw_shape, unit_float

SIZE = 32
FRAMES = 9  # 1 + 4k frames: what a Wan VAE with 4x temporal compression expects
# unit step of each direction in image coordinates (x to the right, y downwards)
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
TRAVEL = 0.5  # how far the shape moves over the clip, as a fraction of the side (before jitter)


@dataclass(frozen=True)
class MovingScene:
    shape: str
    color: str
    direction: str

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} moving {self.direction}"


def all_scenes() -> list[MovingScene]:
    return [MovingScene(s, c, d) for c in COLORS for s in SHAPES for d in DIRECTIONS]


def path(scene: MovingScene, rng: np.random.Generator, frames: int = FRAMES) -> tuple[np.ndarray, float]:
    """The shape's centers (frames, 2) as fractions of the side (x, y), and its radius (fraction)."""
    dx, dy = DIRECTIONS[scene.direction]
    travel = TRAVEL * rng.uniform(0.85, 1.15)
    # along the motion: centered on the middle of the picture, +-0.04; across it: 0.5 +-0.08
    along0 = 0.5 - travel / 2 + rng.uniform(-0.04, 0.04)
    across = 0.5 + rng.uniform(-0.08, 0.08)
    s = along0 + travel * np.linspace(0.0, 1.0, frames)
    if dx:
        xs = s if dx > 0 else 1.0 - s
        centers = np.stack([xs, np.full(frames, across)], 1)
    else:
        ys = s if dy > 0 else 1.0 - s
        centers = np.stack([np.full(frames, across), ys], 1)
    return centers, rng.uniform(0.13, 0.17)


def render(scene: MovingScene, rng: np.random.Generator, size: int = SIZE, frames: int = FRAMES) -> np.ndarray:
    """One clip (frames, H, W, 3) uint8. Each frame is drawn at 4x and downsampled (smooth edges)."""
    k = 4
    big = size * k
    centers, r = path(scene, rng, frames)
    color = COLORS[scene.color]
    out = []
    for cx, cy in centers:
        img = Image.new("RGB", (big, big), BACKGROUND)
        draw_shape(ImageDraw.Draw(img), scene.shape, cx * big, cy * big, r * big, color)
        out.append(np.asarray(img.resize((size, size), Image.LANCZOS)))
    return np.stack(out)


def dataset(n: int, seed: int, size: int = SIZE, frames: int = FRAMES) -> tuple[np.ndarray, list[int], list[MovingScene]]:
    """``n`` clips (n, frames, H, W, 3) uint8, each one's scene index, and the scene list (cycled
    so every scene appears equally often, then shuffled)."""
    rng = np.random.default_rng(seed)
    scenes = all_scenes()
    order = [i % len(scenes) for i in range(n)]
    rng.shuffle(order)
    clips = np.stack([render(scenes[i], rng, size, frames) for i in order])
    return clips, order, scenes


def centroids(clip: np.ndarray) -> np.ndarray:
    """Center of mass (x, y) of each frame's non-background pixels, as fractions of the side
    (x: 0 left, 1 right; y: 0 top, 1 bottom); NaN for a frame with no such pixel."""
    arr = unit_float(clip)
    fg = np.abs(arr - np.array(BACKGROUND, dtype=np.float32) / 255.0).sum(-1)  # (F, H, W)
    fg = np.where(fg > 0.3, fg, 0.0)
    h, w = fg.shape[1:]
    xs = (np.arange(w) + 0.5) / w
    ys = (np.arange(h) + 0.5) / h
    mass = fg.sum((1, 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        cx = (fg.sum(1) * xs).sum(1) / mass
        cy = (fg.sum(2) * ys).sum(1) / mass
    return np.where(mass[:, None] > 1e-6, np.stack([cx, cy], 1), np.nan)


def motion(clip: np.ndarray, min_travel: float = 0.15) -> dict:
    """What a clip (frames, H, W, 3) shows: its dominant color, the displacement (dx, dy) of its
    shape over the clip (least-squares line through the frames' centroids, first to last frame,
    fractions of the side), and the direction: the axis that moved most and its sign, or
    ``None`` when the shape travelled less than ``min_travel`` or vanished in some frame."""
    arr = unit_float(clip)
    fractions = color_fractions(arr.reshape(-1, arr.shape[-2], 3))
    c = centroids(arr)
    row = {"color": max(fractions, key=fractions.get), "color_share": round(float(max(fractions.values())), 3)}
    if np.isnan(c).any():
        return {**row, "dx": None, "dy": None, "direction": None}
    t = np.linspace(0.0, 1.0, len(c))
    slope = np.polyfit(t, c, 1)[0]  # (2,): displacement from the first to the last frame
    dx, dy = float(slope[0]), float(slope[1])
    if max(abs(dx), abs(dy)) < min_travel:
        direction = None
    elif abs(dx) >= abs(dy):
        direction = "right" if dx > 0 else "left"
    else:
        direction = "down" if dy > 0 else "up"
    return {**row, "dx": round(dx, 3), "dy": round(dy, 3), "direction": direction}
