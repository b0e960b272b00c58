"""End to end: the intake notebook through papermill on a tiny model saved with save_pretrained."""

import json

import numpy as np
import pytest
from PIL import Image

from ditbook import zoo
from ditbook.runner import start_run
from ditbook.loading import ModelFolderError, check_model_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flux_card(tmp_path_factory):
    return zoo.build("flux", tmp_path_factory.mktemp("zoo"))


def test_intake_runs_end_to_end(flux_card, tmp_path, monkeypatch):
    monkeypatch.delenv("DITBOOK_NOTEBOOKS", raising=False)
    outcome = start_run(flux_card, stages=["intake"], run_id="e2e", outputs_root=tmp_path, log=lambda s: None)
    assert outcome.ok, outcome.failure
    res = outcome.run.read_results("intake")
    assert res.placement == {"device": "cpu", "dtype": "float32"}
    keys = {r.key for r in res.images}
    assert keys == {"p0_s0", "p0_s1", "p1_s0", "p1_s1"}
    for row in res.images:
        arr = np.load(outcome.run.path / "intake" / row.npy)
        png = np.asarray(Image.open(outcome.run.path / "intake" / row.png))
        assert arr.dtype == np.float32 and arr.shape == (32, 32, 3) and np.isfinite(arr).all()
        assert np.abs(png / 255.0 - arr).max() <= 1 / 255 + 1e-6
    # different seeds give different images; the same seed is reproducible
    a = np.load(outcome.run.path / "intake" / "images" / "p0_s0.npy")
    b = np.load(outcome.run.path / "intake" / "images" / "p0_s1.npy")
    assert np.abs(a - b).max() > 1e-3
    nb = json.loads((outcome.run.path / "01_intake.ipynb").read_text())
    assert any(o.get("output_type") == "display_data" for c in nb["cells"] for o in c.get("outputs", []))


def test_partial_model_folder_named(flux_card):
    from ditbook.card import load_card
    import shutil

    card = load_card(flux_card)
    shutil.rmtree(card.path / "vae")
    with pytest.raises(ModelFolderError, match="vae"):
        check_model_folder(card.path)
