"""fp8 as a measured configuration (issue 16 item 4): refused with a named reason where fp8 cannot
run (the CPU, CUDA capability below 8.9), the plumbing (which layers, exact undo) checked on the
CPU with a torchao config that runs there (int8 weight-only: same ``quantize_`` path)."""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from ditbook.accel.fp8 import Fp8, Fp8Refused, Fp8Settings, apply_fp8, fp8_config, fp8_layers, fp8_refusal
from ditbook.benchmark.variants import derived_configs
from ditbook.card import CardError, load_card


def _tiny_flux():
    from speedsuite.fullsize import flux_pipeline

    return flux_pipeline("tiny", "cpu", torch.float32, height=64, width=64, steps=2, text_tokens=16)


def test_refused_on_the_cpu_and_below_capability_8_9_with_the_reason():
    assert "CUDA GPU of compute capability >= 8.9" in fp8_refusal("cpu") and "on cpu" in fp8_refusal("cpu")
    why = fp8_refusal("cuda:0", capability=(8, 6))
    assert why and "this GPU has 8.6" in why
    ok = fp8_refusal("cuda:0", capability=(9, 0))  # H100/H200: allowed (unless torchao is missing)
    assert ok is None or "torchao is not installed" in ok


def test_apply_refuses_before_changing_anything_on_the_cpu():
    fp = _tiny_flux()
    tr = fp.pipe.transformer
    before = {n: p for n, p in tr.named_parameters()}
    with pytest.raises(Fp8Refused, match="on cpu"):
        apply_fp8(tr)
    assert all(p is before[n] for n, p in tr.named_parameters())
    with pytest.raises(Fp8Refused, match="on cpu"):
        fp8_config().apply(fp.pipe)


def test_on_the_cpu_the_benchmark_records_one_refused_fp8_row_and_compiles_no_twin_of_it():
    fp = _tiny_flux()
    rows = Fp8.variants(None, fp.pipe, [], Fp8Settings(), log=lambda m: None)
    assert [c.name for c in rows] == ["fp8"] and "on cpu" in rows[0].params["fp8"]["refused"]
    with pytest.raises(Fp8Refused, match="compute capability"):
        rows[0].apply(fp.pipe)
    card = SimpleNamespace(runtime=SimpleNamespace(compile="eager"),
                           benchmark=SimpleNamespace(fp8=True, attention_backend=None))
    configs = derived_configs(SimpleNamespace(card=card), fp.pipe, [], log=lambda m: None)
    assert [c.name for c in configs] == ["fp8", "baseline+compile"]


def test_the_block_linears_are_quantized_and_the_undo_is_exact():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig

    fp = _tiny_flux()
    tr = fp.pipe.transformer
    chosen, odd = fp8_layers(tr)
    names = dict(tr.named_modules())
    linears = [n for n, m in names.items() if isinstance(m, torch.nn.Linear)]
    assert chosen and not odd and set(chosen) < set(linears)
    assert all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in chosen)
    outside = [n for n in linears if n not in chosen]  # embedders and the final projection stay
    assert any(n.startswith("x_embedder") or n.startswith("proj_out") for n in outside), outside
    before = {n: p for n, p in tr.named_parameters()}
    with torch.inference_mode():
        ref = fp(seed=3).images[0]
        undo, rec = apply_fp8(tr, config=Int8WeightOnlyConfig(), check_device=False)
        got = fp(seed=3).images[0]
        swapped = [n for n in chosen if names[n].weight is not before[n + ".weight"]]
        kept = [n for n in outside if names[n].weight is before[n + ".weight"]]
        undo()
        after = fp(seed=3).images[0]
    assert rec["quantized"] == rec["layers"] == len(chosen)
    assert swapped == chosen and kept == outside  # only the block linears were quantized
    assert 0 < (got - ref).abs().max() < 0.1  # quantized: close, not identical
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    assert all(p is before[n] for n, p in tr.named_parameters())
    assert {n for n, _ in tr.named_parameters()} == set(before)


def test_the_card_setting_is_typed(tmp_path):
    card = tmp_path / "c.yaml"
    card.write_text("name: x\npath: /nowhere\npipeline: {class: FluxPipeline, source: diffusers}\n"
                    "transformer: {class: FluxTransformer2DModel, source: diffusers}\n"
                    "generation: {prompts: [a]}\nbenchmark: {fp8: true}\n")
    assert load_card(card).benchmark.fp8 is True
    with pytest.raises(CardError, match="benchmark.fp8"):
        load_card(card, {"benchmark.fp8": "yes"})


def test_capture_calls_keeps_every_nth_call_as_keywords_and_removes_its_hook():
    fp = _tiny_flux()
    tr = fp.pipe.transformer
    from ditbook.accel.fp8 import capture_calls

    calls = capture_calls(tr, lambda: fp(num_inference_steps=4), every=2)
    assert len(calls) == 2 and not tr._forward_pre_hooks
    assert {"hidden_states", "timestep", "encoder_hidden_states"} <= set(calls[0])
    assert not torch.equal(calls[0]["timestep"], calls[1]["timestep"])  # two different steps
    with torch.no_grad():
        tr(**calls[0])  # replayable as recorded


def test_layer_sensitivity_ranks_the_layer_that_changes_the_output_most_and_undoes_each():
    """A stand-in for fp8 (the CPU has none): it scales one layer's weight, by far the most for one
    layer; the measurement must rank that layer first, give an untouched-output layer no error, and
    leave the model as it was."""
    from ditbook.accel.fp8 import capture_calls, layer_sensitivity

    fp = _tiny_flux()
    tr = fp.pipe.transformer
    calls = capture_calls(tr, lambda: fp(num_inference_steps=2))
    layers, _ = fp8_layers(tr)
    loud, quiet = layers[3], layers[-1]
    modules = dict(tr.named_modules())
    before = {n: p.detach().clone() for n, p in tr.named_parameters()}

    def perturb(name):
        w = modules[name].weight
        saved = w.detach().clone()
        with torch.no_grad():
            w.mul_(3.0 if name == loud else 1.0 + 1e-3 if name == quiet else 1.0)

        def undo():
            with torch.no_grad():
                w.copy_(saved)
        return undo

    got = layer_sensitivity(tr, calls, [quiet, layers[0], loud], perturb)
    assert [r["layer"] for r in got][0] == loud and got[0]["rel_error"] > 10 * got[1]["rel_error"]
    assert {r["layer"]: r["rel_error"] for r in got}[layers[0]] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in tr.named_parameters())


def test_apply_fp8_takes_only_layers_it_would_choose():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig

    fp = _tiny_flux()
    tr = fp.pipe.transformer
    layers, _ = fp8_layers(tr)
    with pytest.raises(ValueError, match="not block linears"):
        apply_fp8(tr, config=Int8WeightOnlyConfig(), check_device=False, layers=["proj_out"])
    undo, rec = apply_fp8(tr, config=Int8WeightOnlyConfig(), check_device=False, layers=layers[:2])
    assert rec["quantized"] == 2 and rec["kept"] == layers[2:]
    undo()
