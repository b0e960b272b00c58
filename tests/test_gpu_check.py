"""The GPU check's record (issue 24 item 2): ``docs/gpu-check.json`` was made on the code in this
checkout (its tree digest matches), on a GPU, with both shipped cards and the benchmark recorded.
A change to ``lib/``, ``notebooks/`` or ``models/`` after the last GPU check fails here until
``make gpu-check`` is run on a GPU host on the new revision and its record committed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_check

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "docs" / "gpu-check.json"


def test_record_was_made_on_this_code():
    rec = json.loads(RECORD.read_text())
    assert rec["tree_digest"] == gpu_check.tree_digest(), (
        "docs/gpu-check.json was made on other code than this checkout's lib/, notebooks/ or models/: "
        "run `make gpu-check` on a GPU host on this revision and commit the record")
    assert rec.get("digest_method") == gpu_check.DIGEST_METHOD, "the record's digest was made another way: recompute it"
    assert len(rec["revision"]) == 40 and int(rec["revision"], 16) >= 0
    assert rec["device"] != "cpu" and rec["gpus"] >= 1
    assert {Path(c["card"]).name for c in rec["cards"]} == {Path(c).name for c in gpu_check.CARDS}
    for c in rec["cards"]:  # every card's five stages are recorded with a status and their seconds
        assert set(c["stages"]) == {"intake", "inspect", "cache", "parallel", "benchmark"}, c
        assert all(s["status"] and s["seconds"] is not None for s in c["stages"].values()), c
    assert {r["row"] for r in rec["benchmark"]["rows"]} == set(gpu_check.BENCH_ROWS.split(","))


def test_digest_sees_a_change_and_ignores_caches(tmp_path):
    for part in gpu_check.DIGEST_PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "lib" / "a.py").write_text("x = 1\n")
    before = gpu_check.tree_digest(tmp_path)
    (tmp_path / "lib" / "__pycache__").mkdir()
    (tmp_path / "lib" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "lib" / "pkg.egg-info").mkdir()
    (tmp_path / "lib" / "pkg.egg-info" / "PKG-INFO").write_text("v")
    assert gpu_check.tree_digest(tmp_path) == before
    (tmp_path / "lib" / "a.py").write_text("x = 2\n")
    assert gpu_check.tree_digest(tmp_path) != before


def test_a_dirty_tree_is_refused(tmp_path, monkeypatch):
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f").write_text("1")
    run("add", "f")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    rev, dirty = gpu_check.git_revision(tmp_path)
    assert len(rev) == 40 and dirty is False
    (tmp_path / "f").write_text("2")
    assert gpu_check.git_revision(tmp_path)[1] is True
    monkeypatch.setattr(gpu_check, "git_revision", lambda root=None: (rev, True))
    with pytest.raises(SystemExit):
        gpu_check.main(["--record", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


def test_benchmark_rows_carry_median_spread_and_ratio():
    result = {"rows": [{"row": "eager", "status": "measured", "speedup": 1.0, "first_call_s": 5.9,
                        "timing": {"end_to_end": {"median": 5.0, "min": 4.9, "max": 5.1, "n": 3},
                                   "parts": {"transformer_step": {"median": 0.17}}, "peak_memory_mb": 25e3},
                        "gap": {"computed_step_s": 0.18, "at_bf16_peak_s": 0.09, "of_bf16_peak": 0.5}}]}
    (row,) = gpu_check.benchmark_rows(result)
    assert row == {"row": "eager", "status": "measured", "end_to_end_s": 5.0, "min_s": 4.9, "max_s": 5.1, "n": 3,
                   "transformer_step_s": 0.17, "speedup": 1.0, "first_call_s": 5.9, "peak_memory_mb": 25e3,
                   "computed_step_s": 0.18, "at_bf16_peak_s": 0.09, "of_bf16_peak": 0.5, "at_fp8_peak_s": None,
                   "of_fp8_peak": None}


def test_digest_ignores_comments_but_not_code_or_docstrings(tmp_path):
    """A comment changes nothing that runs and needs no new GPU check; a docstring, a name, a
    number or a notebook does. A file that does not tokenize counts byte for byte."""
    for part in gpu_check.DIGEST_PARTS:
        (tmp_path / part).mkdir()
    src = 'def f(x):\n    """Double."""\n    return x * 2\n'
    (tmp_path / "lib" / "m.py").write_text(src)
    (tmp_path / "notebooks" / "n.ipynb").write_text("{}")
    base = gpu_check.tree_digest(tmp_path)
    (tmp_path / "lib" / "m.py").write_text("# a note\n" + src.replace("x * 2\n", "x * 2  # why\n") + "\n# long: end\n")
    assert gpu_check.tree_digest(tmp_path) == base
    for changed in (src.replace("Double", "Twice"), src.replace("2", "3"), src.replace("x", "y")):
        (tmp_path / "lib" / "m.py").write_text(changed)
        assert gpu_check.tree_digest(tmp_path) != base, changed
    (tmp_path / "lib" / "m.py").write_text(src)
    (tmp_path / "notebooks" / "n.ipynb").write_text('{"cells": []}')
    assert gpu_check.tree_digest(tmp_path) != base
    broken = tmp_path / "lib" / "broken.py"
    broken.write_text('def f(:\n    """unterminated\n')
    one = gpu_check.tree_digest(tmp_path)
    broken.write_text('def f(:\n    """unterminated  # c\n')
    assert gpu_check.tree_digest(tmp_path) != one


def test_phases_are_the_time_outside_the_stages():
    """Before the first stage (the command's start), the gaps between stages, after the last (the
    report), whatever order the stages are listed in; nothing when no stage started."""
    stages = {"inspect": {"started": 120.0, "seconds": 10.0}, "intake": {"started": 104.0, "seconds": 15.0},
              "cache": {"started": 131.5, "seconds": 20.0}, "parallel": {"started": None, "seconds": None}}
    assert gpu_check.phases(stages, 100.0, 155.0) == {"before_first_stage_s": 4.0, "between_stages_s": 2.5,
                                                       "after_last_stage_s": 3.5}
    assert gpu_check.phases({"intake": {"status": "pending"}}, 0.0, 1.0) == {}


def test_python_files_count_as_their_text_without_comments(tmp_path):
    """The digest reads a Python file as its text with the comments cut out (the same under every
    Python version: 3.12 splits f-strings into tokens where 3.11 has one, which a token-based digest
    saw as a change); a '#' inside a string stays, a blank line inside a string stays."""
    f = tmp_path / "m.py"
    f.write_text('x = f"{a} # not a comment"  # a comment\n\n# only a comment\ndef g():\n    """doc\n\n    more"""   \n'
                 '    return {"k": f"{x!r:>4}"}\n')
    assert gpu_check.code_bytes(f) == ('x = f"{a} # not a comment"\ndef g():\n    """doc\n\n    more"""\n'
                                       '    return {"k": f"{x!r:>4}"}').encode()


def _finished_line(**extra) -> str:
    """The outcome line of a novel model whose five stages passed, as ``tests.novel.runs`` prints it."""
    return json.dumps({"stages": dict.fromkeys(("intake", "inspect", "cache", "parallel", "benchmark"), "passed"),
                       **extra, "problems": []})


def test_novel_models_run_beside_the_cards_and_each_gets_a_row(tmp_path):
    # three stand-ins for `python -m tests.novel.runs NAME`: one finishes, one crashes, one hangs
    line = _finished_line(cache={"chosen": "x"}, plans={}, not_run={})
    scripts = {"ok": f"print('progress'); print({line!r})", "bad": "import sys; sys.exit(3)",
               "slow": "import sys, time; print('[novel slow] ditbook run: exit 0 at 1 s', file=sys.stderr, "
                       "flush=True); time.sleep(120)"}
    command = lambda name, root, device: [sys.executable, "-c", scripts[name]]  # noqa: E731
    # 10 s: time for a Python to start and print on a loaded 2-core machine; "slow" never ends by itself
    poll = gpu_check.start_novel(["ok", "bad", "slow"], tmp_path, tmp_path, jobs=2, timeout=10.0, command=command)
    assert poll() is None  # two started, the third waits for a free slot
    rows = {r["model"]: r for r in poll(block=True)}
    assert rows["ok"]["status"] == "finished" and rows["ok"]["problems"] == [] and rows["ok"]["cache"] == {"chosen": "x"}
    assert rows["bad"]["status"] == "failed (exit 3)"
    assert rows["slow"]["status"] == "timeout after 10 s" and rows["slow"]["seconds"] < 60
    assert rows["slow"]["reached"] == "[novel slow] ditbook run: exit 0 at 1 s"  # how far it got


def test_novel_only_adds_to_a_record_of_this_code_and_refuses_another(tmp_path, monkeypatch):
    line = _finished_line()
    monkeypatch.setattr(gpu_check, "novel_command", lambda name, root, device: [sys.executable, "-c", f"print({line!r})"])
    record = tmp_path / "rec.json"
    base = {"tree_digest": gpu_check.tree_digest(), "cards": [{"status": "finished"}],
            "benchmark": {"status": "passed"}, "passed": True}
    record.write_text(json.dumps({**base, "tree_digest": "0" * 64}))
    argv = ["--novel-only", "--novel", "fluxref,batchcfg", "--record", str(record), "--work", str(tmp_path / "w"),
            "--revision", "a" * 40, "--novel-device", "cuda"]
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(argv)
    assert stop.value.code == 2 and "novel" not in json.loads(record.read_text())
    record.write_text(json.dumps(base))
    assert gpu_check.main(argv) == 0
    rec = json.loads(record.read_text())
    assert [r["model"] for r in rec["novel"]["models"]] == ["fluxref", "batchcfg"]
    assert rec["novel"]["passed"] and rec["passed"] and rec["benchmark"] == {"status": "passed"}
    assert "--novel-device cuda" in rec["novel"]["command"] and rec["novel"]["revision"] == "a" * 40


@pytest.mark.parametrize("beside", [False, True])
def test_novel_models_start_after_the_cards_unless_asked_beside_them(tmp_path, monkeypatch, beside):
    """The cards' times are a user's wait: by default the novel suite starts when they are done."""
    line = _finished_line()
    flag = tmp_path / "novel-started"
    monkeypatch.setattr(gpu_check, "novel_command", lambda name, root, device: [
        sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(flag)!r}).write_text(repr(time.time())); "
                              f"print({line!r})"])
    seen = {}

    def cards(names, outputs, log_dir, timeout, one_at_a_time):
        import time

        # beside: the model's process starts while the cards run (waited for, however loaded the
        # machine); after: it has not started when the cards end, and starts after that (below)
        deadline = time.time() + (60 if beside else 1)
        while not flag.exists() and time.time() < deadline:
            time.sleep(0.05)
        seen["novel_during_cards"] = flag.exists()
        seen["cards_end"] = time.time()
        return [{"card": c, "status": "finished", "seconds": 3.0, "stages": {}} for c in names]

    monkeypatch.setattr(gpu_check, "run_cards", cards)
    monkeypatch.setattr(gpu_check, "run_benchmark", lambda *a, **k: {"status": "passed", "rows": []})
    argv = ["--record", str(tmp_path / "r.json"), "--work", str(tmp_path / "w"), "--revision", "b" * 40,
            "--novel", "fluxref", "--novel-device", "cpu"] + (["--novel-beside-cards"] if beside else [])
    assert gpu_check.main(argv) == 0
    rec = json.loads((tmp_path / "r.json").read_text())
    assert seen["novel_during_cards"] is beside
    if not beside:
        assert float(flag.read_text()) >= seen["cards_end"]
    assert rec["novel"]["run"] == ("beside the cards" if beside else "after the cards") and rec["novel"]["passed"]
