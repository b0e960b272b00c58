"""The third-party example model (``models/thirdparty_gqa/``): a user's own pipeline and
transformer source files, imported from those files the way ditbook loads a card's
``source: path/to/file.py``, with diffusers/transformers components around them."""

from __future__ import annotations

import torch

from . import vocab
from .parts import generation, make_t5, make_vae


def _classes():
    from ditbook.card import import_class

    from . import THIRDPARTY_DIR

    pipeline_cls = import_class(str(THIRDPARTY_DIR / "pipeline_gqa.py"), "GQAPipeline")
    transformer_cls = import_class(str(THIRDPARTY_DIR / "transformer_gqa.py"), "GQATransformer2DModel")
    return pipeline_cls, transformer_cls


def build_pipeline(seed: int = 0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipeline_cls, transformer_cls = _classes()
    torch.manual_seed(seed)
    tok = vocab.t5_tokenizer()
    transformer = transformer_cls(in_channels=4, patch_size=2, hidden_size=64, num_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, text_dim=32)
    return pipeline_cls(transformer=transformer, vae=make_vae((16, 32), 4), text_encoder=make_t5(tok, 32, 1),
                        tokenizer=tok, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


GENERATION = generation(guidance_scale=4.0)  # > 1: true CFG, two transformer calls per step


def after_save(folder) -> None:
    """List the transformer in ``model_index.json`` as ``["diffusers", "ModelMixin"]``: saved under its
    file-source module name, diffusers' ``from_pretrained`` would refuse it even when passed in; with
    the base class named, the passed ``GQATransformer2DModel`` is accepted (the card contract)."""
    import json
    from pathlib import Path

    index_file = Path(folder) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["transformer"] = ["diffusers", "ModelMixin"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
