"""A synthetic run folder for the tests: the report, result.md and compare without a model.

``FakePipeline`` has the method names the harness wraps (``encode_prompt``, ``transformer``,
``vae.decode``) and renders a seed- and prompt-dependent image in milliseconds;
``make_synthetic_run`` measures it with the real harness and writes a run folder with run.json,
intake and benchmark results, images, an executed notebook holding an image output, and
optionally a failed stage.
"""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ditbook.configuration import Config


def _torch():
    import torch

    return torch


class _Block(_torch().nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = _torch().nn.Linear(dim, dim)

    def forward(self, hidden_states):
        return hidden_states + 0.1 * _torch().tanh(self.lin(hidden_states))


class FakeTransformer(_torch().nn.Module):
    def __init__(self, dim: int = 16, blocks: int = 2):
        super().__init__()
        self.blocks = _torch().nn.ModuleList([_Block(dim) for _ in range(blocks)])
        self.proj = _torch().nn.Linear(dim, dim)

    step_seconds = 0.0  # set by the pipeline: a wait per call, the stand-in for work a cache skips
    wait = staticmethod(time.sleep)

    def forward(self, hidden_states, timestep=None):
        for b in self.blocks:
            hidden_states = b(hidden_states)
        if self.step_seconds:  # inside the call, where the work a cache skips is (and where the benchmark's
            self.wait(self.step_seconds)  # parts put it: denoising runs from the first call's start to the last's end)
        return self.proj(hidden_states)


class FakeVAE:
    def decode(self, latents):
        torch = _torch()
        x = latents[..., :3].reshape(1, 8, 8, 3)
        return torch.sigmoid(x)


class FakePipeline:
    """``noise`` perturbs each step (a stand-in for an approximate acceleration); with ``frames``
    it is a video pipeline: its output's ``.frames`` hold that many frames, each decoded from the
    latents moved a little further."""

    def __init__(self, seed: int = 0, frames: int = 0):
        torch = _torch()
        torch.manual_seed(seed)
        self.transformer = FakeTransformer()
        self.vae = FakeVAE()
        self.noise = 0.0
        self.device = "cpu"
        self.frames = frames

    @property
    def step_seconds(self) -> float:
        """The wait per step (in each transformer call): the stand-in for work an acceleration skips."""
        return self.transformer.step_seconds

    @step_seconds.setter
    def step_seconds(self, seconds: float) -> None:
        self.transformer.step_seconds = seconds

    def encode_prompt(self, prompt: str):
        torch = _torch()
        g = torch.Generator().manual_seed(sum(map(ord, prompt)))
        return torch.randn(1, 64, 16, generator=g) * 0.5

    def __call__(self, prompt: str, generator=None, num_inference_steps: int = 3, output_type: str = "np"):
        torch = _torch()
        emb = self.encode_prompt(prompt)
        x = torch.randn(1, 64, 16, generator=generator) + emb
        for _ in range(num_inference_steps):
            x = x - 0.2 * self.transformer(x, timestep=None)
            if self.noise:
                x = x + self.noise * torch.randn(x.shape, generator=generator)
        if self.frames:  # (batch, frames, H, W, 3), as video pipelines return with output_type="np"
            video = torch.stack([self.vae.decode(x + 0.3 * f) for f in range(self.frames)], dim=1)
            return SimpleNamespace(frames=video.detach().numpy())
        img = self.vae.decode(x)
        return SimpleNamespace(images=img.detach().numpy())


class VirtualWaits:
    """``time`` for ``ditbook.timing`` while the synthetic benchmark runs: the real clock plus every
    wait the fake pipeline took, counted exactly. A real ``sleep`` overshoots by milliseconds on a
    loaded machine, which made the order of configurations that differ only by their waits a draw."""

    def __init__(self):
        self.waited = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.waited

    def sleep(self, seconds: float) -> None:
        self.waited += seconds

    def __getattr__(self, name):
        return getattr(time, name)


def noise_config(name: str, noise: float, family: str = "cache/fake", step_seconds: float | None = None) -> Config:
    """``noise`` added each step; ``step_seconds``: the wait per step it leaves (the baseline's is
    the pipeline's own), so its speed-up is known ahead of the timing."""
    def apply(pipe):
        old = pipe.noise, pipe.step_seconds
        pipe.noise = noise
        if step_seconds is not None:
            pipe.step_seconds = step_seconds

        def undo():
            pipe.noise, pipe.step_seconds = old

        return undo

    return Config(name, family, apply, {"noise": noise})


def failing_config(name: str = "raises") -> Config:
    def apply(pipe):
        raise RuntimeError("this configuration does not apply to the model")

    return Config(name, "cache/fake", apply)


CARD = """name: synthetic
path: {path}
pipeline: {{class: FakePipeline, source: synthetic_run}}
transformer: {{class: FakeTransformer, source: synthetic_run}}
generation:
  prompts: ["a red circle", "a blue square"]
  seeds: [0]
  height: 8
  width: 8
  steps: 3
benchmark:
  timing_drift: 0.25  # a shared CI host moves a 60 ms call by more than the default 10%
"""


def png_b64(img: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def executed_notebook(path: Path, title: str, image: np.ndarray, error: str | None = None) -> Path:
    """A small executed notebook with markdown, a stream, an image output (and an error)."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    cells = [new_markdown_cell(f"# {title}\nA synthetic stage."),
             new_code_cell("print('hello')", execution_count=1,
                           outputs=[new_output("stream", name="stdout", text="hello\n")]),
             new_code_cell("show(image)", execution_count=2,
                           outputs=[new_output("display_data", data={"image/png": png_b64(image),
                                                                      "text/plain": "<image>"})])]
    if error:
        cells.append(new_code_cell("fail()", execution_count=3, outputs=[
            new_output("error", ename="RuntimeError", evalue=error, traceback=[f"RuntimeError: {error}"])]))
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nbformat.write(nb, str(path))
    return path


# the chosen configuration's held-out figures per image: p1 is the worst (the held-out worst PSNR)
HOLDOUT_PER_IMAGE = {"p0_s1000": {"psnr": 44.0, "ssim": 0.995}, "p1_s1000": {"psnr": 41.5, "ssim": 0.99}}


def _holdout_images(run, renders) -> dict:
    """Held-out images as the cache stage saves them (``cache/images/holdout``): references, and
    the chosen configuration's, each offset so its PSNR is the one in :data:`HOLDOUT_PER_IMAGE`."""
    root = run.stage_dir("cache") / "images" / "holdout"
    for sub in ("baseline", "chosen"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for r, (key, q) in zip(renders, HOLDOUT_PER_IMAGE.items()):
        ref = np.asarray(r.image, dtype=np.float32)[::-1].copy()  # another seed: another image
        np.save(root / "baseline" / f"{key}.npy", ref)
        np.save(root / "chosen" / f"{key}.npy", ref + np.float32(10 ** (-q["psnr"] / 20)))
    return {"folder": "images/holdout/chosen", "baseline": "images/holdout/baseline",
            "keys": sorted(HOLDOUT_PER_IMAGE), "worst": "p1_s1000"}


def _upstream(run) -> None:
    """The cache stage's shipped files as ``cache.upstream`` writes them: the adapter module and
    an example applying the chosen configuration through ``cache_dit.enable_cache``."""
    up = run.stage_dir("cache") / "upstream"
    up.mkdir(parents=True, exist_ok=True)
    (up / "synthetic_adapter.py").write_text('"""the adapter (synthetic)"""\n')
    (up / "synthetic_example.py").write_text(
        "import cache_dit\n\nfrom synthetic_adapter import fake_adapter  # noqa: E402  (registers the adapter)\n\n\n"
        "def main():\n    if True:\n        cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(**{}))\n")
    (up / "upstream.json").write_text(json.dumps({
        "adapter_module": "synthetic_adapter.py", "example": "synthetic_example.py",
        "example_strategy": {"name": "gentle", "config": {}, "why": "the configuration the stage chose"}}))


def _quality(n: int, psnr: float, ssim: float, per_image: dict | None = None):
    """A set's figures as ``quality.compare_sets`` records them (worst image = ``psnr``/``ssim``)."""
    from ditbook.quality import SetQuality

    return SetQuality(n=n, psnr_mean=psnr, psnr_min=psnr, ssim_mean=ssim, ssim_min=ssim, max_abs=0.0,
                      worst_tile_psnr=psnr, passed=True, reasons=[], per_image=per_image or {})


def _failing(n: int, psnr: float, ssim: float):
    from dataclasses import replace

    return replace(_quality(n, psnr, ssim), passed=False, reasons=[f"worst PSNR {psnr} dB below the gate"])


def make_synthetic_run(root: str | Path, *, failed_stage: str | None = None, benchmark: bool = True,
                       repeats: int = 2, parallel: bool = True, frames: int = 0, step_scale: float = 1.0) -> Path:
    """Write a run folder under ``root`` and return its path (``frames``: of a video pipeline;
    ``step_scale``: the benchmark's waits per step multiplied, for a test that reads the order of the
    speed-ups: a stall of the host then moves a timing by a smaller share)."""
    # long: one run folder written stage by stage, as the real stages would, so a reader can follow it
    from ditbook.card import load_card
    from ditbook.environment import environment
    from ditbook.render import frame_strip, render_all, save_renders
    from ditbook.records import CacheResults, ChosenDetail, IntakeResults, NotRun, ParallelResults, PlanRow, StrategyRow
    from ditbook.runs import RunFolder
    from ditbook.benchmark.inputs import read_inputs
    from ditbook.benchmark.stage import make_figures, measure, save

    root = Path(root)
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    card_path = root / "synthetic.yaml"
    card_path.write_text(CARD.format(path=model))
    card = load_card(card_path)
    run_path = root / "outputs" / "synthetic" / ("failed" if failed_stage else "ok")
    run_path.mkdir(parents=True)
    run = RunFolder(run_path)
    stages = {"intake": {"status": "passed", "seconds": 1.0, "notebook": "01_intake.ipynb"}}
    if failed_stage:
        stages[failed_stage] = {"status": "failed", "seconds": 0.5, "notebook": f"03_{failed_stage}.ipynb",
                                "error": "RuntimeError: adapter returned the wrong stream",
                                "failing_cell": "cell [4]:\nadapter = build_cache_adapter(pipe, report)"}
    run.write_meta({"model": "synthetic", "run_id": run_path.name, "created": "2025-01-01T00:00:00",
                    "card_path": str(card_path), "card": card.to_dict(), "card_hash": card.content_hash(),
                    "overrides": {"generation.steps": 3}, "environment": environment(),
                    "status": "failed" if failed_stage else "finished", "stages": stages})
    pipe = FakePipeline(frames=frames)
    renders = render_all(pipe, card)
    run.write_results("intake", IntakeResults(images=save_renders(renders, run.stage_dir("intake") / "images"),
                                              placement={"device": "cpu", "dtype": "float32"}))
    # tuned on the calibration seeds, confirmed on held-out ones: "brisk" is better on held-out
    # seeds but skips less work and is slower (a runner-up); the cache stage's choice is "gentle".
    # The work each skips allows, with room to spare, the speed-up its waits give below (gentle
    # 0.85 for 80% less per step, brisk 0.6 for 40% less)
    holdout = _quality(2, 41.5, 0.99, HOLDOUT_PER_IMAGE)
    run.write_results("cache", CacheResults(
        adapter_module="synthetic_adapter.py", gates=card.cache.gates,
        strategies=[StrategyRow("gentle", "cache/fake", {}, _quality(2, 60.25, 0.9999), 0.85, 0.85, 1, True),
                    StrategyRow("gentle", "cache/fake", {}, holdout, 0.85, 0.85, 1, True, "holdout"),
                    StrategyRow("brisk", "cache/fake", {}, _quality(2, 43.25, 0.995), 0.6, 0.6, 1, True, "holdout"),
                    # confirmed on held-out seeds and failing there: listed as not eligible, with why
                    StrategyRow("rough", "cache/fake", {}, _failing(2, 21.5, 0.62), 0.7, 0.7, 1, False, "holdout")],
        chosen=ChosenDetail("gentle", "cache/fake", {}, skipped_fraction=0.85, holdout_quality=holdout,
                            holdout_images=_holdout_images(run, renders)),
        adapter_checks=[{"name": "gentle", "checked": True, "max_abs": 0.0, "reproduces": True}],
        noise_floor={"rerun_vs_intake": {"psnr_min": 100.0}, "rerun_max_abs": 0.0}))
    if parallel:
        run.write_results("parallel", ParallelResults(feasibility={}, passed=True, device="cpu", plans=[
            PlanRow("ulysses2", 2, True, _quality(2, 48.0, 0.999), seconds=1.2, speedup=1.67, reference="single"),
            PlanRow("ulysses4", 4, True, _quality(2, 47.0, 0.999), seconds=0.8, speedup=2.5, reference="single"),
            # parity against one process with the same cache; against the uncached baseline:
            PlanRow("ulysses2+cache", 2, True, _quality(2, 99.0, 1.0), seconds=0.9, speedup=2.2,
                    reference="single+cache", baseline_quality=_quality(2, 32.0, 0.93))],
            not_run=[NotRun("ring2+cache", "needs CUDA (flash SDPA's log-sum-exp)")]))
    _upstream(run)
    executed_notebook(run_path / "01_intake.ipynb", "01 Intake", frame_strip(renders[0].image))
    if failed_stage:
        executed_notebook(run_path / f"03_{failed_stage}.ipynb", f"03 {failed_stage}", frame_strip(renders[0].image),
                          error="adapter returned the wrong stream")
    if benchmark:
        ctx = SimpleNamespace(card=card, run=run)
        # the baseline waits 20 ms a step, "gentle" 4 ms, "brisk" 12 ms, on a virtual clock (the
        # real one plus the waits, counted exactly): the waits dominate, so the timings are stable
        # and their order is known (at 7 and 14 ms of real sleep their spreads once met)
        pipe.step_seconds = 0.02 * step_scale
        configs = [noise_config("gentle", 0.0005, step_seconds=0.004 * step_scale),
                   noise_config("brisk", 0.0004, step_seconds=0.012 * step_scale),
                   noise_config("rough", 0.3, step_seconds=0.007 * step_scale),
                   failing_config()]
        import ditbook.timing as timing

        virtual, real = VirtualWaits(), timing.time
        pipe.transformer.wait, timing.time = virtual.sleep, virtual
        try:
            report = measure(ctx, pipe, configs, warmup=1, repeats=repeats)
        finally:
            del pipe.transformer.wait  # the class's time.sleep again
            timing.time = real
        from ditbook.benchmark.stage import measure_residuals

        results = save(ctx, report, read_inputs(run), measure_residuals(ctx, pipe))
        make_figures(run, results)
        stages["benchmark"] = {"status": "passed", "seconds": 1.0, "notebook": "05_benchmark.ipynb"}
        meta = run.read_meta()
        meta["stages"] = stages
        run.write_meta(meta)
        executed_notebook(run_path / "05_benchmark.ipynb", "05 Benchmark", frame_strip(renders[-1].image))
    return run_path


__all__ = ["FakePipeline", "FakeTransformer", "noise_config", "failing_config", "make_synthetic_run",
           "executed_notebook", "json"]
