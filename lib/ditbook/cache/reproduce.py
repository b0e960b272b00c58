"""Rerun a chosen cache configuration from the generated adapter module, in a fresh process.

``python -m ditbook.cache.reproduce SPEC.json``: load the pipeline, import the run's adapter module,
apply the chosen strategy (and the spec's ``fp8`` composition), render the calibration cases and
print one JSON line with the largest absolute difference from the images the stage verified.
``--wait [PACKAGE] [--device=DEVICE]`` starts it ahead (``Ahead``): it imports the libraries and
warms the device, then reads the spec's path from standard input (an empty input ends it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _warm(package: str | None, device: str | None = None) -> None:
    """The imports a reproduction starts with, then its device; a failure is left for the run itself."""
    import importlib

    for name in ("torch", "diffusers", "cache_dit", "ditbook.adapter.build", "ditbook.accel",
                 "ditbook.cache.verify", "ditbook.loading", package):
        if name:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the real run reports it
                pass
    if device:
        from ..loading import warm_device

        warm_device(device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--wait":
        device = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--device=")), None)
        rest = [a for a in argv[1:] if not a.startswith("--device=")]
        _warm(rest[0] if rest else None, device)
        line = sys.stdin.readline().strip()
        if not line:  # the stage ended without a reproduction
            return 0
        argv = [line]
    spec = json.loads(Path(argv[0]).read_text())
    from ..arch.report import ArchReport
    from ..card import gate_check
    from ..loading import Placement, load_pipeline
    from .. import accel
    from ..adapter.build import CacheAdapter, load_adapter_file
    from .verify import render_set

    card = gate_check(spec["card"], spec.get("overrides") or {})
    pipe = load_pipeline(card, Placement(spec["device"], spec["dtype"]))
    # a plain import, as a maintainer's: the file registers its function with cache-dit
    module = load_adapter_file(spec["adapter_module"], pipe.transformer, register=True)
    adapter = CacheAdapter.from_module(pipe, ArchReport.load(spec["arch"]), module, spec.get("used", "ditbook"))
    strat = accel.get(spec["name"])
    undo = strat.apply(pipe, strat.settings(**spec["config"]), adapter=adapter, steps=card.generation.steps)
    try:
        images = render_set(pipe, card, card.generation.prompts, card.generation.seeds)
    finally:
        undo()
    diffs = _diffs(images, Path(spec["images"]))
    out = {"max_abs": max(diffs.values()), "per_image": diffs, "module": module.__name__}
    if spec.get("fp8"):  # the fp8 composition the cache stage tuned: its layers, then its strategy
        out["fp8"] = _fp8_rerun(pipe, card, adapter, spec["fp8"])
    print(json.dumps(out))
    return 0


def _diffs(images: dict, folder: Path) -> dict:
    return {k: float(np.max(np.abs(images[k].astype(np.float64) - np.load(folder / f"{k}.npy").astype(np.float64))))
            for k in images}


def _fp8_rerun(pipe, card, adapter, f8: dict) -> dict:
    """The fp8 composition rerun against the images the stage saved; an error is the record."""
    from .. import accel
    from .fp8_tune import torchao_fp8
    from .verify import render_set

    strat = accel.get(f8["name"])
    undo_fp8 = undo = None
    try:
        undo_fp8 = torchao_fp8(pipe.transformer, f8["layers"])
        undo = strat.apply(pipe, strat.settings(**f8["config"]), adapter=adapter, steps=card.generation.steps)
        images = render_set(pipe, card, card.generation.prompts, card.generation.seeds)
    except Exception as exc:  # noqa: BLE001 - recorded: the verdict does not ship what did not reproduce
        return {"max_abs": None, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if undo is not None:
            undo()
        if undo_fp8 is not None:
            undo_fp8()
    diffs = _diffs(images, Path(f8["images"]))
    return {"max_abs": max(diffs.values()), "per_image": diffs}


class Ahead:
    """The reproduction process, started before its turn (``--wait``): ``run(spec_path)`` hands it
    the spec and waits for it; ``close()`` ends an unused one."""

    def __init__(self, package: str | None = None, env: dict | None = None, device: str | None = None):
        import subprocess

        cmd = ([sys.executable, "-m", "ditbook.cache.reproduce", "--wait"] + ([package] if package else [])
               + ([f"--device={device}"] if device else []))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)

    def run(self, spec_path: Path, timeout: float):
        """(returncode, stdout, stderr) of the reproduction of ``spec_path``."""
        import subprocess

        try:
            out, err = self.proc.communicate(f"{spec_path}\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise
        return self.proc.returncode, out, err

    def close(self) -> None:
        """End an unused process now (it holds nothing but its imports)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


if __name__ == "__main__":
    raise SystemExit(main())
