"""The reference a model integration starts from: what the model folder says about itself.

The integration guides start from the upstream demo: its license and model card, the pipeline's
own default size / steps / guidance, and the exact command that produced the reference images.
``reference_facts(ctx, pipe)`` records them for the intake stage (``intake/reference.json``):

- the model card (``README.md``: its YAML front matter, first heading) and license files
  (``LICENSE*``, ``LICENCE*``, ``COPYING*``) found in the model folder, or that none was found;
- ``model_index.json``'s ``_class_name``, ``_diffusers_version`` and ``_name_or_path``;
- the pipeline's defaults read from its ``__call__`` signature (size derived from
  ``default_sample_size`` x ``vae_scale_factor`` where the signature leaves it ``None``), and
  where the card's generation settings differ from them;
- the baseline run's exact command (the ``ditbook`` command line and the pipeline call with
  every argument the render passed);
- the placement asked for and the one chosen, with the reason when ``auto`` picked the CPU.

Nothing here is guessed: a field that is not found says so.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

LICENSE_GLOBS = ("LICENSE*", "LICENCE*", "COPYING*", "license*", "licence*")
CARD_FILES = ("README.md", "readme.md", "README.MD", "MODEL_CARD.md", "model_card.md")
# __call__ parameters that shape the baseline (recorded first; every other literal default too)
GENERATION_PARAMS = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale",
                     "negative_prompt", "max_sequence_length", "num_frames", "sigmas")
# card generation field -> __call__ parameter
CARD_TO_CALL = {"height": "height", "width": "width", "steps": "num_inference_steps",
                "guidance_scale": "guidance_scale", "true_cfg_scale": "true_cfg_scale",
                "negative_prompt": "negative_prompt"}


@dataclass
class ReferenceFacts:
    model_folder: str
    model_card: dict = field(default_factory=dict)
    license: dict = field(default_factory=dict)
    model_index: dict = field(default_factory=dict)
    pipeline_defaults: dict = field(default_factory=dict)
    card_differs: list = field(default_factory=list)
    baseline_command: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(item, value) rows for a table in the notebook."""
        mc, lic = self.model_card, self.license
        return [
            ("model card", mc.get("file") or mc.get("note", "")),
            ("license", lic.get("declared") or ", ".join(lic.get("files", [])) or lic.get("note", "")),
            ("upstream name", self.model_index.get("_name_or_path") or self.model_index.get("note", "not recorded")),
            ("pipeline defaults", json.dumps({k: v for k, v in self.pipeline_defaults.items()
                                              if k in GENERATION_PARAMS}, default=str)),
            ("card differs from defaults", "; ".join(self.card_differs) or "no"),
            ("baseline command", self.baseline_command.get("cli", "")),
            ("placement", f"{self.placement.get('requested')} -> {self.placement.get('chosen')}"
                          f"{' (' + self.placement['reason'] + ')' if self.placement.get('reason') else ''}"),
        ]


def _front_matter(text: str) -> dict:
    import yaml

    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        data = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def read_model_card(folder: Path) -> dict:
    for name in CARD_FILES:
        path = folder / name
        if path.is_file():
            text = path.read_text(errors="replace")
            meta = _front_matter(text)
            title = next((ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")), None)
            return {"found": True, "file": name, "title": title, "metadata": {k: v for k, v in meta.items()
                                                                              if isinstance(v, (str, int, float, list))},
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {"found": False, "note": f"no model card ({' / '.join(CARD_FILES[:1] + CARD_FILES[3:4])}) in {folder}"}


def read_license(folder: Path, card: dict) -> dict:
    files = sorted({p.name for g in LICENSE_GLOBS for p in folder.glob(g) if p.is_file()})
    declared = (card.get("metadata") or {}).get("license")
    out = {"found": bool(files or declared), "files": files, "declared": declared}
    if files:
        first = (folder / files[0]).read_text(errors="replace").strip().splitlines()
        out["first_line"] = first[0].strip() if first else ""
    if not out["found"]:
        out["note"] = f"no license found: no LICENSE/LICENCE/COPYING file in {folder} and no 'license' in a model card"
    return out


def read_model_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    if not path.is_file():
        return {"note": f"no model_index.json in {folder}"}
    index = json.loads(path.read_text())
    out = {k: index[k] for k in ("_class_name", "_diffusers_version", "_name_or_path") if k in index}
    if "_name_or_path" not in out:
        out["_name_or_path"] = None
        out["note"] = "model_index.json records no _name_or_path (the upstream repository is not named)"
    return out


def _literal(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v))


def pipeline_defaults(pipe) -> dict:
    """Literal defaults of the pipeline's ``__call__`` (generation parameters first); a ``None``
    height/width is resolved the way diffusers pipelines do, from ``default_sample_size`` x
    ``vae_scale_factor``, and marked as derived."""
    params = inspect.signature(type(pipe).__call__).parameters
    out, rest = {}, {}
    for name, p in params.items():
        if name == "self" or p.default is inspect.Parameter.empty or not _literal(p.default):
            continue
        (out if name in GENERATION_PARAMS else rest)[name] = p.default
    size = getattr(pipe, "default_sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    for dim in ("height", "width"):
        if dim in out and out[dim] is None and isinstance(size, int) and isinstance(scale, int):
            out[dim] = size * scale
            out[f"{dim}_derived_from"] = f"default_sample_size {size} x vae_scale_factor {scale}"
    out.update(rest)
    return out


def card_differences(card, defaults: dict) -> list[str]:
    gen = card.generation
    diffs = []
    for field_name, param in CARD_TO_CALL.items():
        if param not in defaults:
            continue
        mine = getattr(gen, field_name, None)
        if mine is not None and mine != defaults[param]:
            diffs.append(f"generation.{field_name} {mine!r} (pipeline default {param}={defaults[param]!r})")
    for key, value in (gen.extra or {}).items():
        if key in defaults and value != defaults[key]:
            diffs.append(f"generation.extra.{key} {value!r} (pipeline default {defaults[key]!r})")
    return diffs


def baseline_command(ctx, pipe) -> dict:
    """The ``ditbook`` command that renders this baseline, and the pipeline call it makes."""
    from ..render import call_kwargs

    card = ctx.card
    cli = ["ditbook", "run", str(card.card_path), "--stages", "intake",
           "--outputs", str(ctx.run.path.parent.parent), "--run-id", f"{ctx.run.path.name}-again"]
    for key, value in (ctx.overrides or {}).items():
        cli += ["-p", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    kwargs = call_kwargs(pipe, card)
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    pipe_cls = type(pipe).__name__
    load = (f"pipe = {pipe_cls}.from_pretrained({str(card.path)!r}, torch_dtype=torch.{ctx.placement.dtype}, "
            f"local_files_only=True).to({ctx.placement.device!r})")
    call = (f"pipe(prompt=PROMPT, generator=torch.Generator('cpu').manual_seed(SEED), {args})"
            f"  # PROMPT x SEED over {list(card.generation.prompts)!r} x {list(card.generation.seeds)!r}")
    return {"cli": shlex.join(cli), "load": load, "call": call, "call_kwargs": {k: v for k, v in kwargs.items()
                                                                                  if _literal(v)}}


def placement_facts(ctx) -> dict:
    import torch

    requested = ctx.card.runtime.device
    out = {"requested": requested, "chosen": ctx.placement.device, "dtype": ctx.placement.dtype}
    if requested == "auto" and not ctx.placement.device.startswith("cuda") and not torch.cuda.is_available():
        out["reason"] = "runtime.device is auto and torch sees no CUDA device: ran on the CPU"
    return out


def reference_facts(ctx, pipe) -> ReferenceFacts:
    folder = Path(ctx.card.path)
    card_doc = read_model_card(folder)
    defaults = pipeline_defaults(pipe)
    return ReferenceFacts(model_folder=str(folder), model_card=card_doc, license=read_license(folder, card_doc),
                          model_index=read_model_index(folder), pipeline_defaults=defaults,
                          card_differs=card_differences(ctx.card, defaults),
                          baseline_command=baseline_command(ctx, pipe), placement=placement_facts(ctx))


def write_reference(folder: Path, facts: ReferenceFacts) -> Path:
    path = Path(folder) / "reference.json"
    path.write_text(json.dumps(facts.to_dict(), indent=2, default=str))
    return path
