"""CLI error paths and the zoo commands."""

import pytest

from ditbook.cli import main


def test_zoo_list(capsys):
    assert main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("flux", "qwenimage", "sd3", "wan", "hunyuandit", "thirdparty"):
        assert name in out


def test_zoo_build_unknown_name(tmp_path, capsys):
    assert main(["zoo", "build", "nope", str(tmp_path)]) == 2
    assert "unknown model" in capsys.readouterr().out


def test_zoo_build_makes_a_card_that_passes_the_gate(tmp_path, capsys):
    assert main(["zoo", "build", "flux", str(tmp_path)]) == 0
    assert main(["check", str(tmp_path / "flux.yaml")]) == 0


def test_bad_override_and_missing_card(tmp_path, capsys):
    assert main(["check", str(tmp_path / "x.yaml"), "-p", "novalue"]) == 2
    assert "-p expects key=value" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "x.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_run_without_card_or_resume():
    with pytest.raises(SystemExit):
        main(["run"])


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
