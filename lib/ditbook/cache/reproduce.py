"""Rerun a chosen cache configuration from the generated adapter module, in a fresh process.

``python -m ditbook.cache.reproduce SPEC.json`` (written by ``CacheSession.reproduce``): loads
the card's pipeline, imports ``cache/adapter_<model>.py`` from the run folder (which registers it
with cache-dit), applies the chosen strategy through it, renders the calibration cases and prints one
JSON line with the largest absolute difference from the images the stage verified.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    from ..inspect.report import ArchReport
    from ..card import gate_check
    from ..loading import Placement, load_pipeline
    from . import strategies
    from .adapter import CacheAdapter, load_adapter_file
    from .verify import render_set

    card = gate_check(spec["card"], spec.get("overrides") or {})
    pipe = load_pipeline(card, Placement(spec["device"], spec["dtype"]))
    # a plain import, as a maintainer's: the file registers its function with cache-dit
    module = load_adapter_file(spec["adapter_module"], pipe.transformer, register=True)
    adapter = CacheAdapter.from_module(pipe, ArchReport.load(spec["arch"]), module, spec.get("used", "ditbook"))
    strat = strategies.get(spec["name"])
    undo = strat.apply(pipe, adapter, strat.config(**spec["config"]), steps=card.generation.steps)
    try:
        images = render_set(pipe, card, card.generation.prompts, card.generation.seeds)
    finally:
        undo()
    folder = Path(spec["images"])
    diffs = {k: float(np.max(np.abs(images[k].astype(np.float64) - np.load(folder / f"{k}.npy").astype(np.float64))))
             for k in images}
    print(json.dumps({"max_abs": max(diffs.values()), "per_image": diffs, "module": module.__name__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
