"""The papermill runner: success, a failing stage, no overwrite, resume, and a batch that goes on."""

import json
import time
from pathlib import Path

import nbformat as nbf
import pytest

from ditbook.card import GateError
from ditbook.cli import main
from ditbook.runner import discover_stages, format_batch_table, resume_run, run_batch, start_run
from ditbook.runs import RunError, RunFolder

pytestmark = pytest.mark.slow


def _notebook(path: Path, body: str) -> None:
    nb = nbf.v4.new_notebook()
    params = nbf.v4.new_code_cell('CARD = ""\nRUN_DIR = ""\nOVERRIDES = {}\nINTERACTIVE = False')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbf.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, path)


@pytest.fixture
def stages_dir(tmp_path, monkeypatch):
    d = tmp_path / "notebooks"
    d.mkdir()
    _notebook(d / "01_first.ipynb", """
import json, pathlib
out = pathlib.Path(RUN_DIR) / "first"
out.mkdir(exist_ok=True)
(out / "image.txt").write_text("baseline")
(out / "results.json").write_text(json.dumps({"ok": True}))
""")
    _notebook(d / "02_second.ipynb", """
import os, pathlib
x = 1
if pathlib.Path(os.environ["DITBOOK_TEST_FLAG"]).exists():
    raise ValueError("second stage broke on purpose")
(pathlib.Path(RUN_DIR) / "second.txt").write_text("done")
""")
    (d / "notes.ipynb").write_text("{}")  # not a stage: no NN_ prefix
    flag = tmp_path / "fail.flag"
    monkeypatch.setenv("DITBOOK_NOTEBOOKS", str(d))
    monkeypatch.setenv("DITBOOK_TEST_FLAG", str(flag))
    monkeypatch.setenv("DITBOOK_OUTPUTS", str(tmp_path / "outputs"))
    return d, flag


@pytest.fixture
def card_path(tmp_path, good_card_text):
    p = tmp_path / "demo.yaml"
    p.write_text(good_card_text)
    return p


def test_discovers_stages_in_order(stages_dir):
    assert [s.name for s in discover_stages()] == ["first", "second"]


def test_success_and_no_overwrite(stages_dir, card_path, tmp_path):
    lines = []
    outcome = start_run(card_path, run_id="r1", log=lines.append)
    assert outcome.ok and [s.status for s in outcome.stages] == ["passed", "passed"]
    meta = outcome.run.read_meta()
    assert meta["status"] == "finished"
    assert meta["card_hash"] and meta["environment"]["versions"]["torch"]
    assert all(v["seconds"] > 0 for v in meta["stages"].values())
    assert (outcome.run.path / "01_first.ipynb").is_file()
    assert any("passed in" in l for l in lines)
    with pytest.raises(RunError, match="never overwritten"):
        start_run(card_path, run_id="r1", log=lines.append)
    with pytest.raises(RunError, match="finished"):
        resume_run(outcome.run.path, log=lines.append)


def test_failing_stage_then_resume(stages_dir, card_path, capsys):
    _, flag = stages_dir
    flag.write_text("x")
    code = main(["run", str(card_path), "--run-id", "r2"])
    assert code != 0
    out = capsys.readouterr().out
    assert "second stage broke on purpose" in out
    run = RunFolder(Path(stages_dir[0]).parent / "outputs" / "demo" / "r2")
    meta = run.read_meta()
    assert meta["status"] == "failed"
    st = meta["stages"]["second"]
    assert st["status"] == "failed" and "ValueError" in st["error"]
    assert "raise ValueError" in st["failing_cell"]
    # the earlier stage's outputs stay, and the failed notebook is kept with its error
    assert (run.path / "first" / "image.txt").read_text() == "baseline"
    assert "second stage broke on purpose" in (run.path / "02_second.ipynb").read_text()
    # resume continues at the failed stage only
    flag.unlink()
    outcome = resume_run(run.path, log=lambda s: None)
    assert [s.stage for s in outcome.stages] == ["second"] and outcome.ok
    assert run.read_meta()["status"] == "finished"


def test_resume_refuses_changed_card(stages_dir, card_path):
    _, flag = stages_dir
    flag.write_text("x")
    outcome = start_run(card_path, run_id="r3", log=lambda s: None)
    assert not outcome.ok
    card_path.write_text(card_path.read_text().replace("steps: 2", "steps: 3"))
    with pytest.raises(RunError, match="changed"):
        resume_run(outcome.run.path, log=lambda s: None)


def test_batch_goes_on_past_failures(stages_dir, card_path, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(card_path.read_text().replace("  class: FluxTransformer2DModel\n", "").replace("name: demo", "name: broken"))
    rows = run_batch([broken, card_path], stages=["first"], log=lambda s: None)
    assert rows[0].failure and "transformer.class" in rows[0].failure
    assert rows[1].failure is None and rows[1].passed == ["first"]
    table = format_batch_table(rows)
    assert "broken" in table and "first" in table


def test_unknown_stage_rejected(stages_dir, card_path):
    with pytest.raises(RunError, match="unknown stage"):
        start_run(card_path, stages=["nope"], log=lambda s: None)


# each probe notebook records whether its stage's package was imported before its first cell ran,
# in which process, when that process started, and the names its namespace holds. The start time
# comes from /proc to 1/CLK_TCK s on time.time()'s clock (psutil's create_time adds a boot time
# rounded to whole seconds: up to 1 s early, against the stages' time.time() stamps)
_PROBE = """
import json, os, pathlib, sys, time
_since_boot = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
seen = {"warm": "ditbook.%s.stage" in sys.modules, "pid": os.getpid(), "cwd": os.getcwd(),
        "born": time.time() - float(open("/proc/uptime").read().split()[0]) + _since_boot,
        "names": sorted(k for k in globals() if not k.startswith("_") and k not in ("In", "Out", "exit", "quit", "get_ipython", "open"))}
(pathlib.Path(RUN_DIR) / "%s.json").write_text(json.dumps(seen))
if pathlib.Path(os.environ["DITBOOK_TEST_FLAG"]).exists() and "%s" == "intake":
    raise ValueError("first stage broke on purpose")
"""


@pytest.fixture
def probe_stages(tmp_path, monkeypatch):
    d = tmp_path / "probe_notebooks"
    d.mkdir()
    for i, name in enumerate(("intake", "inspect", "cache"), 1):
        _notebook(d / f"{i:02d}_{name}.ipynb", _PROBE % (name, name, name))
    flag = tmp_path / "fail.flag"
    monkeypatch.setenv("DITBOOK_NOTEBOOKS", str(d))
    monkeypatch.setenv("DITBOOK_TEST_FLAG", str(flag))
    monkeypatch.setenv("DITBOOK_OUTPUTS", str(tmp_path / "outputs"))
    return d, flag


@pytest.fixture
def _since():
    return time.time() - 0.5


def _children(since: float) -> list:
    """This process's live children started since ``since`` (the test's own), with their command
    lines, so a failure names what was left."""
    import psutil

    return [f"{p.pid}: {' '.join(p.cmdline())[:160]}" for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != "zombie" and p.create_time() >= since]


def test_next_stage_kernel_is_started_ahead_with_its_imports_done(probe_stages, card_path, monkeypatch, _since):
    """While a stage runs, the next stage's kernel starts and imports that stage's package (and the
    card's pipeline class): its notebook finds them done, in its own kernel, in the run folder,
    with nothing added to its namespace; the first stage's kernel starts while the command checks
    the card, before the run folder exists, and is moved into it; turned off, every stage imports
    for itself."""
    outcome = start_run(card_path, run_id="ahead", log=lambda s: None)
    assert outcome.ok, outcome.stages
    seen = {n: json.loads((outcome.run.path / f"{n}.json").read_text()) for n in ("intake", "inspect", "cache")}
    assert [seen[n]["warm"] for n in ("intake", "inspect", "cache")] == [True, True, True]
    assert len({s["pid"] for s in seen.values()}) == 3  # a fresh kernel per stage, as before
    assert {s["cwd"] for s in seen.values()} == {str(outcome.run.path)}
    assert seen["inspect"]["names"] == seen["intake"]["names"]  # the warm-up leaves no name behind
    assert not _children(_since)  # every kernel shut down

    # two stages ahead by default: the cache stage's kernel was started before the intake stage
    # began (a short stage leaves the one after it no time to import); one ahead: when its turn
    # was one stage away
    began = {n: s["started"] for n, s in outcome.run.read_meta()["stages"].items()}
    assert seen["cache"]["born"] < began["intake"] < began["inspect"]
    monkeypatch.setenv("DITBOOK_KERNEL_AHEAD", "1")
    one = start_run(card_path, run_id="one", log=lambda s: None)
    assert one.ok
    born = {n: json.loads((one.run.path / f"{n}.json").read_text())["born"] for n in ("intake", "inspect", "cache")}
    began = {n: s["started"] for n, s in one.run.read_meta()["stages"].items()}
    assert began["intake"] < born["cache"] < began["inspect"] and born["inspect"] < began["intake"]
    assert json.loads((one.run.path / "cache.json").read_text())["warm"]
    assert not _children(_since)

    monkeypatch.setenv("DITBOOK_KERNEL_AHEAD", "0")
    off = start_run(card_path, run_id="off", log=lambda s: None)
    assert off.ok and not json.loads((off.run.path / "inspect.json").read_text())["warm"]
    assert not json.loads((off.run.path / "intake.json").read_text())["warm"]
    monkeypatch.setenv("DITBOOK_KERNEL_AHEAD", "some")
    with pytest.raises(RunError, match="DITBOOK_KERNEL_AHEAD"):
        start_run(card_path, run_id="bad", log=lambda s: None)


def test_first_kernel_started_ahead_goes_when_the_start_check_refuses(probe_stages, card_path, tmp_path,
                                                                      monkeypatch, _since):
    """A card that loads but fails the start check (an unregistered strategy): the first stage's
    kernel, already started, is shut down, and no run folder is made."""
    import ditbook.runner as runner

    started = []

    def spy(*args, **kwargs):
        started.append(runner_start(*args, **kwargs))
        return started[-1]

    runner_start = runner.start_ahead
    monkeypatch.setattr(runner, "start_ahead", spy)
    bad = tmp_path / "bad.yaml"
    bad.write_text(card_path.read_text().replace("name: demo", "name: bad") + "cache:\n  strategies: [nosuchstrategy]\n")
    with pytest.raises(GateError, match="nosuchstrategy"):
        start_run(bad, run_id="refused", log=lambda s: None)
    assert started and started[0] is not None  # it was started, before the refusal
    assert not _children(_since)
    assert not (tmp_path / "outputs" / "bad").exists()


def test_kernel_started_ahead_is_shut_down_when_its_stage_never_comes(probe_stages, card_path, _since):
    _, flag = probe_stages
    flag.write_text("x")
    outcome = start_run(card_path, run_id="broken", log=lambda s: None)
    assert [s.status for s in outcome.stages] == ["failed"]
    assert not (outcome.run.path / "inspect.json").exists()
    assert not _children(_since)  # the inspect stage's kernel, started ahead, is gone too
