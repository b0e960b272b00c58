"""Upstreamable output of the cache stage: the adapter module (cache-dit's adapter layout), the
CP planner (cache-dit's planner format) and the example script run in a fresh interpreter that
has diffusers and cache-dit but not ditbook, and reproduce the stage's cached images; a broken
adapter file does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_cache import prepared_run, session_for, tiny_card  # noqa: E402

SITE = sysconfig.get_paths()["purelib"]


def fresh(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A Python without ditbook: no site processing (the editable install's .pth is never read),
    only the environment's site-packages on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = SITE
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    from ditbook.cache.upstream import write_upstream
    from ditbook.cp.plan import capture_transformer_call, plan_to_jsonable, resolve_cp_plan

    tmp = tmp_path_factory.mktemp("upstream")
    card = tiny_card(tmp, seeds=(0,), prompts=("a red square",))
    run, pipe, report = prepared_run(card, tmp / "outputs")
    s = session_for(card, run, pipe, report, only=["dbcache"], max_configs=2)
    s.noise_floor(other_backend=False)
    s.tune()
    assert s.choose() is not None and s.chosen.name == "dbcache"
    up = write_upstream(s)
    cp = resolve_cp_plan(pipe.transformer, capture=lambda: capture_transformer_call(pipe, s.card))
    return s, up, plan_to_jsonable(cp.plan), tmp


def _images(folder: Path) -> dict:
    return {p.stem: np.load(p) for p in sorted(folder.glob("*.npy"))}


def test_written_files_are_plain_modules(stage):
    s, up, _, _ = stage
    folder = Path(up.folder)
    assert folder == s.ctx.dir / "upstream"
    assert (up.adapter_module, up.cp_planner, up.example) == ("tiny_gqa_adapter.py", "tiny_gqa_cp_planner.py",
                                                             "tiny_gqa_example.py")
    for name in (up.adapter_module, up.cp_planner, up.example):
        text = (folder / name).read_text()
        compile(text, name, "exec")
        assert "exec(" not in text and "import ditbook" not in text and "from ditbook" not in text, name
        assert "ditbook_user_" not in text and "ditbook_generated" not in text, name
    adapter = (folder / up.adapter_module).read_text()
    # the shipped file is the very text the stage imported and ran, not a second rendering
    assert adapter == (s.ctx.dir / f"{s.adapter.info.module_name}.py").read_text() == s.adapter.source
    assert "@BlockAdapterRegister.register('TinyPipeline')\ndef tiny_adapter(pipe, **kwargs) -> BlockAdapter:" in adapter
    assert "class TinyGQATransformerPatchFunctor(PatchFunctor):" in adapter
    assert "def _blocks_loop_body(owner, index, block, x, context, *, temb=None" in adapter
    assert "class TinyGQATransformerContextParallelismPlanner(ContextParallelismPlanner):" in \
        (folder / up.cp_planner).read_text()
    assert json.loads((folder / "upstream.json").read_text())["example_strategy"]["name"] == "dbcache"


def test_fresh_interpreter_without_ditbook_runs_the_modules(stage):
    s, up, plan, _ = stage
    folder = Path(up.folder)
    check = fresh(["-c", """
import json, sys
sys.path.insert(0, '.')
try:
    import ditbook
    raise SystemExit('ditbook is importable')
except ModuleNotFoundError:
    pass
sys.path.insert(0, %r)
import tiny_gqa_adapter, tiny_gqa_cp_planner
from cache_dit import BlockAdapter, BlockAdapterRegister
assert BlockAdapterRegister._adapters['TinyPipeline'] is tiny_gqa_adapter.tiny_adapter
planner = tiny_gqa_cp_planner.register_cp_planner()
from cache_dit.distributed.transformers.register import ContextParallelismPlannerRegister
assert ContextParallelismPlannerRegister.get_planner('TinyGQATransformer') is planner
plan = planner()._apply()
out = {k: ({str(i): vars(x) for i, x in v.items()} if isinstance(v, dict) else vars(v)) for k, v in plan.items()}
print(json.dumps(out))
""" % str(TESTS)], folder)
    assert check.returncode == 0, check.stderr[-3000:]
    theirs = json.loads(check.stdout.strip().splitlines()[-1])
    assert set(theirs) == set(plan)
    for key, value in plan.items():
        mine = value if "gather_dim" in value else {str(k): v for k, v in value.items()}
        got = theirs[key]
        if "gather_dim" in mine:
            assert (got["gather_dim"], got["expected_dims"]) == (mine["gather_dim"], mine["expected_dims"])
        else:
            for i, v in mine.items():
                assert (got[i]["split_dim"], got[i]["split_output"]) == (v["split_dim"], v["split_output"])


def test_example_reproduces_the_stage_cached_output(stage):
    s, up, _, tmp = stage
    folder = Path(up.folder)
    cached = fresh([up.example, "--out", str(tmp / "cached")], folder)
    assert cached.returncode == 0, cached.stderr[-3000:]
    uncached = fresh([up.example, "--out", str(tmp / "uncached"), "--no-cache"], folder)
    assert uncached.returncode == 0, uncached.stderr[-3000:]
    chosen = _images(s.ctx.dir / "images" / "chosen")
    got, plain = _images(tmp / "cached"), _images(tmp / "uncached")
    assert set(got) == set(chosen) == set(plain) == set(s.baseline)
    for key in chosen:
        assert np.max(np.abs(got[key] - chosen[key])) <= 1e-5, key  # the stage's cached output
        assert np.max(np.abs(plain[key] - s.baseline[key])) <= 1e-5, key  # and its baseline
        assert np.max(np.abs(got[key] - plain[key])) > 1e-4, key  # the cache really acted


def test_broken_adapter_file_does_not_reproduce(stage):
    """A deliberately wrong adapter (the loop body's outputs declared in the other order) is caught
    by the same comparison: the example fails or its images differ."""
    import shutil

    s, up, _, tmp = stage
    broken = tmp / "broken"
    shutil.copytree(up.folder, broken)
    path = broken / up.adapter_module
    text = path.read_text()
    assert "ForwardPattern.Pattern_0" in text
    path.write_text(text.replace("ForwardPattern.Pattern_0", "ForwardPattern.Pattern_1"))
    run = fresh([up.example, "--out", str(tmp / "broken_out")], broken)
    chosen = _images(s.ctx.dir / "images" / "chosen")
    if run.returncode == 0:
        got = _images(tmp / "broken_out")
        assert max(float(np.max(np.abs(got[k] - chosen[k]))) for k in chosen) > 1e-3
    else:  # it failed for the swap (cache-dit's blocks met the other stream), not for any other reason
        assert "cache_dit/caching/cache_blocks" in run.stderr and "must match the size of tensor" in run.stderr, \
            run.stderr[-1500:]


def test_reproduction_started_ahead_gives_the_fresh_process_result_and_catches_a_broken_module(stage):
    """``start_reproduction`` starts the fresh process early (its imports overlap the stage); handed
    the spec it reproduces the chosen images exactly as a process started at its turn does, and a
    broken adapter module still fails there. An unused one ends when told to."""
    import shutil

    from ditbook.cache.reproduce import Ahead

    s, up, _, tmp = stage
    s.start_reproduction()
    ahead = s._ahead
    assert ahead is not None and ahead.proc.poll() is None
    warm = s.reproduce()
    assert s._ahead is None and ahead.proc.returncode == 0
    assert warm.ran and warm.ok and warm.max_abs <= s.card.cache.reproduce_tolerance, warm
    cold = s.reproduce()  # no process ahead now: started at its turn
    assert cold.ok and cold.per_image == warm.per_image

    module = s.ctx.dir / f"{s.adapter.info.module_name}.py"
    saved = tmp / "saved_adapter.py"
    shutil.copy(module, saved)
    try:
        module.write_text(module.read_text().replace("ForwardPattern.Pattern_0", "ForwardPattern.Pattern_1"))
        s.start_reproduction()
        broken = s.reproduce()
        assert broken.ran and not broken.ok, broken
    finally:
        shutil.copy(saved, module)

    idle = Ahead(device="cpu")  # started with the stage's device, which it warms after its imports
    assert idle.proc.args[-1] == "--device=cpu"
    idle.close()
    assert idle.proc.poll() is not None
