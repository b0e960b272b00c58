"""``+graph`` plans: the CUDA-graph replay wrapper, checked on the CPU with a capturer that
replays like a graph does (reads the static input buffers, writes the static output buffers).

The GPU capture itself (``CudaCapturer``) runs in the GPU benchmark (docs/benchmarks.md)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._pytree import tree_flatten

from ditbook.parallel import parse_plan, run_plans
from ditbook.accel.graphs import Capturer, GraphUnavailable, StepGraphs, install_step_graphs, signature
from ditbook.parallel.plans import PlanNameError, plan_name

launch_mod = importlib.import_module("ditbook.parallel.launch")  # the module, not the function


class ReplayLikeAGraph(Capturer):
    """Runs ``fn`` once at capture; a replay runs it again on the same static inputs and copies
    the result into the first run's output tensors, as a replayed graph overwrites its outputs."""

    def __init__(self):
        self.captures = 0

    def capture(self, fn):
        self.captures += 1
        out = fn()

        def replay():
            for static, new in zip(tree_flatten(out)[0], tree_flatten(fn())[0]):
                static.copy_(new)
        return replay, out


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, *, scale=None, return_dict=True):
        y = self.lin(x) * (scale if scale is not None else 1.0)
        return {"sample": y} if return_dict else (y,)


def test_replays_read_new_inputs_and_outputs_are_copies():
    m = Block()
    eager = Block()
    cap = ReplayLikeAGraph()
    g = StepGraphs(m, warmup=2, capturer=cap)
    xs = [torch.randn(3, 8) for _ in range(6)]
    outs = [m(x, scale=torch.tensor(2.0), return_dict=False)[0] for x in xs]
    for x, out in zip(xs, outs):  # every output still right: a replay never overwrote an earlier one
        torch.testing.assert_close(out, eager(x, scale=torch.tensor(2.0), return_dict=False)[0])
    assert cap.captures == 1
    assert g.stats.eager_calls == 2 and g.stats.replays == 4 and g.stats.captured == 1
    assert g.stats.disabled is None


def test_each_signature_gets_its_own_graph_and_too_many_fall_back_to_eager():
    m, eager = Block(), Block()
    g = StepGraphs(m, warmup=1, max_graphs=2, capturer=ReplayLikeAGraph())
    for rows in (1, 2, 1, 2, 3, 3):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(m(x)["sample"], eager(x)["sample"])
    assert g.stats.captured == 2
    assert g.stats.disabled == "more than 2 call signatures"
    x = torch.randn(1, 8)  # after disabling: eager, still right
    torch.testing.assert_close(m(x)["sample"], eager(x)["sample"])


def test_a_python_value_is_part_of_the_signature():
    a = signature((torch.zeros(2),), {"scale": 1.0})
    assert a == signature((torch.ones(2),), {"scale": 1.0})
    assert a != signature((torch.ones(2),), {"scale": 2.0})
    assert a != signature((torch.ones(3),), {"scale": 1.0})
    assert signature((object(),), {}) is None


def test_an_input_it_cannot_compare_turns_graphs_off_with_a_reason():
    m = Block()
    g = StepGraphs(m, warmup=0, capturer=ReplayLikeAGraph())
    x = torch.randn(2, 8)
    m(x, scale=torch.tensor(1.0))
    assert g.stats.captured == 1
    out = m.forward(x, scale=_Opaque())
    assert g.stats.disabled and "cannot be compared" in g.stats.disabled
    torch.testing.assert_close(out["sample"], Block()(x, scale=_Opaque())["sample"])


class _Opaque(float):
    __hash__ = None  # a float subclass the signature cannot trust

    def __new__(cls):
        return super().__new__(cls, 1.0)


def test_remove_puts_the_module_back():
    m = Block()
    g = StepGraphs(m, capturer=ReplayLikeAGraph())
    assert "forward" in vars(m)
    g.remove()
    assert "forward" not in vars(m)
    assert m.forward.__func__ is Block.forward


def test_refused_off_the_gpu_with_what_to_do():
    with pytest.raises(GraphUnavailable, match=r"\+graph.*cpu.*drop \+graph"):
        install_step_graphs(Block())


def test_flux_pipeline_with_true_cfg_is_unchanged_by_replay():
    """A real FluxPipeline (two transformer calls per step with the same signature) renders the
    same image with its transformer replayed; without the output copies the branches would alias."""
    from speedsuite.fullsize import flux_pipeline

    fp = flux_pipeline("tiny", "cpu", torch.float32, height=64, width=64, steps=4, text_tokens=16,
                       true_cfg_scale=3.0)
    with torch.inference_mode():
        ref = fp(seed=1).images[0]
        g = install_step_graphs(fp.pipe.transformer, warmup=1, capturer=ReplayLikeAGraph())
        got = fp(seed=1).images[0]
        again = fp(seed=1).images[0]
    assert g.stats.captured == 1 and g.stats.replays >= 14 and g.stats.disabled is None, g.to_dict()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(again, ref)


def test_plan_options():
    p = parse_plan("ulysses2+compile+graph")
    assert (p.ulysses, p.compile, p.graph, p.cache) == (2, True, True, False)
    assert plan_name(ulysses=2, compile=True, graph=True) == "ulysses2+compile+graph"
    assert parse_plan("single+graph").graph
    # +cache+graph parses; whether it runs depends on the card's cache (a static schedule only),
    # judged before launch (tests/test_compose.py)
    p = parse_plan("ulysses2+cache+compile+graph")
    assert (p.cache, p.compile, p.graph) == (True, True, True)
    with pytest.raises(PlanNameError, match=r"known: \+cache, \+compile, \+graph"):
        parse_plan("ulysses2+fast")
    with pytest.raises(PlanNameError, match="twice"):
        parse_plan("ulysses2+graph+graph")


def test_graph_plans_are_refused_before_launch_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_mod, "_cuda_available", lambda: False)
    launched = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: launched.append(a))
    with pytest.raises(ValueError, match="ulysses2\\+graph.*no CUDA GPU"):
        run_plans(tmp_path / "card.yaml", ["ulysses2", "ulysses2+graph"], 2, tmp_path)
    assert not launched


def test_the_stage_adds_graphed_plans_when_asked(tmp_path):
    from test_parallel import _report
    import test_parallel_models as models

    from ditbook.card import load_card
    from ditbook.parallel import feasibility
    from ditbook.parallel.stage import choose_plans

    table = feasibility(_report(heads=8, kv=2), load_card(models.tiny_flux(tmp_path)), device="cuda")
    plain, _ = choose_plans(table, 2, with_cache=True)
    graphed, not_run = choose_plans(table, 2, with_cache=True, with_graph=True)
    assert not any("graph" in p for p in plain)
    extra = [p for p in graphed if p not in plain]
    assert extra and all(p.endswith("+compile+graph") and "+cache" not in p for p in extra)
    from ditbook.parallel.plans import refusal

    assert {p.split("+")[0] for p in extra} == {p for p in plain if "+" not in p and not refusal(parse_plan(p + "+graph"))}
    assert {r["name"] for r in not_run} >= {"tp2+compile+graph"}  # tensor parallel is not graphed: refused by name
    for p in extra:
        parse_plan(p)  # every added name is a valid plan


def test_compile_falls_back_to_the_inspected_block_lists():
    """+compile on a model that names no repeated blocks compiles the blocks the inspection finds."""
    from pathlib import Path

    from speedsuite.fullsize import flux_pipeline
    from ditbook.card import import_class
    from ditbook.parallel.worker import compile_repeated_blocks

    src = Path(__file__).resolve().parents[1] / "models" / "thirdparty_gqa" / "transformer_gqa.py"
    third = import_class(str(src), "GQATransformer2DModel")()
    assert not getattr(third, "_repeated_blocks", None)
    assert compile_repeated_blocks(third) == "block lists: blocks"
    assert len(third.blocks) > 1 and all(b._compiled_call_impl is not None for b in third.blocks)
    others = [m for n, m in third.named_children() if n != "blocks"]
    assert others and all(m._compiled_call_impl is None for m in others)
    flux = flux_pipeline("tiny", "cpu", torch.float32, height=32, width=32, steps=1, text_tokens=8).pipe.transformer
    assert compile_repeated_blocks(flux) == "compile_repeated_blocks"
