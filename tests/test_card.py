"""The model card schema and the gate check: each kind of bad card gives its own message."""

import subprocess
import sys
from pathlib import Path

import pytest

from ditbook.card import GateError, gate_check, gate_problems, load_card
from ditbook.cli import main


def _card(tmp_path, text, name="card.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_card_passes(tmp_path, good_card_text, model_dir):
    card = gate_check(_card(tmp_path, good_card_text))
    assert card.name == "demo"
    assert card.path == model_dir
    assert card.transformer.cls == "FluxTransformer2DModel"
    assert card.generation.steps == 2


def test_missing_transformer_class_named(tmp_path, good_card_text):
    text = good_card_text.replace("  class: FluxTransformer2DModel\n", "")
    with pytest.raises(GateError) as err:
        gate_check(_card(tmp_path, text))
    assert "transformer.class" in str(err.value)
    assert len(err.value.problems) == 1


def test_missing_path_and_nonexistent_path(tmp_path, good_card_text, model_dir):
    _, problems = gate_problems(_card(tmp_path, good_card_text.replace(f"path: {model_dir}\n", "")))
    assert any(p.startswith("path: missing") for p in problems)
    _, problems = gate_problems(_card(tmp_path, good_card_text.replace(str(model_dir), "/nonexistent/model")))
    assert any("/nonexistent/model" in p and p.startswith("path:") for p in problems)


def test_every_problem_listed_at_once(tmp_path):
    _, problems = gate_problems(_card(tmp_path, "name: x\ngeneration: {prompts: [a]}\n"))
    joined = "\n".join(problems)
    for field in ("path: missing", "pipeline: missing", "transformer: missing"):
        assert field in joined
    assert len(problems) == 3


def test_unknown_class_and_bad_module_and_missing_file(tmp_path, good_card_text):
    _, p1 = gate_problems(_card(tmp_path, good_card_text.replace("class: FluxPipeline", "class: NoSuchPipeline")))
    assert any(p.startswith("pipeline.class:") and "NoSuchPipeline" in p for p in p1)
    _, p2 = gate_problems(_card(tmp_path, good_card_text.replace("source: diffusers\ntransformer", "source: not_a_module_xyz\ntransformer")))
    assert any(p.startswith("pipeline.source:") and "not_a_module_xyz" in p for p in p2)
    _, p3 = gate_problems(_card(tmp_path, good_card_text.replace(
        "  class: FluxTransformer2DModel\n  source: diffusers", "  class: MyDiT\n  source: code/my_dit.py")))
    assert any(p.startswith("transformer.source:") and "my_dit.py" in p and "does not exist" in p for p in p3)


def test_third_party_file_source_imports_relative_to_card(tmp_path, good_card_text):
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_dit.py").write_text("class MyDiT:\n    pass\n")
    text = good_card_text.replace("  class: FluxTransformer2DModel\n  source: diffusers",
                                  "  class: MyDiT\n  source: code/my_dit.py")
    card = gate_check(_card(tmp_path, text))
    assert card.resolve_source(card.transformer.source) == str(code / "my_dit.py")
    _, problems = gate_problems(_card(tmp_path, text.replace("class: MyDiT", "class: Other")))
    assert any("Other" in p and p.startswith("transformer.class:") for p in problems)


def test_env_var_expansion(tmp_path, good_card_text, model_dir, monkeypatch):
    monkeypatch.setenv("DITBOOK_TEST_MODEL", str(model_dir))
    text = good_card_text.replace(f"path: {model_dir}", "path: ${DITBOOK_TEST_MODEL}")
    assert gate_check(_card(tmp_path, text)).path == model_dir
    monkeypatch.delenv("DITBOOK_TEST_MODEL")
    _, problems = gate_problems(_card(tmp_path, text))
    assert any("DITBOOK_TEST_MODEL" in p for p in problems)


def test_schema_errors(tmp_path, good_card_text):
    _, problems = gate_problems(_card(tmp_path, "- just\n- a list\n"))
    assert "mapping" in problems[0]
    _, problems = gate_problems(_card(tmp_path, "name: [unclosed\n"))
    assert "not valid YAML" in problems[0]
    _, problems = gate_problems(_card(tmp_path, good_card_text + "  sampler: euler\n"))
    assert "generation.extra" in problems[0]
    _, problems = gate_problems(_card(tmp_path, good_card_text.replace("steps: 2", "steps: -1")))
    assert any(p.startswith("generation.steps") for p in problems)
    _, problems = gate_problems(tmp_path / "absent.yaml")
    assert "not found" in problems[0]


def test_overrides_and_hash(tmp_path, good_card_text):
    path = _card(tmp_path, good_card_text)
    card = load_card(path)
    c2 = load_card(path, {"steps": 5, "runtime.dtype": "bfloat16"})
    assert c2.generation.steps == 5 and c2.runtime.dtype == "bfloat16"
    assert c2.content_hash() != card.content_hash()
    assert load_card(path).content_hash() == card.content_hash()


def test_check_command_exit_codes(tmp_path, good_card_text, capsys):
    # the card is complete but its model folder is empty: check reads the folder too (issue 18)
    assert main(["check", str(_card(tmp_path, good_card_text))]) == 2
    assert "model_index.json" in capsys.readouterr().err
    bad = _card(tmp_path, good_card_text.replace("  class: FluxTransformer2DModel\n", ""), "bad.yaml")
    assert main(["check", str(bad)]) != 0
    assert "transformer.class" in capsys.readouterr().err
    # the installed console script and python -m behave the same
    proc = subprocess.run([sys.executable, "-m", "ditbook", "check", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "transformer.class" in proc.stderr


def test_types_and_ranges_named_by_dotted_key(tmp_path, good_card_text):
    """Values a stage would fail on (issue 18.5) are refused by the gate, each by its dotted name."""
    text = (good_card_text.replace("steps: 2", "steps: true").replace("height: 32", "height: 7")
            + "  guidance_scale: lots\n  extra: notadict\nbenchmark: {repeat: 3}\ncache: {gates: {psnr: abc}}\n")
    _, problems = gate_problems(_card(tmp_path, text))
    for key in ("generation.steps", "generation.height", "generation.guidance_scale", "generation.extra",
                "benchmark.repeat", "cache.gates.psnr"):
        assert any(p.startswith(f"{key}: ") for p in problems), (key, problems)
    _, problems = gate_problems(_card(tmp_path, good_card_text), {"benchmark.repeat": 3, "steps": True})
    assert any(p.startswith("benchmark.repeat: ") and "-p" in p for p in problems)
    assert any(p.startswith("generation.steps: ") and "-p" in p for p in problems)
    with pytest.raises(GateError, match="generation.steps"):
        gate_check(_card(tmp_path, good_card_text.replace("steps: 2", "steps: 20000")))
