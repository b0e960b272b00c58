"""``benchmarks/compose_gpu.py`` (issue 16): the one-GPU composition benchmark, run at a tiny shape
on the CPU — the rows that need CUDA (fp8, graphs) are reported refused with their reason, the
others measured with their reference-model quality; the graphed row's composition (cache, compile,
graphs of the computed steps) is checked with a capturer that replays like a graph."""

from __future__ import annotations

import json

import pytest

import torch

from ditbook.accel.compile import compiled_config
from ditbook.configuration import Config
from speedsuite.compose import ROWS, graph_config, main
from speedsuite.schedules import ditbook_schedule

from test_graphs import ReplayLikeAGraph


# the rows whose code paths differ (cache+compile and cache+fp8+compile reuse them), to keep it short
ROWS_CHECKED = ["eager", "cache", "compile", "fp8+compile", "cache+fp8+compile", "cache+compile+graph"]


def test_tiny_cpu_run_measures_what_runs_and_refuses_the_rest_with_reasons(tmp_path):
    rc = main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--size", "32", "--steps", "6", "--repeats", "1",
               "--compile-backend", "eager", "--quality-prompts", "1", "--holdout-seeds", "100",
               "--rows", ",".join(ROWS_CHECKED)])
    assert rc == 0
    res = json.loads((tmp_path / "compose.json").read_text())
    by = {r["row"]: r for r in res["rows"]}
    assert list(by) == ROWS_CHECKED and set(ROWS_CHECKED) < set(ROWS)
    for name in ("eager", "cache", "compile"):
        assert by[name]["status"] == "measured" and by[name]["timing"]["end_to_end"]["median"] > 0, by[name]
        assert by[name]["speedup"] > 0
    for name in ("fp8+compile", "cache+fp8+compile"):
        assert by[name]["status"] == "refused" and "Fp8Refused" in by[name]["reason"] and "on cpu" in by[name]["reason"]
    assert by["cache+compile+graph"]["status"] == "refused" and "CUDA" in by["cache+compile+graph"]["reason"]
    assert by["compile"]["params"]["compile"]["regions"] > 0 and by["compile"]["params"]["compile"]["backend"] == "eager"
    ref = res["reference"]["rows"]
    assert res["reference"]["compiled"] is False and ref["compile"]["status"] == "not judged"
    assert ref["cache"]["status"] == "measured" and ref["cache"]["psnr_min"] < 60  # the cache changes the image
    assert res["reference"]["noise_floor"]["psnr_min"] > 60
    assert ref["fp8+compile"]["status"] == "refused" and ref["cache+compile+graph"]["status"] == "refused"
    md = (tmp_path / "compose.md").read_text()
    assert "| fp8+compile | refused |" in md and "| compile |" in md and "reference PSNR min" in md
    # the gap columns: FLOPs counted on the eager model, each computed transformer call timed, no peak on a CPU
    assert res["flops"]["gemm"] > 0 and res["flops"]["attention"] > 0 and res["peaks"]["bf16_tflops"] is None
    assert by["eager"]["gap"]["computed_calls"] == 6 and by["compile"]["gap"]["computed_calls"] == 6
    assert by["cache"]["gap"]["computed_calls"] == res["schedule"]["computed"] < 6
    assert "computed step (s)" in md and "no peak measured" in md


def test_the_graphed_row_composes_cache_compile_and_graphs_of_the_computed_steps():
    from speedsuite.fullsize import flux_pipeline

    steps = 9
    sched = ditbook_schedule(steps, warmup=2, computed=3)
    fp = flux_pipeline("tiny", "cpu", torch.float32, height=32, width=32, steps=steps, text_tokens=16)
    cache = Config("cache", "cache", sched.apply)
    with torch.inference_mode():
        plain = compiled_config(cache, backend="aot_eager")
        undo = plain.apply(fp.pipe)
        ref = fp(seed=0).images[0]
        undo()
        cap = ReplayLikeAGraph()
        g = graph_config(compiled_config(cache, backend="aot_eager"), sched.mask, steps, warmup=1, capturer=cap)
        undo = g.apply(fp.pipe)
        got = fp(seed=0).images[0]
        again = fp(seed=0).images[0]
        undo()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    stats = g.params["graphs"]
    assert stats["captured"] >= 1 and stats["replays"] == 2 * sched.computed - 1 and not stats["disabled"], stats
    from ditbook.hooks import wrap_names

    assert wrap_names(fp.pipe.transformer) == []  # the compile-cost probe is gone
    assert all(b.__dict__.get("_compiled_call_impl") is None for b in fp.pipe.transformer.transformer_blocks)


def test_quality_rows_are_judged_on_the_reference_model_without_being_timed(tmp_path):
    rc = main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--size", "32", "--steps", "6", "--repeats", "1",
               "--quality-prompts", "1", "--holdout-seeds", "100", "--rows", "eager", "--quality-rows", "cache"])
    assert rc == 0
    res = json.loads((tmp_path / "compose.json").read_text())
    assert [r["row"] for r in res["rows"]] == ["eager"]  # timed: eager only
    q = res["reference"]["rows"]["cache"]
    assert q["status"] == "measured" and q["psnr_min"] < 60  # judged: the cache changes the image
    assert "not timed here: `cache`" in (tmp_path / "compose.md").read_text()
    with pytest.raises(ValueError, match="unknown rows"):
        main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--rows", "eager", "--quality-rows", "nonsense"])


def test_the_decoder_row_compiles_the_image_decoder_too_and_undoes_it_exactly():
    from speedsuite.compose import row_configs
    from speedsuite.fullsize import flux_pipeline
    from ditbook.accel.compile import DecoderUnavailable, compile_decoder

    steps = 6
    sched = ditbook_schedule(steps, warmup=2, computed=3)
    fp = flux_pipeline("tiny", "cpu", torch.float32, height=32, width=32, steps=steps, text_tokens=16)
    dec = fp.pipe.vae.decoder
    cfg = row_configs(sched, {"backend": "eager"}, steps)["cache+compile+decoder"]
    assert cfg.name == "cache+compile" and "decoder" in cfg.notes
    with torch.inference_mode():
        ref = fp(seed=0).images[0]
        undo = cfg.apply(fp.pipe)
        assert dec.__dict__.get("_compiled_call_impl") is not None  # the decoder itself is compiled
        got = fp(seed=0).images[0]
        fp(seed=0)  # a second decode: the steady time the first one's compile cost is read against
        undo()
    stats = cfg.params["compile"]
    assert stats["decoder"]["compiled"] is True and stats["decoder"]["module"] == "AutoencoderKL.decoder"
    # the decoder's one-time cost is timed at its first decode and counted in the configuration's
    assert stats["decoder"]["first_decode_s"] > 0 and stats["decoder"]["steady_decode_s"] > 0
    assert stats["decoder"]["compile_s"] == pytest.approx(max(0.0, stats["decoder"]["first_decode_s"]
                                                              - stats["decoder"]["steady_decode_s"]), abs=1e-3)
    assert stats["compile_s"] == pytest.approx(stats["blocks_compile_s"] + stats["decoder"]["compile_s"], abs=1e-3)
    from ditbook.hooks import wrap_names

    assert wrap_names(fp.pipe.vae, attr="decode") == [] and "decode" not in fp.pipe.vae.__dict__
    assert all(m.__dict__.get("_compiled_call_impl") is None for m in dec.modules())  # undone exactly
    assert all(b.__dict__.get("_compiled_call_impl") is None for b in fp.pipe.transformer.transformer_blocks)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    # uncompiled (the quality pass's default) the row is the cache row itself
    assert row_configs(sched, None, steps)["cache+compile+decoder"].name == "cache"

    # a pipeline without a decoder module: refused with the reason, nothing changed
    class NoVae:
        vae = None

    with pytest.raises(DecoderUnavailable, match="no vae module"):
        compile_decoder(NoVae())
    fp.pipe.vae.decoder = torch.nn.Identity()  # still a module: compiled and undone
    undo, what = compile_decoder(fp.pipe, backend="eager")
    assert what == "AutoencoderKL.decoder" and fp.pipe.vae.decoder.__dict__.get("_compiled_call_impl") is not None
    undo()
    assert "_compiled_call_impl" not in fp.pipe.vae.decoder.__dict__ or fp.pipe.vae.decoder._compiled_call_impl is None
    del fp.pipe.vae._modules["decoder"]
    with pytest.raises(DecoderUnavailable, match="no decoder module"):
        compile_decoder(fp.pipe)
