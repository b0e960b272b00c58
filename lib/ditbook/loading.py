"""Loading a model named by a card: local files only, offline, device and dtype chosen for you.

The transformer class named by the card is loaded first and handed to the pipeline class, so a
third-party transformer defined in a user's file works with a diffusers-style pipeline folder.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .card import ModelCard, import_class


def set_offline() -> None:
    """ditbook never reaches a model hub: every load is from local disk."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("DIFFUSERS_OFFLINE", "1")


set_offline()


class ModelFolderError(FileNotFoundError):
    """The model folder is missing or lacks a component the pipeline needs."""


class DeviceUnavailableError(RuntimeError):
    """The card's ``runtime.device`` asks for a device this machine does not have."""


@dataclass
class Placement:
    device: str
    dtype: str

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        return {"device": self.device, "dtype": self.dtype}


def choose_placement(card: ModelCard | None = None, device: str | None = None, dtype: str | None = None) -> Placement:
    """CUDA when present, else the CPU; ``auto`` dtype is bf16 on CUDA for a diffusers pipeline
    (which casts what it hands the transformer) and fp32 otherwise: a pipeline from the user's own
    code makes its tensors in its own dtype (the FLUX/SD3.5/minRF reference samplers pass fp32
    latents, which a bf16 model's first layer refuses). The card's ``runtime`` and explicit
    arguments override (arguments win)."""
    import torch

    dev = device or (card.runtime.device if card is not None else "auto")
    dt = dtype or (card.runtime.dtype if card is not None else "auto")
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev.startswith("cuda"):  # asked for a GPU: run there or stop, never fall back to the CPU
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(dev.split(":", 1)[1]) if ":" in dev and dev.split(":", 1)[1].isdigit() else 0
        if index >= count:
            raise DeviceUnavailableError(
                f"runtime.device is {dev!r} but torch sees {count} CUDA device(s) "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): run on a GPU machine, "
                f"or set runtime.device to 'cpu' (or 'auto') in the card")
    if dt == "auto":
        own_code = card is not None and card.pipeline.source != "diffusers"
        dt = "bfloat16" if dev.startswith("cuda") and not own_code else "float32"
    return Placement(dev, dt)


def warm_device(device: str = "auto") -> bool:
    """Start CUDA in a process that will soon render on it: the context, cuBLAS(Lt) and the
    attention kernels' libraries load on a process's first GPU call (seconds on a fresh process),
    so a stage kernel or a reproduction process started ahead does it while the previous stage
    still runs. No-op (False) for a CPU device or where CUDA is absent; a failure is left for
    the stage itself to meet (a warm-up never fails anything)."""
    import torch

    try:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not str(device).startswith("cuda") or not torch.cuda.is_available():
            return False
        with torch.cuda.device(torch.device(device)):
            a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
            (a @ a).float().sum().item()  # cuBLAS and its handle
            q = torch.ones(1, 2, 64, 64, device=device, dtype=torch.bfloat16)
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().item()  # the fused attention kernels
        return True
    except Exception:  # noqa: BLE001 - the stage's own first call reports a real problem
        return False


def check_model_folder(path: Path) -> dict:
    """Read ``model_index.json`` and check that every listed component folder is there."""
    if path is None or not Path(path).is_dir():
        raise ModelFolderError(f"model folder {path} does not exist (card field 'path')")
    index_file = Path(path) / "model_index.json"
    if not index_file.is_file():
        raise ModelFolderError(
            f"model folder {path} has no model_index.json — save the pipeline there with "
            f"pipeline.save_pretrained({str(path)!r})"
        )
    index = json.loads(index_file.read_text())
    missing = []
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        sub = Path(path) / name
        if not sub.is_dir() or not any(sub.iterdir()):
            missing.append(name)
    if missing:
        raise ModelFolderError(
            f"model folder {path} is partial: component folder(s) {', '.join(missing)} "
            f"listed in model_index.json are missing or empty"
        )
    return index


# what a weight file is, by suffix: the one rule the load check and the approval hash
# (``approval``: which files the model identity covers) both use
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".onnx")


def is_weight_file(path: str | Path) -> bool:
    return Path(path).name.endswith(WEIGHT_SUFFIXES)


def _weights_problem(file: Path) -> str | None:
    """Why a weights file cannot be opened, else None. safetensors files are opened (header and
    size checked, no tensor read); other formats must at least hold bytes."""
    try:
        size = file.stat().st_size
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size == 0:
        return "is empty"
    if file.suffix == ".safetensors":
        try:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # safetensors raises its own error types
            return f"does not open as safetensors ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    return None


def component_problems(folder: Path, name: str) -> list[str]:
    """What is missing or broken in one component folder of a saved pipeline."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{name}: folder {folder} is missing"]
    files = [f for f in folder.iterdir() if f.is_file()]
    if not files:
        return [f"{name}: folder {folder} is empty"]
    problems = []
    for f in sorted(files):
        if f.suffix == ".json":
            try:
                json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                problems.append(f"{name}: {f.name} is not readable JSON ({exc})")
    config = folder / "config.json"
    weights = sorted(f for f in files if is_weight_file(f))
    index_files = sorted(f for f in files if f.name.endswith(".index.json"))
    for idx in index_files:  # sharded weights: every shard the index names must be there
        try:
            shards = set(json.loads(idx.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            continue  # reported above as unreadable JSON
        for shard in sorted(shards):
            if not (folder / shard).is_file():
                problems.append(f"{name}: weights shard {shard} named by {idx.name} is missing")
    if config.is_file() and not weights:
        problems.append(f"{name}: {folder} has config.json but no weights file ({', '.join(WEIGHT_SUFFIXES)})")
    for f in weights:
        why = _weights_problem(f)
        if why:
            problems.append(f"{name}: weights file {f.name} {why}")
    return problems


def model_folder_problems(card: ModelCard) -> list[str]:
    """Everything the stages will need from the model folder that is missing or unreadable:
    ``model_index.json``, each listed component's folder and JSON configs, weights files that
    open, and the transformer's subfolder. Empty when the folder looks complete."""
    path = card.path
    if path is None or not Path(path).is_dir():
        return [f"path: model folder {path} does not exist"]
    path = Path(path)
    index_file = path / "model_index.json"
    if not index_file.is_file():
        return [f"path: {path} has no model_index.json — save the pipeline there with pipeline.save_pretrained(...)"]
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError) as exc:
        return [f"path: {index_file} is not readable JSON ({exc})"]
    if not isinstance(index, dict):
        return [f"path: {index_file} must hold a JSON object"]
    problems = []
    names = [n for n, v in index.items() if not n.startswith("_") and isinstance(v, list) and v and v[0] is not None]
    sub = card.transformer.subfolder or "transformer"
    if sub not in names:
        names.append(sub)
    for name in names:
        problems += [f"path: component {p}" for p in component_problems(path / name, name)]
    return problems


def load_transformer(card: ModelCard, placement: Placement | None = None, **kwargs: Any):
    placement = placement or choose_placement(card)
    cls = import_class(card.resolve_source(card.transformer.source), card.transformer.cls)
    sub = card.transformer.subfolder or "transformer"
    if not (Path(card.path) / sub).is_dir():
        raise ModelFolderError(f"model folder {card.path} has no '{sub}' folder for the transformer (card field transformer.subfolder)")
    with _loading_bars(False):
        return cls.from_pretrained(
            str(card.path), subfolder=sub, dtype=placement.torch_dtype, local_files_only=True, **kwargs
        )


@contextmanager
def _loading_bars(show: bool):
    """diffusers' and transformers' loading bars on or off for one load, then as they were: a
    local load takes a second, and in a saved notebook the bar stays a widget frozen at 0%."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    saved = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for m, _ in saved:
        m.enable_progress_bar() if show else m.disable_progress_bar()
    try:
        yield
    finally:
        for m, was in saved:
            m.enable_progress_bar() if was else m.disable_progress_bar()


def load_pipeline(card: ModelCard, placement: Placement | None = None, *, transformer=None, progress: bool = False):
    """Load the pipeline of a card from its local folder onto the chosen device."""
    placement = placement or choose_placement(card)
    check_model_folder(card.path)
    pipe_cls = import_class(card.resolve_source(card.pipeline.source), card.pipeline.cls)
    if transformer is None:
        transformer = load_transformer(card, placement)
    with _loading_bars(progress), _source_modules_as_saved(card):
        pipe = pipe_cls.from_pretrained(
            str(card.path), transformer=transformer, dtype=placement.torch_dtype, local_files_only=True
        )
    pipe.to(placement.device)
    route_entries(pipe.transformer)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=not progress)
    return pipe


def saved_source_names(card: ModelCard) -> dict[str, str]:
    """The modules ``model_index.json`` names that are the card's own source files: ``{module name: file}``.

    ``save_pretrained`` records a component defined outside diffusers/transformers under the module
    name its class had when the folder was built (``transformer`` when the user's build script did
    ``from transformer import ...``), and diffusers loads such a component only from a module of
    that name already imported. ditbook imports the card's source files under names of its own, so
    a recorded name is matched to a card source file by path: the module path ``a.b`` names the
    file whose path ends in ``a/b.py``. Names diffusers loads itself, and names already imported,
    are left alone."""
    import sys

    from diffusers import pipelines
    from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES

    from .card import _is_file_source

    try:
        index = json.loads((Path(card.path) / "model_index.json").read_text())
    except (OSError, ValueError):
        return {}
    files = [Path(card.resolve_source(part.source)) for part in (card.pipeline, card.transformer)
             if part is not None and part.source and _is_file_source(card.resolve_source(part.source))]
    out: dict[str, str] = {}
    for value in index.values() if isinstance(index, dict) else ():
        library = value[0] if isinstance(value, list) and value and isinstance(value[0], str) else None
        if not library or library in LOADABLE_CLASSES or library in sys.modules or hasattr(pipelines, library):
            continue
        parts = tuple(library.split("."))
        for file in files:
            if file.suffix == ".py" and file.with_suffix("").parts[-len(parts):] == parts:
                out[library] = str(file)
                break
    return out


@contextmanager
def _source_modules_as_saved(card: ModelCard):
    """For one load, each card source file also stands under the module name the saved folder
    records for it (``saved_source_names``): the same module object, so the classes are the card's."""
    import sys

    from .card import _import_source
    from .hooks import set_item

    handles = [set_item(sys.modules, name, _import_source(file)) for name, file in saved_source_names(card).items()]
    try:
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()


def _own_classes(cls) -> list[type]:
    """The classes of ``cls``'s MRO written by the model's authors (not torch's, diffusers', transformers')."""
    return [c for c in cls.__mro__ if c is not object
            and not c.__module__.split(".")[0] in ("torch", "diffusers", "transformers", "builtins")]


def _delegate_of(fn) -> str | None:
    """``m`` when ``fn`` is ``def forward(self, *args, **kwargs): return self.m(*args, **kwargs)``."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))] if node else []
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return None
    call = body[0].value
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
        return None
    passes_all = (len(call.args) == 1 and isinstance(call.args[0], ast.Starred) and len(call.keywords) == 1
                  and call.keywords[0].arg is None)
    return f.attr if passes_all and f.attr != "forward" else None


def entry_routes(transformer) -> list[str]:
    """Methods that code outside the module call enters the transformer by, to be routed through
    the module call (``route_entries``) so that its hooks see every call: a method of the model's own
    classes that calls ``self.forward(...)`` directly (the original DiT's ``forward_with_cfg``, which
    its sampling loop calls), and ``m`` when ``forward`` is ``m`` or only hands ``self.m(*args,
    **kwargs)`` every argument (the SD3.5 reference's ``apply_model``, which its CFG denoiser calls)."""
    return _forward_callers(transformer) + _forward_aliases(transformer)


def _forward_callers(transformer) -> list[str]:
    """Methods of the model's own classes (not ``forward``) whose code calls ``self.forward(...)``."""
    import ast
    import inspect
    import textwrap

    out = []
    for c in _own_classes(type(transformer)):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError, SyntaxError):
            continue
        for fn in tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []:
            if isinstance(fn, ast.FunctionDef) and fn.name != "forward" and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "forward"
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "self" for n in ast.walk(fn)):
                out.append(fn.name)
    return list(dict.fromkeys(out))


def _forward_aliases(transformer) -> list[str]:
    """Methods ``m`` that are ``forward`` itself, or that ``forward`` hands every argument to."""
    cls = type(transformer)
    forward = getattr(cls, "forward", None)
    if forward is None:
        return []
    same = [n for c in _own_classes(cls) for n, v in vars(c).items()
            if n != "forward" and not n.startswith("__") and v is forward and callable(v)]
    delegate = _delegate_of(forward) if any("forward" in vars(c) for c in _own_classes(cls)) else None
    return list(dict.fromkeys(same + ([delegate] if delegate and callable(getattr(cls, delegate, None)) else [])))


def route_entries(transformer) -> list:
    """Route the transformer's entry methods (``entry_routes``) through the module call when they
    are entered from outside one: an alias of ``forward`` runs ``transformer(*args, **kwargs)``; a
    method calling ``self.forward(...)`` runs as written, its ``self.forward`` calls routed through
    the module call for that method's duration only (``forward`` itself is never wrapped for longer:
    cache-dit, CFG parallel and the CP trace replace or wrap it). Inside a module call everything runs
    as written. So forward hooks (the inspection's trace, the caches' call counters, diffusers' and
    cache-dit's forward patches) see every call. Returns the handles (kept for the pipeline's life)."""
    import threading

    from .hooks import is_wrapped, remove_wrap, swap_attribute, wrap_method

    callers, aliases = _forward_callers(transformer), _forward_aliases(transformer)
    if not callers and not aliases or transformer.__dict__.get("_ditbook_entry_routed") == id(transformer):
        return []
    # a deep copy of a routed transformer (the parallel worker copies a pristine pipeline per plan) holds
    # the original's routes, which call the original: take them off and route the copy itself
    for n in callers + aliases:
        if is_wrapped(transformer, "ditbook-entry", attr=n):
            remove_wrap(transformer, "ditbook-entry", attr=n)
    depth = threading.local()  # the one-process CP simulation runs ranks as threads

    def enter(module, args, kwargs):
        depth.n = getattr(depth, "n", 0) + 1

    def leave(module, args, kwargs, output):
        depth.n = getattr(depth, "n", 1) - 1

    handles = [transformer.register_forward_pre_hook(enter, with_kwargs=True),
               transformer.register_forward_hook(leave, with_kwargs=True, always_call=True)]

    def through_call(original, *args, **kwargs):
        if getattr(depth, "n", 0) > 0:
            return original(*args, **kwargs)
        return transformer(*args, **kwargs)

    def forward_routed_while(original, *args, **kwargs):
        if getattr(depth, "n", 0) > 0 or is_wrapped(transformer, "ditbook-entry-forward"):
            return original(*args, **kwargs)
        wrap_method(transformer, "ditbook-entry-forward", through_call)
        try:
            return original(*args, **kwargs)
        finally:
            remove_wrap(transformer, "ditbook-entry-forward")

    handles.append(swap_attribute(transformer, "_ditbook_entry_routed", id(transformer)))
    return handles + [wrap_method(transformer, "ditbook-entry", through_call, attr=n) for n in aliases] + [
        wrap_method(transformer, "ditbook-entry", forward_routed_while, attr=n) for n in callers]


def build_meta_transformer(card: ModelCard):
    """The transformer from its config only, on the meta device: no weights are read."""
    import torch

    cls = import_class(card.resolve_source(card.transformer.source), card.transformer.cls)
    sub = card.transformer.subfolder or "transformer"
    config = cls.load_config(str(card.path), subfolder=sub, local_files_only=True)
    with torch.device("meta"):
        return cls.from_config(config)
