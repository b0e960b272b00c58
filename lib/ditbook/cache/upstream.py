"""Code a cache-dit maintainer can merge: for the model of a cache stage, three plain files under
``cache/upstream/`` of the run folder, in the layouts cache-dit 1.5 uses for its own models.

- ``<model>_adapter.py`` — the adapter module the cache stage ran, copied byte for byte (a
  ``BlockAdapterRegister`` registration and, where needed, a ``PatchFunctor``).
- ``<model>_cp_planner.py`` — a ``ContextParallelismPlanner`` subclass and ``register_cp_planner()``.
- ``<model>_example.py`` — load the pipeline, enable the cache with the chosen configuration, render.

They need diffusers, cache-dit and the model's own code, never ditbook.
"""

from __future__ import annotations

import ast
import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import hooks
from ..adapter.build import AdapterInfo
from ..adapter.source import adapter_function_name, importable_module_name, refused_module_source, safe_name


@dataclass
class UpstreamFiles:
    folder: str
    adapter_module: str
    example: str
    cp_planner: str | None = None
    cp_plan_source: str | None = None
    cp_planner_reason: str | None = None
    example_strategy: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def importable_module(cls) -> tuple[str, str | None]:
    """(the module name a plain interpreter imports ``cls`` by, the folder it needs on sys.path)."""
    return importable_module_name(cls.__module__)


def _cp_code(v) -> str:
    kind = type(v).__name__
    if kind.endswith("ContextParallelInput"):
        return (f"_ContextParallelInput(split_dim={v.split_dim}, expected_dims={v.expected_dims}, "
                f"split_output={v.split_output})")
    if kind.endswith("ContextParallelOutput"):
        return f"_ContextParallelOutput(gather_dim={v.gather_dim}, expected_dims={v.expected_dims})"
    if v is None:
        return "None"
    if isinstance(v, dict):
        inner = ",\n".join(f"{k!r}: {_cp_code(x)}" for k, x in v.items())
        return "{\n" + textwrap.indent(inner, "    ") + ",\n}"
    if isinstance(v, (list, tuple)):
        items = ", ".join(_cp_code(x) for x in v)
        return f"[{items}]" if isinstance(v, list) else f"({items},)"
    raise TypeError(f"cannot write {type(v).__name__} in a CP plan")


def cp_planner_source(plan: dict, source: str, notes: list, transformer_class: str, model: str) -> str:
    cls_name = f"{transformer_class}ContextParallelismPlanner"
    lines = [
        f'"""Context-parallel planner for {transformer_class}, in the layout of cache-dit\'s planners',
        "(cache_dit/distributed/transformers/<model>.py). Written by ditbook for model "
        f"{model!r}; plan source: {source}.",
        *([""] + [f"- {n}" for n in notes] if notes else []),
        "",
        "    from " + f"{safe_name(model)}_cp_planner import register_cp_planner",
        "    register_cp_planner()  # then: cache_dit.enable_cache(pipe, ..., parallelism_config=ParallelismConfig(ulysses_size=N))",
        '"""',
        "",
        "from cache_dit.distributed.core import _ContextParallelInput, _ContextParallelModelPlan, _ContextParallelOutput",
        "from cache_dit.distributed.transformers.register import ContextParallelismPlanner, ContextParallelismPlannerRegister",
        "",
        "",
        f"class {cls_name}(ContextParallelismPlanner):",
        "",
        "    def _apply(self, transformer=None, parallelism_config=None, **kwargs) -> _ContextParallelModelPlan:",
        "        _cp_plan = " + textwrap.indent(_cp_code(plan), "        ").lstrip(),
        "        return _cp_plan",
        "",
        "",
        "def register_cp_planner():",
        f'    """Register {cls_name} under {transformer_class!r} (once: cache-dit refuses a name twice)."""',
        "    _, names = ContextParallelismPlannerRegister.supported_planners()",
        f"    if {transformer_class!r} not in names:",
        f"        ContextParallelismPlannerRegister.register({transformer_class!r})({cls_name})",
        f"    return {cls_name}",
        "",
    ]
    return "\n".join(lines)


def cache_dit_call(session, name: str, config: dict) -> dict | None:
    """The ``cache_dit.enable_cache`` keyword arguments a strategy configuration passes (recorded by
    applying and undoing it), or None when the strategy does not go through cache-dit."""
    import cache_dit

    from .. import accel

    strat = accel.get(name)
    box: dict = {}

    def record(original, *args, **kwargs):
        box.update(kwargs)
        return original(*args, **kwargs)

    handle = hooks.wrap_method(cache_dit, "ditbook-upstream-record", record, attr="enable_cache")
    try:
        undo = strat.apply(session.pipe, strat.settings(**config), adapter=session.adapter, steps=session.card.generation.steps)
        undo()
    finally:
        handle.remove()
    return box or None


def example_strategy(session) -> dict:
    """The configuration the example runs: the chosen one when it goes through cache-dit, else
    the held-out-confirmed (then calibration-passing) cache-dit configuration that skips most."""
    chosen = session.chosen
    if chosen:
        call = cache_dit_call(session, chosen.name, chosen.config)
        if call:
            return {"name": chosen.name, "config": chosen.config, "why": "the configuration the stage chose",
                    "call": call}
    for split in ("holdout", "calibration"):
        rows = sorted([r for r in session.results if r.split == split and r.passed],
                      key=lambda r: (-r.skipped_fraction, -r.quality.psnr_min))
        for r in rows:
            call = cache_dit_call(session, r.name, r.config)
            if call:
                why = (f"best passing cache-dit configuration ({split})"
                       + (f"; the stage chose {chosen.name}, which is not a cache-dit strategy" if chosen else ""))
                return {"name": r.name, "config": r.config, "why": why, "call": call}
    call = cache_dit_call(session, "dbcache", {})
    return {"name": "dbcache", "config": {}, "why": "no cache-dit configuration passed: ditbook's DBCache defaults",
            "call": call}


def _config_expr(obj) -> str:
    """``cache_dit.<Config>(field=value, ...)`` with the fields that differ from its defaults."""
    import dataclasses

    import cache_dit

    cls = type(obj)
    if getattr(cache_dit, cls.__name__, None) is not cls:
        raise ValueError(f"{cls.__name__} is not exported by cache_dit")
    default = cls()
    kw = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init
          and getattr(obj, f.name) != getattr(default, f.name)}
    text = repr(kw)
    ast.literal_eval(text)  # only literals are written
    return f"cache_dit.{cls.__name__}(**{text})"


def _enable_lines(call: dict, adapter_expr: str) -> list[str]:
    args = [adapter_expr]
    for key in ("cache_config", "calibrator_config"):
        value = call.get(key)
        args.append(f"{key}={_config_expr(value) if value is not None else 'None'}")
    return [f"        cache_dit.enable_cache({', '.join(args)})"]


def _findable(module: str) -> bool:
    """Whether a fresh interpreter finds ``module`` on its path (not only in this ``sys.modules``)."""
    import importlib.machinery

    return importlib.machinery.PathFinder.find_spec(module.split(".")[0]) is not None


def _unfindable_components(pipe, card) -> list[tuple[str, type]]:
    """Components whose library, as ``model_index.json`` records it, a fresh interpreter cannot
    import: the example loads those (and so every component) explicitly."""
    index_file = Path(card.path) / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    out = []
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        if not _findable(value[0]) and getattr(pipe, name, None) is not None:
            out.append((name, type(getattr(pipe, name))))
    return out


def _components(pipe) -> list[tuple[str, type]]:
    return [(n, type(c)) for n, c in getattr(pipe, "components", {}).items() if c is not None]


def _class_imports(pipe, card, pcls, tcls) -> list[str]:
    classes = [pcls, tcls] + ([c for _, c in _components(pipe)] if _unfindable_components(pipe, card) else [])
    lines = []
    for cls in dict.fromkeys(classes):
        mod, _ = importable_module(cls)
        line = f"from {mod} import {cls.__name__}  # noqa: E402"
        if line not in lines:
            lines.append(line)
    return lines


def _load_lines(pipe, card, pcls, tcls, sub) -> list[str]:
    import torch

    load_t = f"    transformer = {tcls.__name__}.from_pretrained(args.model_path, subfolder={sub!r}, torch_dtype=dtype)"
    bad = _unfindable_components(pipe, card)
    if not bad:
        return [load_t, f"    pipe = {pcls.__name__}.from_pretrained(args.model_path, transformer=transformer, "
                        "torch_dtype=dtype)"]
    lines = [f"    # model_index.json names {', '.join(sorted({n for n, _ in bad}))}'s library as a module only "
             "the process that saved it had:", "    # every component is loaded from its own subfolder instead",
             load_t]
    names = []
    for name, cls in _components(pipe):
        names.append(name)
        if name == "transformer":
            continue
        dt = ", torch_dtype=dtype" if issubclass(cls, torch.nn.Module) else ""
        lines.append(f"    {name} = {cls.__name__}.from_pretrained(args.model_path, subfolder={name!r}{dt})")
    lines.append(f"    pipe = {pcls.__name__}({', '.join(f'{n}={n}' for n in names)})")
    return lines


def example_source(session, info: AdapterInfo, strategy: dict) -> str:
    # long: the example script's text from top to bottom, in the order a reader meets it
    from ..render import call_kwargs

    card, pipe = session.card, session.pipe
    pcls, tcls = type(pipe), type(pipe.transformer)
    _, p_dir = importable_module(pcls)
    _, t_dir = importable_module(tcls)
    adapter_mod = f"{safe_name(info.model)}_adapter"
    fn_name = adapter_function_name(info.pipeline_class)
    folders = sorted({d for d in (p_dir, t_dir) if d})
    kwargs = {k: v for k, v in call_kwargs(pipe, card).items()}
    sub = card.transformer.subfolder or "transformer"
    uses_registered = info.used == "cache-dit"
    adapter_expr = "pipe" if uses_registered else f"{fn_name}(pipe)"
    lines = [
        f'"""{info.pipeline_class} with cache-dit: {strategy["name"]} {json.dumps(strategy["config"])}.',
        "",
        f"Written by ditbook for model {info.model!r} ({strategy['why']}); in the style of cache-dit's examples.",
        f"    python {safe_name(info.model)}_example.py --model-path PATH --out OUT [--no-cache]",
        "Renders every prompt x seed of the model card and saves each image as OUT/p<prompt>_s<seed>.npy.",
        '"""',
        "",
        "import argparse",
        "import os",
        "import sys",
        "",
        "import numpy as np",
        "import torch",
        "",
        "import cache_dit",
        "",
        "HERE = os.path.dirname(os.path.abspath(__file__))",
        "sys.path.insert(0, HERE)",
        *[f"sys.path.insert(0, {d!r})  # the model's own code" for d in folders],
        "",
        f"from {adapter_mod} import {fn_name}  # noqa: E402  (registers the adapter with cache-dit)",
        *_class_imports(pipe, card, pcls, tcls),
        "",
        f"PROMPTS = {list(card.generation.prompts)!r}",
        f"SEEDS = {list(card.generation.seeds)!r}",
        f"CALL_KWARGS = {kwargs!r}",
        "",
        "",
        "def main():",
        "    parser = argparse.ArgumentParser()",
        f"    parser.add_argument('--model-path', default={str(card.path)!r})",
        "    parser.add_argument('--out', default='outputs')",
        f"    parser.add_argument('--device', default={session.ctx.placement.device!r})",
        f"    parser.add_argument('--dtype', default={session.ctx.placement.dtype!r})",
        "    parser.add_argument('--no-cache', action='store_true')",
        "    args = parser.parse_args()",
        "    dtype = getattr(torch, args.dtype)",
        *_load_lines(pipe, card, pcls, tcls, sub),
        "    pipe.to(args.device)",
        "    pipe.set_progress_bar_config(disable=True)",
        "    if not args.no_cache:",
        *_enable_lines(strategy["call"], adapter_expr),
        "    os.makedirs(args.out, exist_ok=True)",
        "    for i, prompt in enumerate(PROMPTS):",
        "        for seed in SEEDS:",
        "            out = pipe(prompt=prompt, generator=torch.Generator('cpu').manual_seed(seed), **CALL_KWARGS)",
        "            frames = getattr(out, 'frames', None)  # a video pipeline: every frame of the first video",
        "            image = np.asarray(out.images[0] if frames is None else frames[0], dtype=np.float32)",
        "            np.save(os.path.join(args.out, f'p{i}_s{seed}.npy'), image)",
        "    if not args.no_cache:",
        "        cache_dit.summary(pipe)",
        "        cache_dit.disable_cache(pipe)",
        "",
        "",
        'if __name__ == "__main__":',
        "    main()",
        "",
    ]
    return "\n".join(lines)


def write_upstream(session, folder: str | Path | None = None) -> UpstreamFiles:
    """Write the three files for the session's model under ``cache/upstream/`` (or ``folder``)."""
    from copy import deepcopy

    from ..cp.plan import PlanDerivationError, capture_transformer_call, resolve_cp_plan

    info = deepcopy(session.adapter.info)
    folder = Path(folder) if folder else session.ctx.dir / "upstream"
    folder.mkdir(parents=True, exist_ok=True)
    base = safe_name(info.model)
    adapter_path = folder / f"{base}_adapter.py"
    refused = getattr(session, "refused", None)  # the cache stage refused caching: no adapter to ship, no example
    adapter_path.write_text(refused_module_source(info) if refused else session.adapter.source)
    out = UpstreamFiles(folder=str(folder), adapter_module=adapter_path.name, example="")
    try:
        cp = resolve_cp_plan(session.pipe.transformer,
                             capture=lambda: capture_transformer_call(session.pipe, session.card))
        planner = folder / f"{base}_cp_planner.py"
        planner.write_text(cp_planner_source(cp.plan, cp.source, cp.notes, info.transformer_class, info.model))
        out.cp_planner, out.cp_plan_source = planner.name, cp.source
    except (PlanDerivationError, TypeError) as exc:
        out.cp_planner_reason = f"{type(exc).__name__}: {exc}"
    if refused:
        out.notes.append(f"no adapter and no example: the cache stage refused caching ({refused})")
    else:
        strategy = example_strategy(session)
        example = folder / f"{base}_example.py"
        example.write_text(example_source(session, info, strategy))
        out.example, out.example_strategy = example.name, {k: v for k, v in strategy.items() if k != "call"}
    if info.used == "cache-dit":
        out.notes.append(f"cache-dit has its own registration for {info.pipeline_class} "
                         f"({info.cache_dit_registered}); the example uses it, as the stage did")
    (folder / "upstream.json").write_text(json.dumps(out.to_dict(), indent=2))
    return out


__all__ = ["UpstreamFiles", "write_upstream", "cp_planner_source", "example_source",
           "importable_module", "cache_dit_call"]
