"""The adapter module's text, one plain Python file in the layout of cache-dit's own adapters: constants, the folded
loop bodies, rewritten methods and ``PatchFunctor`` when folded, and the registration function. The model's names are
imported from where each folded function is defined; the file never needs ditbook."""

from __future__ import annotations

import ast
import builtins
import re
import sys
import textwrap
import types
from pathlib import Path

from .loopfold import (LoopFold, defining_globals, extra_method_sources, fold_methods, loop_body_class_name, loop_body_source, rewritten_method_source)

# (hidden_states index, encoder_hidden_states index) in a block's returned tuple
PATTERN_OUTPUT_INDEX = {
    "Pattern_0": (0, 1), "Pattern_1": (1, 0), "Pattern_2": (0, None),
    "Pattern_3": (0, None), "Pattern_4": (0, 1), "Pattern_5": (1, 0),
}


def safe_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_").lower()
    return name if name and not name[0].isdigit() else f"m_{name}"


def snake(cls_name: str) -> str:
    base = cls_name[: -len("Pipeline")] if cls_name.endswith("Pipeline") and cls_name != "Pipeline" else cls_name
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()


def adapter_function_name(pipeline_class: str) -> str:
    """The registration function of the adapter module (cache-dit's naming: ``flux_adapter``)."""
    return f"{snake(pipeline_class)}_adapter"


def importable_module_name(name: str) -> tuple[str, str | None]:
    """The name a plain interpreter imports module ``name`` by, and the folder it needs on ``sys.path``."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if file is None:
        return name, None
    stem = Path(file).with_suffix("").as_posix()
    if stem.endswith("/" + name.replace(".", "/")) or stem.endswith("/" + name.replace(".", "/") + "/__init__"):
        return name, None
    return Path(file).stem, str(Path(file).parent)  # loaded from a file under another name


def free_names(tree: ast.AST) -> list[str]:
    """Names a function reads but never binds, in order of first use."""
    bound, loaded = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.Lambda, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                bound.add(arg.arg)
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                bound.add(node.id)
            elif node.id not in loaded:
                loaded.append(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
    return [n for n in loaded if n not in bound]


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node):
        if node.id in self.names:
            return ast.copy_location(ast.Name(id=self.names[node.id], ctx=node.ctx), node)
        return node


class _OWN:
    """Stands for a name the adapter module defines itself: never the same object as a model's."""


class ModelNames:
    """The imports that give the emitted functions the globals they had where they were defined."""

    def __init__(self, reserved: dict[str, object]):
        self.bound: dict[str, object] = dict(reserved)  # name in the adapter module -> its object
        self.imports: dict[str, list[str]] = {}  # defining module -> ["name", "name as alias"]
        self.missing: dict[str, list[str]] = {}
        self.modules: list[str] = []  # modules the model's code names: ``import torch.nn.functional as F``

    def resolve(self, source: str, scope: dict, new_name: str) -> str:
        """``source`` (one ``def``) renamed ``new_name``, its free names imported from ``scope``'s module."""
        tree = ast.parse(source)
        fn = tree.body[0]
        fn.name = new_name
        module = scope.get("__name__", "?")
        renames = {}
        for n in free_names(fn):
            if n in scope:
                local = self._bind(module, n, scope[n])
                if local != n:
                    renames[n] = local
            elif not hasattr(builtins, n) and n not in self.missing.setdefault(module, []):
                self.missing[module].append(n)
        if renames:
            fn = _Rename(renames).visit(fn)
        return ast.unparse(ast.fix_missing_locations(fn)) + "\n"

    def _bind(self, module: str, name: str, obj) -> str:
        if name in self.bound and self.bound[name] is obj:
            return name  # the same object is bound already (torch, a name two modules share)
        local = name
        if local in self.bound:
            local = f"_{safe_name(module)}_{name}"
            while local in self.bound and self.bound[local] is not obj:
                local += "_"
            if local in self.bound:
                return local
        self.bound[local] = obj
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            self.modules.append(f"import {obj.__name__}" + (f" as {local}" if local != obj.__name__ else ""))
        else:
            self.imports.setdefault(module, []).append(name if local == name else f"{name} as {local}")
        return local

    def lines(self) -> list[str]:
        out = sorted(set(self.modules))
        for module, names in self.imports.items():
            plain, folder = importable_module_name(module)
            if folder:
                out.append(f"# {plain} is third-party code: put {folder} on sys.path (PYTHONPATH)")
            out.append(f"from {plain} import {', '.join(names)}  # names the model's code uses, where it is defined")
        for module, names in self.missing.items():
            if names:
                out.append(f"# not found in {importable_module_name(module)[0]}: {', '.join(names)}")
        return out


def _header(info, functor: str | None, version: str) -> list[str]:
    """The module docstring and the imports of the adapter module itself."""
    fn_name = adapter_function_name(info.pipeline_class)
    lines = [
        f'"""cache-dit adapter for {info.transformer_class} ({info.pipeline_class}).',
        "",
        f"Written by ditbook {version} from the inspection of model {info.model!r}, in the layout of cache-dit's",
        "own adapters (caching/block_adapters/adapters.py) and patch functors (caching/patch_functors/).",
        f"The cache stage ran the model through this file (cache/{info.module_name}.py of the run folder);",
        "cache/upstream/ holds the same text under the name below.",
        "",
        f"    from {safe_name(info.model)}_adapter import {fn_name}",
        f"    cache_dit.enable_cache({fn_name}(pipe), cache_config=cache_dit.DBCacheConfig(...))",
        "",
        "Block lists and forward patterns: "
        + ", ".join(f"{p.path} ({p.pattern}{', folded' if p.folded else ''})" for p in info.block_lists) + ".",
    ]
    if functor:
        lines += ["", f"{functor} folds the per-block work of the transformer's loop into its blocks, because:"]
        lines += [f"- {r}" for r in (info.functor_reasons or ["forced"])]
    lines += ['"""', "", "from __future__ import annotations", ""]
    if functor:
        lines += ["import types", "", "import torch"]
    lines.append("from cache_dit import BlockAdapter, BlockAdapterRegister, ForwardPattern"
                 + (", PatchFunctor" if functor else ""))
    return lines


def _constants(info, folded: dict[str, str]) -> list[str]:
    lists = [(p.path, p.pattern) for p in info.block_lists]
    meta = {p.block_class: PATTERN_OUTPUT_INDEX[p.pattern] for p in info.block_lists}
    return [
        f"PIPELINE_CLASS = {info.pipeline_class!r}",
        f"TRANSFORMER_CLASS = {info.transformer_class!r}",
        f"OWNER = {getattr(info, 'owner', '')!r}  # the module whose forward runs the loops ('': the transformer)",
        f"CONTAINERS = {tuple(getattr(info, 'containers', []) or ())!r}  # (containers, attribute): lists of "
        "never-called containers",
        f"BLOCK_LISTS = {lists!r}  # (attribute path, cache-dit ForwardPattern)",
        f"HAS_SEPARATE_CFG = {info.has_separate_cfg!r}  # CFG runs as a second transformer call per step",
        "# for diffusers' hooks: block class -> (hidden_states index, encoder_hidden_states index) of its output",
        f"DIFFUSERS_BLOCK_OUTPUTS = {meta!r}",
    ]


_NOT_TENSOR = '''

class CarriedNotTensor(TypeError):
    """A folded loop carries a second name that is not a tensor at run time: cache-dit carries it
    as the encoder stream (a tensor it caches and slices), so this model cannot be cached this way."""
'''


def _body_function_name(fold: LoopFold, variant: LoopFold) -> str:
    """The loop body's ``def`` name: one per list, or per mode method (by ``_loop_mode`` number where names collide)."""
    base = f"_{safe_name(fold.path)}_loop_body"
    if not fold.modes:
        return base
    tails = [safe_name(v.method) for v in fold.variants]
    k = next(i for i, v in enumerate(fold.variants) if v is variant)
    return f"{base}_{tails[k]}" if tails.count(tails[k]) == 1 else f"{base}_{k}"


def _loop_body_class(tcls, fold: LoopFold, fn_names: list[str]) -> str:
    """The module class running one block of ``fold.path`` with the loop's work."""
    if len(fn_names) > 1:
        fn_name, mode_kw = f"({', '.join(fn_names)})[_loop_mode]", ", _loop_mode=0"
    else:
        fn_name, mode_kw = fn_names[0], ""
    two = len(fold.carried) == 2
    guard = ""
    if two:
        guard = (
            "        if out[1] is not None and not isinstance(out[1], torch.Tensor):  # what the source could not show\n"
            f"            raise CarriedNotTensor(\n"
            f"                f\"the loop over self.{fold.path} carries '{fold.carried[1]}' besides the stream, and at run \"\n"
            f"                f\"time it is a {{type(out[1]).__name__}}, not a tensor: cache-dit carries a second loop name \"\n"
            f"                f\"as the encoder stream (a tensor it caches and slices)\")\n")
    returns = "(hidden_states, encoder_hidden_states)" if two else "hidden_states"
    return textwrap.dedent(f'''

        class {loop_body_class_name(tcls, fold.path)}(torch.nn.Module):
            """Block i of ``{fold.path}`` with the loop's work for it (``{fn_name}``); returns {returns} ({fold.pattern})."""

            def __init__(self, block, index, owner, originals=None):
                super().__init__()
                self.inner = block  # not named "block": cache-dit would inspect it instead of this wrapper
                self.index = index
                object.__setattr__(self, "_owner", owner)  # not a submodule: no cycle
                # the original blocks, for a loop body that reads the list itself (len, indexing):
                # while cached, the transformer's attribute holds cache-dit's one-unit stand-in
                object.__setattr__(self, "_originals", originals)

            def forward(self, hidden_states{", encoder_hidden_states=None" if two else ""}{mode_kw}, **loop_inputs):
                out = {fn_name}(self._owner, self.index, self.inner, hidden_states{", encoder_hidden_states" if two else ""},
                    _original_list=self._originals, **loop_inputs)
        ''') + guard + "        return out\n"


def adapter_module_source(tcls, info, folds: list[LoopFold], version: str) -> str:
    """The adapter module's text (see the module docstring); ``info`` is the stage's ``AdapterInfo``."""
    functor = info.patch_functor if folds else None
    folded = {f.path: loop_body_class_name(tcls, f.path) for f in folds}
    lines = _header(info, functor, version)
    body = ["", ""] + _constants(info, folded)
    if functor:
        names = ModelNames(_reserved(tcls, info, folds, functor))
        body += _fold_pieces(tcls, folds, functor, names)
        lines += [""] + names.lines()
    elif getattr(info, "containers", None):
        body += ["FOLDED = {}  # no loop is folded", _CONTAINER_OWNERS.rstrip()]
        lines += ["", "import types", "", "import torch"]
    else:
        body += ["FOLDED = {}  # no loop is folded", "", "", "def unpatch(transformer):",
                 '    """Nothing to undo: this adapter has no patch functor."""', "    return transformer"]
    body += _container_registration(info) if getattr(info, "containers", None) else _registration(info, functor)
    return "\n".join(lines + body) + "\n"


def _reserved(tcls, info, folds: list[LoopFold], functor: str) -> dict[str, object]:
    """The names the adapter module binds itself (colliding model names are imported under an alias)."""
    import cache_dit
    import torch

    own = {n: _OWN for n in ("PIPELINE_CLASS", "TRANSFORMER_CLASS", "OWNER", "CONTAINERS", "BLOCK_LISTS", "HAS_SEPARATE_CFG",
                             "DIFFUSERS_BLOCK_OUTPUTS", "FOLDED", "FOLDED_METHODS", "CarriedNotTensor", "_get",
                             "unpatch", functor, adapter_function_name(info.pipeline_class), "annotations")}
    own.update({_body_function_name(f, v): _OWN for f in folds for v in f.variants})
    own.update({loop_body_class_name(tcls, f.path): _OWN for f in folds})
    own.update({f"_folded_{m}": _OWN for m in [*fold_methods(folds), *extra_method_sources(tcls, folds)]})
    own.update(torch=torch, types=types, BlockAdapter=cache_dit.BlockAdapter,
               BlockAdapterRegister=cache_dit.BlockAdapterRegister, ForwardPattern=cache_dit.ForwardPattern,
               PatchFunctor=cache_dit.PatchFunctor)
    return own


def _fold_pieces(tcls, folds: list[LoopFold], functor: str, names: ModelNames) -> list[str]:
    """Loop bodies, their block classes, the rewritten methods, the functor and ``unpatch``."""
    out = [_NOT_TENSOR.rstrip("\n")] if any(len(f.carried) == 2 for f in folds) else []
    for fold in folds:
        fn_names = [_body_function_name(fold, v) for v in fold.variants]
        for v, fn_name in zip(fold.variants, fn_names):
            src = names.resolve(loop_body_source(v, [f.path for f in folds]), defining_globals(tcls, v.method), fn_name)
            out += ["", "", src.rstrip()]
        out.append(_loop_body_class(tcls, fold, fn_names).rstrip())
    methods = {m: rewritten_method_source(tcls, folds, m) for m in fold_methods(folds)}
    methods.update(extra_method_sources(tcls, folds))
    for name, src in methods.items():
        out += ["", "", names.resolve(src, defining_globals(tcls, name), f"_folded_{name}").rstrip()]
    folded = ", ".join(f"{f.path!r}: {loop_body_class_name(tcls, f.path)}" for f in folds)
    bound = ", ".join(f"{name!r}: _folded_{name}" for name in methods)
    out += ["", "", f"FOLDED = {{{folded}}}  # block list -> the class that runs one of its blocks with the loop's work",
            f"FOLDED_METHODS = {{{bound}}}  # transformer methods replaced on the patched instance"]
    out.append(_FUNCTOR.replace("FUNCTOR", functor).replace("TRANSFORMER", tcls.__name__).rstrip())
    return out


_FUNCTOR = '''

def _get(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class FUNCTOR(PatchFunctor):
    """Folds the per-block loop work of TRANSFORMER into its blocks, per instance (``unpatch`` undoes it)."""

    @classmethod
    def is_from_diffusers(cls, transformer):
        return True  # written for this transformer class; it needs no diffusers check

    def _apply(self, transformer, *args, **kwargs):
        if getattr(transformer, "_ditbook_folded", False):
            return transformer
        # atomic: everything that can fail (binding, wrapping) happens before the instance
        # changes; the swap itself is undone if it fails half-way
        bound = {name: types.MethodType(fn, transformer) for name, fn in FOLDED_METHODS.items()}
        lists = {path: _get(transformer, path) for path in FOLDED}
        saved = {path: list(blocks) for path, blocks in lists.items()}
        wrapped = {path: [body_cls(b, i, transformer, list(saved[path])) for i, b in enumerate(saved[path])]
                   for path, body_cls in FOLDED.items()}
        old_methods = {name: transformer.__dict__[name] for name in bound if name in transformer.__dict__}
        had_patched = "_is_patched" in transformer.__dict__
        old_patched = transformer.__dict__.get("_is_patched")
        try:
            for path, blocks in lists.items():
                for i, w in enumerate(wrapped[path]):
                    blocks[i] = w
            for name, method in bound.items():
                setattr(transformer, name, method)
            # the original blocks, for ``self.<list>[i].attr`` outside the loop (not a submodule)
            object.__setattr__(transformer, "_ditbook_originals", saved)
            transformer._ditbook_folded = True
            transformer._is_patched = True
        except BaseException:
            for path, blocks in lists.items():
                for i, b in enumerate(saved[path]):
                    blocks[i] = b
            for name in bound:
                transformer.__dict__.pop(name, None)
            transformer.__dict__.update(old_methods)
            transformer.__dict__.pop("_ditbook_folded", None)
            transformer.__dict__.pop("_ditbook_originals", None)
            transformer.__dict__.pop("_is_patched", None)
            if had_patched:
                transformer._is_patched = old_patched
            raise
        return transformer


def unpatch(transformer):
    """Undo FUNCTOR on one transformer instance."""
    if not getattr(transformer, "_ditbook_folded", False):
        return transformer
    for path in FOLDED:
        blocks = _get(transformer, path)
        for i in range(len(blocks)):
            blocks[i] = blocks[i].inner
    for name in FOLDED_METHODS:
        transformer.__dict__.pop(name, None)
    transformer.__dict__.pop("_ditbook_originals", None)
    del transformer._ditbook_folded
    transformer.__dict__.pop("_is_patched", None)
    return transformer
'''


def _registration(info, functor: str | None) -> list[str]:
    """The registration function, in cache-dit's adapters.py layout."""
    blocks = ", ".join(f"pipe.transformer.{p.path}" for p in info.block_lists)
    patterns = ", ".join(f"ForwardPattern.{p.pattern}" for p in info.block_lists)
    return ["", "",
            f"@BlockAdapterRegister.register({info.pipeline_class!r})",
            f"def {adapter_function_name(info.pipeline_class)}(pipe, **kwargs) -> BlockAdapter:",
            f'    """{info.pipeline_class}: {len(info.block_lists)} block list(s) of {info.transformer_class}."""',
            "    return BlockAdapter(",
            "        pipe=pipe,",
            f"        transformer=pipe.transformer{'.' + info.owner if getattr(info, 'owner', '') else ''},",
            f"        blocks=[{blocks}],",
            f"        forward_pattern=[{patterns}],",
            f"        patch_functor={functor + '()' if functor else 'None'},",
            f"        has_separate_cfg={info.has_separate_cfg!r},",
            "        check_forward_pattern=True,",
            "        **kwargs,",
            "    )"]


_CONTAINER_OWNERS = '''


class ContainerOwner(torch.nn.Module):
    """Stands in for a container the transformer never calls (it runs the container's block list in
    its own loop): cache-dit swaps the list on this owner while the owner's forward runs, and the swap
    lands on the container; the forward runs the next owner, the last one the transformer's own forward."""

    def __init__(self, container, name, following):
        super().__init__()
        object.__setattr__(self, "_container", container)  # not submodules: no cycle, no second copy
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_following", following)

    def __getattr__(self, name):
        if name == self.__dict__.get("_name"):
            return getattr(self.__dict__["_container"], name)
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name == self.__dict__.get("_name"):
            return setattr(self._container, name, value)
        return super().__setattr__(name, value)

    def __delattr__(self, name):
        if name == self.__dict__.get("_name"):
            return delattr(self._container, name)
        return super().__delattr__(name)

    def forward(self, *args, **kwargs):
        return self._following(*args, **kwargs)


def container_owners(transformer):
    """One ContainerOwner per container, chained: the transformer's forward (on this instance) runs
    the first; built once per instance, taken off by ``unpatch``."""
    if "_ditbook_container_owners" in transformer.__dict__:
        return transformer.__dict__["_ditbook_container_owners"]
    outer, name = CONTAINERS
    following, owners = transformer.forward, []
    for container in reversed([c for c in _get(transformer, outer) if isinstance(getattr(c, name, None), torch.nn.ModuleList)]):
        following = ContainerOwner(container, name, following)
        owners.insert(0, following)
    object.__setattr__(transformer, "_ditbook_container_owners", owners)
    object.__setattr__(transformer, "forward", types.MethodType(lambda self, *a, **k: owners[0](*a, **k), transformer))
    return owners


def _get(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def unpatch(transformer):
    """Take the container owners off one transformer instance (its own forward back)."""
    if transformer.__dict__.pop("_ditbook_container_owners", None) is not None:
        transformer.__dict__.pop("forward", None)
    return transformer
'''


def _container_registration(info) -> list[str]:
    """The registration function for lists of never-called containers: one stand-in owner each."""
    outer, name = info.containers
    patterns = ", ".join(f"[ForwardPattern.{p.pattern}]" for p in info.block_lists)
    return ["", "",
            f"@BlockAdapterRegister.register({info.pipeline_class!r})",
            f"def {adapter_function_name(info.pipeline_class)}(pipe, **kwargs) -> BlockAdapter:",
            f'    """{info.pipeline_class}: the {name} of each of self.{outer} of {info.transformer_class}."""',
            "    owners = container_owners(pipe.transformer)",
            "    return BlockAdapter(",
            "        pipe=pipe,",
            "        transformer=owners,",
            f"        blocks=[[getattr(o, {name!r})] for o in owners],",
            f"        blocks_name=[[{name!r}] for _ in owners],",
            f"        forward_pattern=[{patterns}],",
            "        patch_functor=None,",
            f"        has_separate_cfg={info.has_separate_cfg!r},",
            "        check_forward_pattern=False,  # the loop passes the streams positionally (checked by ditbook)",
            "        **kwargs,",
            "    )"]


def refused_module_source(info) -> str:
    """The text written in place of the adapter module when the adapter is refused."""
    return (f'"""No cache-dit adapter for {info.transformer_class} ({info.pipeline_class}): refused by ditbook.\n\n'
            f'{info.refused}\n"""\n\nREFUSED = {info.refused!r}\nBLOCK_LISTS = []\n')
