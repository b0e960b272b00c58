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


def test_run_without_card_or_resume(capsys):
    """What the user gave is incomplete: exit 2 (as the README promises), one line naming both ways."""
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert "give a CARD" in err and "--resume RUN_DIR" in err and "Traceback" not in err


def test_every_help_names_debug_and_the_commands_show_examples(capsys):
    """``--debug`` is in every command's help; each top-level command ends with examples; ``run``
    says it stops at the plan's approval and how to go on; the top help walks one's own model."""
    import argparse

    from ditbook.cli import EXAMPLES, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top = _help([], capsys)
    assert "--debug" in top and "ditbook approve" in top and "run --resume" in top
    for name in sub.choices:
        text = _help([name], capsys)
        assert "--debug" in text, name
        assert name in EXAMPLES and "examples:" in text and f"ditbook {name}" in text.split("examples:")[1], name
    run = " ".join(_help(["run"], capsys).split())
    assert "stops after inspect" in run and "ditbook approve" in run and "--resume" in run


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv + ["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _first_line_after_usage(text: str) -> str:
    """The first paragraph after argparse's usage block: the command's description."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    assert paragraphs[0].startswith("usage:"), text
    return " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""


def test_help_says_what_the_tool_and_every_subcommand_does(capsys):
    """``ditbook --help`` opens with what the tool does (not a developer's note); every
    subcommand, nested ones included, opens with a description line; ``--stages`` lists the
    stage names; compare's cell-output option does not clash with ``--outputs DIR``."""
    import argparse

    from ditbook.cli import build_parser
    from ditbook.runner import discover_stages

    top = _first_line_after_usage(_help([], capsys))
    assert top.startswith("ditbook takes a new diffusion transformer") and "report" in top, top
    assert "commands.py" not in top and "register(" not in top

    def commands(parser, path=()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield path + (name,)
                    yield from commands(sub, path + (name,))

    names = list(commands(build_parser()))
    assert len(names) >= 12 and ("zoo", "build") in names
    for argv in names:
        first = _first_line_after_usage(_help(list(argv), capsys))
        assert first and first[0].isupper() and not first.startswith(("positional", "options")), (argv, first)
    run_help = " ".join(_help(["run"], capsys).split())
    stages = [s.name for s in discover_stages()]
    assert len(stages) >= 5 and ", ".join(stages) in run_help, run_help
    compare_help = _help(["compare"], capsys)
    assert "--cell-outputs" in compare_help and "--outputs" not in compare_help.replace("--cell-outputs", "")
