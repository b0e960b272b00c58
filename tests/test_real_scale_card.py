"""``benchmarks/real_scale.py`` writes the card a user would write for the built pipeline, with
``--set KEY=VALUE`` settings on top (how the FLUX-shaped run with ``cache.fp8`` was made), and
ditbook reads it as written."""

from __future__ import annotations

import pytest

import real_scale
from ditbook.card import CardError, load_card


def test_set_settings_land_in_the_card_ditbook_reads(tmp_path):
    card = tmp_path / "real_flux.yaml"
    real_scale.write_card("flux", tmp_path / "pipeline", {"pipeline": "FluxPipeline",
                                                          "transformer": "FluxTransformer2DModel"}, card,
                          settings=["cache.fp8=true", "cache.fp8_keep=[0.0, 0.5]", "runtime.compile=true"])
    c = load_card(str(card), {})
    assert c.cache.fp8 is True and c.cache.fp8_keep == [0.0, 0.5] and c.runtime.compile is True
    # the shape's own settings stay, and the shared table is not changed for the next card
    assert c.cache.strategies == real_scale.CARDS["flux"]["cache"]["strategies"] and c.generation.steps == 20
    assert "fp8" not in real_scale.CARDS["flux"]["cache"]


def test_a_set_setting_ditbook_does_not_know_is_refused_by_the_card(tmp_path):
    card = tmp_path / "real_flux.yaml"
    real_scale.write_card("flux", tmp_path / "pipeline", {"pipeline": "FluxPipeline",
                                                          "transformer": "FluxTransformer2DModel"}, card,
                          settings=["cache.fp9=true"])
    with pytest.raises(CardError, match="fp9"):
        load_card(str(card), {})
