"""The zoo: every tiny model builds from code, passes the gate, loads through ditbook's loader
(transformer first, then the pipeline with it) and generates finite images."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from ditbook import zoo

REQUIRED = {"flux", "qwenimage", "sd3", "wan", "pixart", "hunyuandit", "thirdparty"}


def _load(name, tmp_path):
    from ditbook.card import gate_check
    from ditbook.loading import load_pipeline

    card = gate_check(zoo.build(name, tmp_path))
    return load_pipeline(card), card


def _generate(pipe, card, **overrides):
    from ditbook.render import call_kwargs, to_image

    kwargs = call_kwargs(pipe, card, **overrides)
    out = pipe(card.generation.prompts[0], generator=torch.Generator().manual_seed(0), **kwargs)
    return to_image(out)


def test_list_models_covers_the_families():
    assert REQUIRED <= set(zoo.list_models())
    assert zoo.list_models() == sorted(zoo.configs)
    with pytest.raises(KeyError, match="unknown zoo model"):
        zoo.build("nope", None)


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_zoo_model_builds_loads_and_generates(name, tmp_path):
    if name == "wan" and importlib.util.find_spec("accelerate") is None:
        # diffusers refuses WanTransformer3DModel.from_pretrained (it keeps modules in fp32)
        # unless low_cpu_mem_usage, which needs accelerate
        pytest.skip("loading WanTransformer3DModel needs the accelerate package")
    pipe, card = _load(name, tmp_path)
    assert card.path == (tmp_path / name).resolve() or str(card.path).endswith(name)
    assert (tmp_path / name / "model_index.json").is_file()
    weights = sum(f.stat().st_size for f in (tmp_path / name).rglob("*.safetensors"))
    assert 0 < weights < 20e6, "zoo models stay tiny"
    image = _generate(pipe, card)
    frames = image if image.ndim == 4 else image[None]  # a video keeps every frame (F, H, W, 3)
    assert frames.shape[0] == card.generation.extra.get("num_frames", 1)
    assert image.shape[-1] == 3 and np.isfinite(image).all()
    assert frames.shape[1] == card.generation.height
    assert image.std() > 0.0, "a random model still gives a non-constant image"


def _count_calls(transformer):
    calls = []
    transformer.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    return calls


@pytest.mark.parametrize("name", ["qwenimage", "thirdparty"])
def test_true_cfg_is_two_transformer_calls_per_step(name, tmp_path):
    pipe, card = _load(name, tmp_path)
    calls = _count_calls(pipe.transformer)
    _generate(pipe, card)
    assert len(calls) == 2 * card.generation.steps
    calls.clear()
    no_cfg = {"true_cfg_scale": 1.0} if name == "qwenimage" else {"guidance_scale": 1.0}
    _generate(pipe, card, **no_cfg)
    assert len(calls) == card.generation.steps


def test_thirdparty_is_user_code_with_gqa_keyword_blocks_and_loop_work(tmp_path):
    pipe, card = _load("thirdparty", tmp_path)
    tr = pipe.transformer
    assert not type(tr).__module__.startswith("diffusers") and not type(pipe).__module__.startswith("diffusers")
    assert card.pipeline.source.endswith("models/thirdparty_gqa/pipeline_gqa.py")
    assert card.transformer.source.endswith("models/thirdparty_gqa/transformer_gqa.py")
    attn = tr.blocks[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (8, 2)
    assert attn.to_k.out_features * 4 == attn.to_q.out_features
    # blocks are called with keyword arguments only
    seen = []
    tr.blocks[0].register_forward_pre_hook(lambda m, a, k: seen.append((a, sorted(k))), with_kwargs=True)
    _generate(pipe, card, guidance_scale=1.0)
    assert seen and all(a == () and k == ["encoder_hidden_states", "hidden_states", "temb"] for a, k in seen)
    # the loop adds a learned per-block embedding: zeroing it changes the output
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    text = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.nn.init.normal_(tr.block_embed.weight)
        a = tr(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([0.5])).sample
        tr.block_embed.weight.zero_()
        b = tr(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([0.5])).sample
    assert not torch.allclose(a, b)
    # model_index names a diffusers base class, so a passed-in transformer always loads
    assert json.loads((tmp_path / "thirdparty" / "model_index.json").read_text())["transformer"] == [
        "diffusers",
        "ModelMixin",
    ]
