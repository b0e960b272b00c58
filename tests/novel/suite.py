"""The novel-model suite: third-party DiTs written in the tests (each folder: its own ``pipeline.py`` and
``transformer.py``), built with tiny random weights by ``save_pretrained`` into a folder at test
time, each with a model card that keeps the card's defaults for cache, parallel and benchmark.

``build(name, root) -> card path``; ``MODELS`` maps each name to the structural feature it is
built around. ``python -m tests.novel.suite NAME DIR`` builds one (for ``ditbook run``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Novel:
    feature: str
    pipeline_class: str
    transformer_class: str
    config: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)
    scheduler: bool = True   # the pipeline takes a diffusers scheduler


GEN = {"prompts": ["a red circle"], "negative_prompt": "", "seeds": [0, 1], "height": 32, "width": 32, "steps": 3}

MODELS: dict[str, Novel] = {
    "dualstream": Novel("streams img/txt (not hidden_states), blocks return (txt, img), joint attention",
                        "DualStreamPipeline", "DualStreamDiT", generation={**GEN, "guidance_scale": 3.0}),
    "stages": Novel("block lists inside never-called containers (for stage in self.stages: for blk in stage.blocks)",
                    "StagedPipeline", "StagedDiT", generation={**GEN, "guidance_scale": 2.5}, scheduler=False),
    "depthscale": Novel("len(self.blocks) read outside the loop", "DepthScaledPipeline", "DepthScaledDiT",
                        generation={**GEN, "guidance_scale": 3.0}),
    "modes": Novel("one list looped in two mode methods, forward calls exactly one", "MultiModePipeline", "MultiModeDiT",
                   generation={**GEN, "guidance_scale": 3.0}),
    "gatedresidual": Novel("blocks return their residual branch: x = x + g[i] * blk(x, t)", "GatedResidualPipeline",
                           "GatedResidualDiT", generation={**GEN, "guidance_scale": 3.0}),
    "dictblocks": Novel("blocks return a dict; the transformer is called without return_dict=False", "DictBlocksPipeline",
                        "DictOutputDiT", generation={**GEN, "guidance_scale": 3.0}),
    "spacetime": Novel("video, space-time factorized attention (tokens reshaped to frames inside the blocks)",
                       "SpaceTimePipeline", "SpaceTimeDiT",
                       generation={**GEN, "height": 16, "width": 16, "guidance_scale": 3.0, "extra": {"num_frames": 2}}),
    "oddshapes": Novel("3 heads, 9 image and 5 text tokens: nothing divisible by 2", "OddShapePipeline", "OddShapeDiT",
                       generation={**GEN, "height": 24, "width": 24, "guidance_scale": 3.0}),
    "fluxref": Novel("FLUX-reference shape: plain nn.Module blocks, img/txt, attention() function, RoPE as a pe tensor, "
                     "module-level denoise(), ModelMixin subclass of a class from another file, double + single lists",
                     "FluxReferencePipeline", "FluxReferenceTransformer",
                     generation={"prompts": ["a red circle"], "seeds": [0, 1], "height": 16, "width": 16, "steps": 3,
                                 "guidance_scale": 3.5}, scheduler=False),
    "heldnet": Novel("the network held as an attribute of the ModelMixin wrapper (self.net), its own forward runs a "
                     "dual-stream and a joined list; attention through a plain function; module-level denoise()",
                     "HeldNetPipeline", "HeldNetTransformer",
                     generation={"prompts": ["a red circle"], "seeds": [0, 1], "height": 16, "width": 16, "steps": 3},
                     scheduler=False),
    "textfirst": Novel("SD3.5-reference shape: the wrapper holds the network and an apply_model entry that forward hands "
                       "everything to; the sampler's CFG denoiser calls apply_model (batched CFG); the loop carries the "
                       "text first (context, x = block(context, x, c=c)), the last block returns no text",
                       "TextFirstPipeline", "TextFirstTransformer",
                       generation={**GEN, "guidance_scale": 3.0, "height": 16, "width": 16}, scheduler=False),
    "batchcfg": Novel("true CFG as one batched call (cat [cond, uncond], chunk); registers; GQA 4q/2kv",
                      "BatchCFGPipeline", "RegisterDiT",
                      generation={**GEN, "negative_prompt": "blurry", "true_cfg_scale": 4.0}),
}


def build(name: str, root: Path, seed: int = 0) -> Path:
    """Build novel model ``name`` into ``root/<name>/`` and write its card ``root/<name>.yaml``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ditbook.card import import_class

    spec = MODELS[name]
    folder = Path(root) / name
    src = HERE / name
    pipeline_src, transformer_src = str(src / "pipeline.py"), str(src / "transformer.py")
    if not (folder / "model_index.json").is_file():
        torch.manual_seed(seed)
        transformer = import_class(transformer_src, spec.transformer_class)(**spec.config)
        parts = {"transformer": transformer}
        if spec.scheduler:
            parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=1.0)
        pipe = import_class(pipeline_src, spec.pipeline_class)(**parts)
        pipe.save_pretrained(folder)
    card = {
        "name": f"novel-{name}",
        "path": str(folder),
        "pipeline": {"class": spec.pipeline_class, "source": pipeline_src},
        "transformer": {"class": spec.transformer_class, "source": transformer_src, "subfolder": "transformer"},
        "generation": dict(spec.generation),
        "runtime": {"device": "cpu", "dtype": "float32"},
        "notes": f"novel third-party DiT (tests/novel/{name}): {spec.feature}",
    }
    path = Path(root) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(card, sort_keys=False))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1], Path(sys.argv[2])))
