"""ipywidgets views for interactive use. Each view's logic is a plain function that works
headless (and is tested so); the widget only wires controls to it.

Benchmark explorer: pick a strategy (configuration) and a prompt, toggle baseline/accelerated,
and show the difference map — ``explorer_state`` computes what to show, ``explorer`` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .benchmark.plots import diff_map


@dataclass
class ExplorerData:
    """Images of a benchmark run: ``images[config][key]`` float (H, W, 3) in [0, 1]."""

    images: dict[str, dict[str, np.ndarray]]
    prompts: dict[str, str] = field(default_factory=dict)  # key -> prompt text

    @property
    def configs(self) -> list[str]:
        return [c for c in self.images if c != "baseline"]

    @property
    def keys(self) -> list[str]:
        return sorted(self.images.get("baseline", {}))


def load_explorer_data(run_dir: str | Path) -> ExplorerData:
    """Read the benchmark images of a run folder (``benchmark/results.json`` ``images``)."""
    from .runs import RunFolder

    run = RunFolder(run_dir)
    res = run.read_results("benchmark")
    d = run.stage_dir("benchmark", create=False)
    images = {name: {r["key"]: np.load(d / r["npy"]) for r in rows} for name, rows in res.images.items()}
    intake = run.results_or_none("intake")
    prompts = {r.key: r.prompt for r in intake.images} if intake is not None else {}
    return ExplorerData(images, prompts)


@dataclass
class ExplorerState:
    config: str
    key: str
    showing: str  # "baseline" or "accelerated"
    image: np.ndarray
    diff: np.ndarray
    psnr: float
    ssim: float
    caption: str


def explorer_state(data: ExplorerData, config: str, key: str, accelerated: bool = True,
                   gain: float = 4.0) -> ExplorerState:
    """What the explorer shows for a (configuration, prompt) pick and the baseline/accelerated toggle."""
    from .quality import compare, psnr, ssim
    from .render import frame_strip, is_video, preview_frames

    if config not in data.images or config == "baseline":
        raise KeyError(f"no configuration {config!r}; choose one of {data.configs}")
    if key not in data.images["baseline"] or key not in data.images[config]:
        raise KeyError(f"no image {key!r} for {config!r}; keys: {data.keys}")
    base, acc = data.images["baseline"][key], data.images[config][key]
    if is_video(base) or is_video(acc):  # frame by frame, the worst frame's figures; shown as a row of frames
        q = compare(acc, base)
        p, s = q.psnr, q.ssim
        shown = preview_frames(len(base))  # the frames a video's picture shows everywhere
        base, acc = frame_strip(base, frames=shown), frame_strip(acc, frames=[i for i in shown if i < len(acc)])
        if base.shape != acc.shape:
            acc = np.zeros_like(base) * np.nan  # a dropped frame: nothing to set side by side
    else:
        p, s = psnr(acc, base), ssim(acc, base)
    showing = "accelerated" if accelerated else "baseline"
    prompt = data.prompts.get(key, "")
    caption = (f"{config if accelerated else 'baseline'} | {key}{' — ' + prompt if prompt else ''} | "
               f"PSNR {p:.2f} dB, SSIM {s:.4f} vs baseline")
    return ExplorerState(config, key, showing, acc if accelerated else base, diff_map(acc, base, gain), p, s, caption)


def _png_bytes(img: np.ndarray, scale: int = 1) -> bytes:
    import io

    from PIL import Image

    arr = (np.clip(np.nan_to_num(img), 0, 1) * 255).round().astype(np.uint8)
    im = Image.fromarray(arr)
    if scale > 1:
        im = im.resize((im.width * scale, im.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def explorer(data: ExplorerData, scale: int = 4):
    """The interactive widget: strategy and prompt pickers, a baseline/accelerated toggle, the
    image and its difference map side by side."""
    import ipywidgets as w

    if not data.configs:
        return w.HTML("<i>no accelerated configuration was benchmarked</i>")
    pick_cfg = w.Dropdown(options=data.configs, description="strategy")
    pick_key = w.Dropdown(options=[(f"{k} {data.prompts.get(k, '')}".strip(), k) for k in data.keys],
                          description="prompt")
    toggle = w.ToggleButtons(options=["accelerated", "baseline"], description="show")
    img, dif, cap = w.Image(format="png"), w.Image(format="png"), w.HTML()

    def update(*_):
        st = explorer_state(data, pick_cfg.value, pick_key.value, toggle.value == "accelerated")
        img.value, dif.value = _png_bytes(st.image, scale), _png_bytes(st.diff, scale)
        cap.value = f"<code>{st.caption}</code>"

    for c in (pick_cfg, pick_key, toggle):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([pick_cfg, pick_key]), toggle, w.HBox([img, dif]), cap])


__all__ = ["ExplorerData", "load_explorer_data", "ExplorerState", "explorer_state", "explorer", "diff_map"]
