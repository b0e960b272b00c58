"""The intake form's logic, headless: which fields it asks for, and the card it writes."""

import yaml

from ditbook.intake.card_form import card_form, complete_card, fields_to_ask, save_answers
from ditbook.card import gate_problems


def test_form_asks_for_what_the_gate_names(tmp_path, good_card_text):
    p = tmp_path / "c.yaml"
    p.write_text(good_card_text.replace("  class: FluxTransformer2DModel\n", "").replace("pipeline:\n  class: FluxPipeline\n  source: diffusers\n", ""))
    _, problems = gate_problems(p)
    assert fields_to_ask(problems) == ["pipeline.class", "pipeline.source", "transformer.class"]


def test_answers_complete_the_card(tmp_path, good_card_text):
    p = tmp_path / "c.yaml"
    p.write_text(good_card_text.replace("  class: FluxTransformer2DModel\n", ""))
    target, left = save_answers(p, {"transformer.class": "FluxTransformer2DModel", "path": ""})
    assert left == []
    data = yaml.safe_load(target.read_text())
    assert data["transformer"] == {"source": "diffusers", "class": "FluxTransformer2DModel"}
    assert complete_card({}, {"pipeline.class": "X"}) == {"pipeline": {"class": "X"}}


def test_widget_builds_headless(tmp_path, good_card_text):
    p = tmp_path / "c.yaml"
    p.write_text(good_card_text.replace("  class: FluxTransformer2DModel\n", ""))
    _, problems = gate_problems(p)
    form = card_form(p, problems)
    texts = [c for c in form.children if type(c).__name__ == "Text"]
    assert [t.description for t in texts] == ["transformer.class"]
