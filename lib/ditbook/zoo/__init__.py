"""A zoo of tiny random-initialized diffusers models for the demo and the tests.

Each entry of ``configs`` names a pipeline family; ``build(name, out_dir)`` makes every component
tiny (transformer, VAE, text encoders, offline tokenizers), saves the pipeline with
``save_pretrained`` into ``out_dir/<name>/`` and writes the model card ``out_dir/<name>.yaml``
(``path: <name>``, relative to the card). Nothing but code is committed; a build takes seconds.

    >>> from ditbook import zoo
    >>> zoo.list_models()
    ['flux', 'hunyuandit', 'pixart', 'qwenimage', 'sd3', 'thirdparty', 'wan']
    >>> card = zoo.build("flux", Path("/tmp/zoo"))   # /tmp/zoo/flux.yaml, /tmp/zoo/flux/
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
THIRDPARTY_DIR = REPO_ROOT / "models" / "thirdparty_gqa"


@dataclass(frozen=True)
class Spec:
    """One zoo model: the module whose ``build_pipeline(seed)`` makes it, the classes the card
    names, and the card's generation defaults (the module's ``GENERATION``)."""

    module: str  # ditbook.zoo.<module>
    pipeline_class: str
    transformer_class: str
    pipeline_source: str = "diffusers"
    transformer_source: str = "diffusers"
    notes: str = ""
    runtime: dict[str, Any] = field(default_factory=lambda: {"device": "auto", "dtype": "auto"})


configs: dict[str, Spec] = {
    "flux": Spec("flux", "FluxPipeline", "FluxTransformer2DModel", notes="dual + single stream blocks, RoPE, guidance embedding"),
    "qwenimage": Spec("qwenimage", "QwenImagePipeline", "QwenImageTransformer2DModel", notes="true CFG: two transformer calls per step"),
    "sd3": Spec("sd3", "StableDiffusion3Pipeline", "SD3Transformer2DModel", notes="joint attention, CFG batched"),
    "wan": Spec("wan", "WanPipeline", "WanTransformer3DModel", notes="video, self + cross attention"),
    "pixart": Spec("pixart", "PixArtSigmaPipeline", "PixArtTransformer2DModel", notes="cross attention, adaLN-single"),
    "hunyuandit": Spec("hunyuandit", "HunyuanDiTPipeline", "HunyuanDiT2DModel", notes="long skip connections between blocks"),
    "thirdparty": Spec("thirdparty", "GQAPipeline", "GQATransformer2DModel",
                       pipeline_source=str(THIRDPARTY_DIR / "pipeline_gqa.py"),
                       transformer_source=str(THIRDPARTY_DIR / "transformer_gqa.py"),
                       notes="user code outside diffusers: GQA 8q/2kv heads, keyword-argument blocks, per-block "
                             "embedding in the loop"),
}


def list_models() -> list[str]:
    """Names ``build`` accepts."""
    return sorted(configs)


def card_data(name: str, path: str) -> dict:
    """The model card mapping of zoo model ``name`` whose saved pipeline is at ``path``."""
    spec = configs[name]
    module = importlib.import_module(f"{__name__}.{spec.module}")
    return {"name": f"{name}-tiny", "path": path,
            "pipeline": {"class": spec.pipeline_class, "source": spec.pipeline_source},
            "transformer": {"class": spec.transformer_class, "source": spec.transformer_source,
                            "subfolder": "transformer"},
            "generation": dict(module.GENERATION), "runtime": dict(spec.runtime),
            "notes": f"ditbook zoo: tiny random-initialized {spec.pipeline_class}; {spec.notes}"}


def build(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Build zoo model ``name`` random-initialized (fixed ``seed``), save it to
    ``out_dir/<name>/`` and write its card ``out_dir/<name>.yaml``; return the card path."""
    if name not in configs:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(list_models())}")
    out_dir = Path(out_dir)
    module = importlib.import_module(f"{__name__}.{configs[name].module}")
    pipe = module.build_pipeline(seed=seed)
    pipe.save_pretrained(out_dir / name)
    if hasattr(module, "after_save"):
        module.after_save(out_dir / name)
    card = out_dir / f"{name}.yaml"
    card.write_text(yaml.safe_dump(card_data(name, name), sort_keys=False))
    return card
