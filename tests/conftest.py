import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the GPU speed suite (speedsuite) lives beside its scripts
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_card(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return d


@pytest.fixture
def good_card_text(model_dir):
    return f"""name: demo
path: {model_dir}
pipeline:
  class: FluxPipeline
  source: diffusers
transformer:
  class: FluxTransformer2DModel
  source: diffusers
generation:
  prompts: ["a red circle"]
  seeds: [0]
  height: 32
  width: 32
  steps: 2
"""
