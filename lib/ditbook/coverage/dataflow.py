"""What a model's forward asks of its inputs, read from its code, for the coverage probe (issue 13);
no class names:

* **data flow** (``forward_needs``): per parameter, the first submodule it is passed to (a
  ``Linear`` fixes the last dim, a ``ConvNd`` rank, channels and a spatial multiple, an ``Embedding``
  long indices below its size; other modules are followed into their forward), how its ``.shape``
  is unpacked (also through a ``permute``), its documented shape (config entries, int literals and
  sums such as ``text_seq_len + image_seq_len``: ``doc_sizes``), the module constants it is
  compared with (token tags), lists fed element-wise to a ModuleList;
* **tensors from needs** (``tensor_for``): built on one coherent latent grid (``Grid``: frames x
  height x width, text of a fixed length); second text inputs sized by suffixed config entries;
* **pipelines** (``pipeline_value``): an input diffusers' own pipeline builds with one call the
  probe can evaluate (found from the pipelines' AST) is built that way.

The error-directed repairs of these inputs are ``coverage.repairs``."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass, field

import torch
from torch import nn


TEXT_LEN = 8

# axis roles by the names a forward unpacks ``x.shape`` into (exact short names, then words)
_ROLE_EXACT = {"b": "batch", "bs": "batch", "bsz": "batch", "n": "tokens", "l": "tokens", "s": "tokens",
               "seq": "tokens", "c": "channels", "ch": "channels", "f": "frames", "t": "frames", "h": "height",
               "w": "width", "d": "dim", "pt": "patch_t", "ph": "patch", "pw": "patch"}
_ROLE_WORDS = (("batch", "batch"), ("channel", "channels"), ("chan", "channels"), ("frame", "frames"),
               ("duration", "frames"), ("patches", "tokens"),
               ("height", "height"), ("width", "width"), ("seq", "tokens"), ("len", "tokens"),
               ("token", "tokens"), ("dim", "dim"), ("hidden", "dim"), ("feat", "dim"), ("embed", "dim"))


def axis_role(name: str | None) -> str | None:
    if not name:
        return None
    low = name.lower().strip("_")
    if low in _ROLE_EXACT:
        return _ROLE_EXACT[low]
    for word, role in _ROLE_WORDS:
        if word in low:
            return role
    return None


@dataclass
class Need:
    """What the code asks of one input."""

    roles: list | None = None  # one role (or None) per axis: the rank
    last: int | None = None  # the last dim (a Linear's in_features, a norm's width)
    channels: int | None = None  # a ConvNd's in_channels (axis 1)
    conv_dims: int | None = None  # N of the ConvNd that takes it (rank N + 2)
    stride: int = 1  # spatial sizes a multiple of this (a patch conv's stride)
    vocab: int | None = None  # an Embedding's size: long indices below it
    where: list = field(default_factory=list)  # how it was found (for messages/tests)
    values: list | None = None  # the int constants the code compares it with (token role tags)
    sizes: list | None = None  # per axis, a size the docstring names (an int, or terms to sum: ints, "text", "image")

    def empty(self) -> bool:
        return not (self.roles or self.last or self.channels or self.conv_dims or self.vocab or self.values)


def _source_tree(fn):
    try:
        fn = inspect.unwrap(fn)
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, None
    node = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    return fn, node


def _param_names(node) -> list[str]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n != "self"]


def _root_name(expr) -> str | None:
    """``x`` for ``x``, ``x.to(...)``, ``x.float()``, ``x.type(...)``, ``x.contiguous()``."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) \
            and expr.func.attr in ("to", "float", "type", "contiguous", "half", "bfloat16", "type_as"):
        expr = expr.func.value
    return expr.id if isinstance(expr, ast.Name) else None


def _self_module(owner, func) -> nn.Module | None:
    """The submodule ``self.a.b`` (or ``self.a[0]``) names, on ``owner``."""
    chain = []
    while True:
        if isinstance(func, ast.Attribute):
            chain.append(func.attr)
            func = func.value
        elif isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) \
                and isinstance(func.slice.value, int):
            chain.append(func.slice.value)
            func = func.value
        else:
            break
    if not (isinstance(func, ast.Name) and func.id == "self"):
        return None
    obj = owner
    for part in reversed(chain):
        try:
            obj = obj[part] if isinstance(part, int) else getattr(obj, part)
        except Exception:
            return None
    return obj if isinstance(obj, nn.Module) else None


# ``name (`torch.Tensor` of shape `(b, n, d)`)`` or the shape on the description's first line
_DOC_SHAPE = re.compile(r"^[ \t]*(\w+)\s*\((?:[^\n]*?|[^\n]*:[ \t]*\n[^\n]*?)of shape\s*`?\(([^)]*)\)", re.M)


# ``name: ``(B, 1, T)`` per-frame timesteps`` (a shape right after the name)
_DOC_SHAPE_COLON = re.compile(r"^[ \t]*(\w+):[ \t]*``?\(([^)]*)\)``?", re.M)


def doc_shapes(fn) -> list[tuple[str, str]]:
    """(parameter, its documented dims text) in both docstring styles."""
    doc = inspect.getdoc(fn) or ""
    return _DOC_SHAPE.findall(doc) + _DOC_SHAPE_COLON.findall(doc)


def _doc_roles(fn, params) -> dict[str, list]:
    out = {}
    for name, dims in doc_shapes(fn):
        if name in params:
            parts = [p.strip() for p in dims.split(",") if p.strip()]
            if parts and "..." not in dims:
                out[name] = [axis_role(p) for p in parts]
    return out


_DOC_SHAPE_START = re.compile(r"^\s*(\w+)\s*\(.*?of shape\s*`?\(", re.M)


def _doc_shape_parts(doc: str, start: int) -> list[str] | None:
    """The comma-separated dims of the documented shape whose ``(`` ends at ``start``, nested
    parentheses (``1 + len(layer_ids)``) kept inside their dim."""
    depth, parts, cur = 1, [], ""
    for ch in doc[start:start + 300]:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return [p.strip() for p in parts + [cur] if p.strip()]
        if ch == "," and depth == 1:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return None


def _config_size(expr: str, cfg: dict) -> int | None:
    """The value of a documented dim written with config entries (``cap_feat_dim``,
    ``1 + len(injection_layer_ids)``): ints, ``+ - * //`` and ``len`` only; None otherwise."""
    try:
        tree = ast.parse(expr.strip("` "), mode="eval")
    except SyntaxError:
        return None
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    if not any(n in cfg for n in names) or any(n not in cfg and n != "len" for n in names):
        return None
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Constant, ast.Name,
               ast.Load, ast.Call)
    if not all(isinstance(n, allowed) for n in ast.walk(tree)):
        return None
    try:
        val = eval(compile(tree, "<doc>", "eval"), {"__builtins__": {}}, {"len": len, **cfg})  # noqa: S307
    except Exception:
        return None
    return val if isinstance(val, int) and not isinstance(val, bool) and 0 < val <= 1 << 16 else None


def _doc_config_sizes(fn, params, model, needs: dict) -> None:
    """Documented dims that name the model's config (an axis per injected layer, a feature
    width): their sizes from the config, as ints among the roles (see ``_doc_roles``)."""
    cfg = dict(getattr(model, "config", None) or {})
    doc = inspect.getdoc(fn) or ""
    if not cfg:
        return
    for m in _DOC_SHAPE_START.finditer(doc):
        name = m.group(1)
        parts = _doc_shape_parts(doc, m.end())
        if name not in params or not parts or any("..." in p for p in parts):
            continue
        sizes = [_config_size(p, cfg) if not p.strip("` ").isidentifier() or axis_role(p) in (None, "dim", "channels")
                 else None for p in parts]
        if any(v is not None for v in sizes):
            roles = [v if v is not None else axis_role(p) for p, v in zip(parts, sizes)]
            needs[name].roles = roles
            if "docstring" not in needs[name].where:
                needs[name].where.append("docstring")


def _elementwise_width(mod: nn.Module) -> int | None:
    """D when every parameter of ``mod`` (and it has some, and no submodules) is 1-D of size D."""
    if list(mod.children()):
        return None
    shapes = {tuple(p.shape) for p in mod.parameters(recurse=False)}
    if len(shapes) == 1:
        (shape,) = shapes
        if len(shape) == 1:
            return int(shape[0])
    return None


def module_need(mod: nn.Module, position, depth: int = 0) -> Need:
    """What ``mod`` asks of the argument at ``position`` (an int, or a keyword name)."""
    need = Need(where=[type(mod).__name__])
    if isinstance(mod, nn.Linear):
        need.last = mod.in_features
    elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        need.conv_dims = len(mod.kernel_size)
        need.channels = mod.in_channels
        need.stride = max(int(s) for s in mod.stride)
        need.roles = ["batch", "channels"] + [("frames", "height", "width")[-need.conv_dims + i]
                                              for i in range(need.conv_dims)]
    elif isinstance(mod, nn.Embedding):
        need.vocab = mod.num_embeddings
    elif isinstance(mod, nn.LayerNorm) and mod.normalized_shape:
        need.last = int(mod.normalized_shape[-1])
    elif _elementwise_width(mod):  # a norm-like module: one 1-D weight over the last dim
        need.last = _elementwise_width(mod)
    elif isinstance(mod, nn.Sequential) and len(mod) and position == 0:
        return module_need(mod[0], 0, depth + 1)
    elif depth < 3 and type(mod).forward is not nn.Module.forward:
        sub = forward_needs(mod, depth + 1)
        _, node = _source_tree(type(mod).forward)
        if node is not None:
            params = _param_names(node)
            name = params[position] if isinstance(position, int) and position < len(params) else position
            if isinstance(name, str) and name in sub:
                inner = sub[name]
                if inner.empty() and axis_role(name) == "frames" and ("index" in name.lower() or "indices" in name.lower()):
                    inner.roles = ["frames"]  # ``frame_indices``: one position per frame
                inner.where = need.where + inner.where
                return inner
    return need


def forward_needs(model: nn.Module, depth: int = 0) -> dict[str, Need]:
    """Per forward parameter, what the forward's code asks of it (see the module docstring)."""
    fn, node = _source_tree(type(model).forward)
    if node is None:
        return {}
    params = _param_names(node)
    needs = {p: Need() for p in params}
    alias, alias_defs = _aliases(node, params)
    for p, roles in _doc_roles(fn, params).items():
        needs[p].roles = roles
        needs[p].where.append("docstring")
    _doc_config_sizes(fn, params, model, needs)
    for p, sizes in doc_sizes(fn, params, _model_config(model)).items():
        needs[p].sizes = sizes
    _unpack_roles(node, alias, needs)
    _first_module_needs(model, node, alias, _first_rebound(node, alias_defs), needs, depth)
    _compared_constants(fn, node, alias, needs)
    for need in needs.values():
        # a Linear takes it first: packed tokens (batch, tokens, features), whatever the
        # docstring says (docstrings often document the unpacked latent)
        if need.last and not need.conv_dims and "unpack" not in need.where and need.roles \
                and need.roles[-1] in ("height", "width"):
            need.roles = None
    return needs


def _compared_constants(fn, node, alias: dict, needs: dict) -> None:
    """``indicator == TEXT_TAG``: a parameter compared for equality with module-level int
    constants takes those values (tags of each token's role); ``values`` in the order the code
    names them."""
    glb = getattr(fn, "__globals__", {})
    for n in ast.walk(node):
        if not (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.Eq, ast.NotEq))):
            continue
        for a, b in ((n.left, n.comparators[0]), (n.comparators[0], n.left)):
            p = alias.get(_root_name(a) or "")
            if p and isinstance(b, ast.Name) and isinstance(glb.get(b.id), int) and not isinstance(glb[b.id], bool):
                vals = needs[p].values or []
                if glb[b.id] not in vals:
                    needs[p].values = vals + [glb[b.id]]
                    if "compared" not in needs[p].where:
                        needs[p].where.append("compared")


def _aliases(node, params: list) -> tuple[dict, set]:
    """(local name -> the parameter it was assigned from, ids of those assignments)."""
    alias = {p: p for p in params}
    alias_defs = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            src = _root_name(n.value)
            if src in params and n.targets[0].id not in alias:
                alias[n.targets[0].id] = src
                alias_defs.add(id(n))
    return alias, alias_defs


def _unpack_roles(node, alias: dict, needs: dict) -> None:
    """``a, b, c = x.shape``: the rank and the axes' roles of the parameter ``x`` stands for."""
    for n in ast.walk(node):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Tuple) \
                and isinstance(n.value, ast.Attribute) and n.value.attr == "shape":
            p = alias.get(_root_name(n.value.value) or "")
            elts = n.targets[0].elts
            if p and not any(isinstance(e, ast.Starred) for e in elts) and "unpack" not in needs[p].where:
                roles = _roles_before_rebinding(node, _root_name(n.value.value), n.lineno,
                                                [axis_role(e.id) if isinstance(e, ast.Name) else None for e in elts])
                if roles is None:
                    continue
                needs[p].roles = roles
                needs[p].where.append("unpack")


def _roles_before_rebinding(node, name: str, line: int, roles: list) -> list | None:
    """The roles the value of ``name`` had when the forward began, from its roles at ``line``: the
    same unless rebound before it; through the inverse of its one top-level ``permute`` rebinding;
    None (unknown) for any other rebinding."""
    perm = None
    for n in node.body:
        if not (isinstance(n, ast.Assign) and n.lineno < line
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)):
            continue
        v = n.value
        if _root_name(v) == name and not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
                                          and v.func.attr == "permute"):
            continue  # ``x = x.to(dtype)``: the same axes
        if perm is None and isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) \
                and v.func.attr == "permute" and _root_name(v.func.value) == name:
            dims = [a.value for a in v.args if isinstance(a, ast.Constant) and isinstance(a.value, int)]
            if len(dims) == len(v.args) == len(roles) and sorted(dims) == list(range(len(roles))):
                perm = dims
                continue
        return None
    if perm is None:
        return roles
    out = [None] * len(roles)
    for new_axis, old_axis in enumerate(perm):  # the permuted value's axis i is the original's perm[i]
        out[old_axis] = roles[new_axis]
    return out


def _none_defaults(node) -> set:
    """(assignment id, name) of ``if x is None: x = ...``: a default for a missing input, not a
    rebinding of a given one."""
    out = set()
    for n in ast.walk(node):
        t = n.test if isinstance(n, ast.If) else None
        if isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and len(t.ops) == 1 \
                and isinstance(t.ops[0], ast.Is) and isinstance(t.comparators[0], ast.Constant) \
                and t.comparators[0].value is None:
            for b in n.body:
                if isinstance(b, ast.Assign) and any(isinstance(x, ast.Name) and x.id == t.left.id for x in b.targets):
                    out.add((id(b), t.left.id))
    return out


def _first_rebound(node, alias_defs: set) -> dict[str, int]:
    """Where each name is first rebound: a call after that statement sees another value."""
    rebound: dict[str, int] = {}
    defaults = _none_defaults(node)
    for n in ast.walk(node):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and id(n) not in alias_defs:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name) and (id(n), x.id) not in defaults:
                        rebound[x.id] = min(rebound.get(x.id, 10 ** 9), n.end_lineno or n.lineno)
    return rebound


def _first_module_needs(model: nn.Module, node, alias: dict, rebound: dict, needs: dict, depth: int) -> None:
    """Merge into ``needs`` what the first ``self.<module>(...)`` call taking each parameter asks."""
    calls = sorted((c for c in ast.walk(node) if isinstance(c, ast.Call)),
                   key=lambda c: (c.lineno, c.col_offset))
    consumed: set[str] = set()
    for c in calls:
        mod = _self_module(model, c.func)
        if mod is None:
            continue
        args = [(i, a) for i, a in enumerate(c.args)] + [(k.arg, k.value) for k in c.keywords if k.arg]
        for pos, a in args:
            name = _root_name(a) or ""
            p = alias.get(name)
            if not p or p in consumed or c.lineno > rebound.get(name, 10 ** 9):
                continue
            consumed.add(p)
            got = module_need(mod, pos, depth)
            mine = needs[p]
            mine.last = mine.last or got.last
            mine.vocab = mine.vocab or got.vocab
            if got.conv_dims:
                mine.channels, mine.conv_dims, mine.stride = got.channels, got.conv_dims, got.stride
                if not mine.roles:
                    mine.roles = got.roles
            elif got.roles and not mine.roles:
                mine.roles = got.roles
            mine.where += [f"self.{ast.unparse(c.func)[5:]}"] + got.where


def per_module_list(model: nn.Module, name: str) -> tuple[int, "Need"] | None:
    """(count, need of one element) when the forward feeds each element of ``name`` to
    ``self.<list>[i](x)`` in ``for i, x in enumerate(name)``: one tensor per module of that ModuleList."""
    _, node = _source_tree(type(model).forward)
    if node is None:
        return None
    for n in ast.walk(node):
        if not (isinstance(n, ast.For) and isinstance(n.iter, ast.Call) and isinstance(n.iter.func, ast.Name)
                and n.iter.func.id == "enumerate" and n.iter.args and isinstance(n.iter.args[0], ast.Name)
                and n.iter.args[0].id == name and isinstance(n.target, ast.Tuple) and len(n.target.elts) == 2
                and all(isinstance(e, ast.Name) for e in n.target.elts)):
            continue
        index, item = (e.id for e in n.target.elts)
        for c in (c for b in n.body for c in ast.walk(b)):
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript) and isinstance(c.func.slice, ast.Name) \
                    and c.func.slice.id == index and c.args and _root_name(c.args[0]) == item:
                mods = _self_module(model, c.func.value)
                if isinstance(mods, nn.ModuleList) and len(mods):
                    return len(mods), module_need(mods[0], 0)
    return None


def structured(annotation, grid: "Grid", make_tensor):
    """A value for a parameter annotated as a structure of ints/tensors (``list[tuple[int, int, int]]``:
    a token grid per sample; ``list[torch.Tensor]``: a tensor per sample; ``tuple[int, ...]``), or None."""
    text = annotation_text(annotation)
    if not text:
        return None
    text = re.sub(r"\|None$|^Optional\[(.*)\]$", r"\1", text)
    g = grid.token_grid()

    def build(t: str):
        if t.startswith("list[") and t.endswith("]"):
            inner = build(_first_alternative(t[5:-1]))
            if isinstance(inner, torch.Tensor) and inner.ndim > 1 and inner.shape[0] == 1:
                inner = inner[0]  # one tensor per sample: without the batch axis
            return None if inner is None else [inner]
        if t.startswith("tuple[int,int,int]"):
            return g
        if t.startswith("tuple[int,int]"):
            return g[1:]
        if t in ("torch.Tensor", "Tensor"):
            return make_tensor()
        if t == "int":
            return g[0]
        return None

    if text.startswith(("list[", "tuple[int")):
        return build(text)
    return None


def _first_alternative(t: str) -> str:
    """``torch.Tensor`` of ``torch.Tensor,list[list[torch.Tensor]]`` (a list of either: the first)."""
    depth = 0
    for i, ch in enumerate(t):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0 and not t.startswith("tuple["):
            return t[:i]
    return t


def annotation_text(ann) -> str:
    """An annotation as text without spaces or ``typing.``, ``List[``/``Tuple[`` lower-cased ("" for none)."""
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", None) if isinstance(ann, type) else str(ann)
    return (text or "").replace("typing.", "").replace("List[", "list[").replace("Tuple[", "tuple[").replace(" ", "")


def _model_config(model) -> dict:
    cfg = getattr(model, "config", None)
    try:
        return {k: v for k, v in dict(cfg).items() if isinstance(v, int) and not isinstance(v, bool)} if cfg else {}
    except (TypeError, ValueError):
        return {}


def _size_term(term: str, cfg: dict):
    """One term of a documented axis: an int literal, a config entry's value, or the text/image
    token count its name says (``text_seq_len``, ``image_seq_len``); None when it says nothing."""
    term = term.strip().strip("`")
    term = term[len("self.config."):] if term.startswith("self.config.") else term
    if term.isdigit():
        return int(term)
    if term in cfg and cfg[term] > 0:
        return cfg[term]
    low = term.lower()
    if axis_role(term) == "frames":
        return "frames"
    if axis_role(term) == "tokens":
        if any(w in low for w in ("text", "txt", "caption", "prompt", "encoder", "context")):
            return "text"
        if any(w in low for w in ("image", "img", "latent", "visual", "video")):
            return "image"
    return None


def doc_sizes(fn, params, cfg: dict) -> dict[str, list]:
    """Per parameter, the sizes its documented shape names: config entries' values, int literals, and
    sums of text/image token counts (``text_seq_len + image_seq_len``); None for other axes."""
    out = {}
    for name, dims in doc_shapes(fn):
        if name not in params or "..." in dims:
            continue
        sizes = []
        for part in (p.strip() for p in dims.split(",") if p.strip()):
            terms = [_size_term(t, cfg) for t in part.split("+")]
            if len(terms) == 1 and isinstance(terms[0], int):
                sizes.append(terms[0])
            elif all(t is not None for t in terms):  # a sum, or one named count (text/image tokens, frames)
                sizes.append(terms)
            else:
                sizes.append(None)
        if any(x is not None for x in sizes):
            out[name] = sizes
    return out


def _apply_sizes(shape: list, need: "Need", grid: "Grid", hidden: bool) -> None:
    """Axes whose size the docstring names (``doc_sizes``) take it (never the batch axis)."""
    if not need.sizes or len(need.sizes) != len(shape):
        return
    for i, size in enumerate(need.sizes):
        if i == 0 and need.roles and need.roles[0] == "batch":
            continue
        if isinstance(size, int):
            shape[i] = size
        elif isinstance(size, list):
            shape[i] = sum(t if isinstance(t, int) else grid.text if t == "text" else grid.frames if t == "frames"
                           else grid.tokens(5 if grid.frames > 1 else 4) for t in size)


# --- tensors from needs ------------------------------------------------------------------------

@dataclass
class Grid:
    frames: int = 2
    height: int = 8
    width: int = 8
    text: int = TEXT_LEN
    channels: int = 4
    patch: int = 2
    patch_t: int = 1
    n_axes: int = 3  # rotary position axes (the length of a config's axes tuple)

    def resize(self, axis: str, value: int) -> None:
        """Set one axis of the grid (``text``, ``frames``, ...) in place."""
        setattr(self, axis, value)

    def token_grid(self) -> tuple[int, int, int]:
        """The (frames, height, width) grid of tokens after patchifying."""
        return max(1, self.frames // self.patch_t), self.height // self.patch, self.width // self.patch

    def tokens(self, rank: int = 4) -> int:
        t = (self.height // self.patch) * (self.width // self.patch)
        return t * max(1, self.frames // self.patch_t) if rank == 5 else t


def _tag_tensor(need: Need, grid: Grid, hidden: bool) -> torch.Tensor:
    """Tags: the sequence split into one run per constant the code compares it with, in the order
    the code names them."""
    length = grid.tokens() if hidden else grid.text
    shape = [1 if r == "batch" or i == 0 else length for i, r in enumerate(need.roles or ("batch", "tokens"))]
    flat = torch.tensor([need.values[min(i * len(need.values) // shape[-1], len(need.values) - 1)]
                         for i in range(shape[-1])], dtype=torch.long)
    return flat.expand(tuple(shape)).clone()


def _vocab_indices(low: str, need: Need, grid: Grid, gen: torch.Generator) -> torch.Tensor:
    """Indices into an embedding table of ``need.vocab`` rows for the input named ``low``."""
    rank = len(need.roles) if need.roles else 2
    shape = (1, grid.text) if rank >= 2 else (grid.text,)
    if not need.roles and not low.endswith(("s", "ids", "tokens")):
        shape = (1,)  # a singular name (``style``, ``label``): one index per sample, like a class label
    return torch.randint(0, min(need.vocab, 16), shape, generator=gen)


def tensor_for(name: str, need: Need, grid: Grid, gen: torch.Generator, hidden: bool = False,
               like: torch.Tensor | None = None):
    """A tensor for parameter ``name`` that meets ``need`` (None when the need says nothing)."""
    low = name.lower()
    if need.values and all(isinstance(r, str) or r is None for r in need.roles or ()):
        return _tag_tensor(need, grid, hidden)
    if need.vocab:
        return _vocab_indices(low, need, grid, gen)
    roles = list(need.roles) if need.roles else None
    if need.conv_dims and (not roles or len(roles) < need.conv_dims + 2 and "channels" not in roles):
        roles = ["batch", "channels"] + ["frames", "height", "width"][3 - need.conv_dims:]
    if need.conv_dims and len(roles) == need.conv_dims + 2 and "channels" not in roles:
        roles[0], roles[1] = "batch", "channels"  # a ConvNd takes it: axis 1 is its channels
    if roles:
        shape = []
        for i, r in enumerate(roles):
            if isinstance(r, int) and not isinstance(r, bool):
                shape.append(r)  # a size the docstring gives from the config
            elif r == "batch" or (i == 0 and r is None):
                shape.append(1)
            elif r == "channels":
                shape.append(need.channels or grid.channels)
            elif r in ("patch", "patch_t"):  # (.., tokens, channels, pt, ph, pw): one patch's pixels
                shape.append(grid.patch if r == "patch" else grid.patch_t)
            elif r in ("frames", "height", "width"):
                shape.append(getattr(grid, r))
            elif r is None and i == len(roles) - 1 and (low.endswith("ids") or "position" in low):
                shape.append(grid.n_axes)  # position ids: one coordinate per rotary axis
            elif r is None and i == 1 and len(roles) >= 4:
                shape.append(need.channels or grid.channels)  # (batch, ?, ..., height, width): channels
            elif r == "tokens" or r is None and i == 1:
                shape.append(grid.tokens(5 if grid.frames > 1 and hidden else 4) if hidden else grid.text)
            elif r == "dim" or i == len(roles) - 1:
                shape.append(need.last or (like.shape[-1] if like is not None else grid.channels))
            else:
                shape.append(2)
        _apply_sizes(shape, need, grid, hidden)
        if low.endswith("ids") or "position" in low or "indices" in low:
            return torch.zeros(tuple(shape), dtype=torch.long)
        if need.last and shape[-1] != need.last and roles[-1] not in ("width", "height"):
            shape[-1] = need.last
        return torch.randn(tuple(shape), generator=gen)
    if need.last:
        if any(w in low for w in ("pooled", "global", "proj_emb", "pool")):
            return torch.randn((1, need.last), generator=gen)
        return torch.randn((1, grid.tokens() if hidden else grid.text, need.last), generator=gen)
    return None


_SIZE_WORDS = {"len", "length", "dim", "dims", "channels", "size", "width"}


def suffix_sizes_fit(name: str, val, cfg: dict, gen: torch.Generator | None = None):
    """A second text input told apart by a suffix (``encoder_hidden_states_t5``) whose length and
    width the config gives under the same suffix (``text_len_t5``, ``cross_attention_dim_t5``):
    ``val`` (a [batch, tokens, width] tensor) remade with those sizes; ``val`` itself otherwise."""
    suffix = name.lower().rsplit("_", 1)[-1]
    if isinstance(val, torch.Tensor) and val.ndim == 2 and not val.is_floating_point() and "_" in name:
        # its mask (``text_embedding_mask_t5``): the length only
        grown = suffix_sizes_fit(name, torch.zeros(val.shape[0], val.shape[1], 1), cfg)
        return torch.ones(val.shape[0], grown.shape[1], dtype=val.dtype) if grown.shape[1] != val.shape[1] else val
    if not isinstance(val, torch.Tensor) or val.ndim != 3 or not val.is_floating_point() or "_" not in name \
            or suffix in _SIZE_WORDS or suffix in ("states", "embeds", "hidden", "emb", "ids", "mask") \
            or suffix.isdigit():
        return val
    length = width = None
    for k, v in cfg.items():
        parts = k.lower().split("_")
        if len(parts) < 2 or parts[-1] != suffix or not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            continue
        if any(w in parts for w in ("len", "length")):
            length = v
        elif any(w in parts for w in ("dim", "channels", "width")):
            width = v
    if length is None and width is None:
        return val
    shape = (val.shape[0], length or val.shape[1], width or val.shape[2])
    return torch.randn(shape, generator=gen) if shape != tuple(val.shape) else val


_STATE_WORDS = ("cache", "past_key_values")


def _pipeline_calls() -> dict[str, list[set]]:
    """Per transformer class name a diffusers pipeline's ``__init__`` annotates
    (``transformer: SomeTransformer``): the keyword sets of every ``self.transformer(...)`` call
    in that pipeline's code. Read once from the installed diffusers' pipeline sources (AST)."""
    global _KEYWORDS_BY_CLASS
    if _KEYWORDS_BY_CLASS is None:
        import diffusers.pipelines as pipes

        out: dict[str, list[set]] = {}
        for _, tree in _pipeline_sources("self.transformer(", [("diffusers.pipelines", pipes.__path__[0])]):
            for name, calls in pipeline_calls_in(tree).items():
                out.setdefault(name, []).extend(calls)
        _KEYWORDS_BY_CLASS = out
    return _KEYWORDS_BY_CLASS


def pipeline_calls_in(tree) -> dict[str, list[set]]:
    """``{annotated transformer class name: [keywords of each self.transformer(...) call]}`` for
    the pipeline classes of one module's AST."""
    out: dict[str, list[set]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        names = [ast.unparse(a.annotation).split(".")[-1] for a in (init.args.args if init else [])
                 if a.arg == "transformer" and a.annotation is not None]
        calls = [{k.arg for k in c.keywords if k.arg} for c in ast.walk(cls) if isinstance(c, ast.Call)
                 and isinstance(c.func, ast.Attribute) and c.func.attr == "transformer"
                 and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"]
        for name in names:
            out.setdefault(name, []).extend(calls)
    return out


# class name -> keyword sets of its pipelines' calls (``_pipeline_calls``); None until read
_KEYWORDS_BY_CLASS: dict | None = None


def pipeline_state_inputs(cls: type) -> list[str]:
    """The kv-cache keywords every call of a ``cls`` transformer in diffusers' pipelines passes
    (running-pipeline state); empty when some call passes none or no pipeline annotates the class."""
    calls = _pipeline_calls().get(cls.__name__, [])
    if not calls:
        return []
    state = [{k for k in c if any(w in k.lower() for w in _STATE_WORDS)} for c in calls]
    if not all(state):
        return []
    return sorted(set().union(*state))


# --- inputs as diffusers' own pipelines build them --------------------------------------------------

# class -> (module, function node) of its pipelines' calling functions (``pipeline_calls``)
_FUNCTIONS_BY_CLASS: dict = {}


def pipeline_calls(cls: type) -> list[tuple]:
    """(module, function node) of every function of a diffusers pipeline class whose ``__init__``
    annotates ``transformer: <cls>`` and that calls ``self.transformer(...)``: found from the
    pipelines' source (AST), cached per class."""
    if cls in _FUNCTIONS_BY_CLASS:
        return _FUNCTIONS_BY_CLASS[cls]
    import importlib

    out = []
    for module, tree in _pipeline_sources(f"transformer: {cls.__name__}", _pipeline_roots()):
        for c in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            init = next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None or not any(a.arg == "transformer" and a.annotation is not None
                                       and ast.unparse(a.annotation).split("|")[0].strip() == cls.__name__
                                       for a in init.args.args):
                continue
            out += [(module, f) for f in c.body if isinstance(f, ast.FunctionDef)
                    and any(_is_self_transformer(n.func) for n in ast.walk(f) if isinstance(n, ast.Call))]
    _FUNCTIONS_BY_CLASS[cls] = out
    importlib.invalidate_caches()
    return out


def _pipeline_roots() -> list[tuple[str, str]]:
    """(package name, its folder) of the pipelines to read: diffusers'."""
    try:
        import diffusers.pipelines as pkg
    except Exception:  # noqa: BLE001 - no pipelines: nothing to read
        return []
    import os

    return [("diffusers.pipelines", os.path.dirname(pkg.__file__))]


def _pipeline_sources(needle: str, roots):
    """(module name, AST) of each source file under ``roots`` (package name, folder) holding ``needle``."""
    import pathlib

    for prefix, root in roots:
        root = pathlib.Path(root)
        for path in root.rglob("*.py"):
            try:
                text = path.read_text()
                if needle not in text:
                    continue
                tree = ast.parse(text)
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue
            yield prefix + "." + ".".join(path.relative_to(root).with_suffix("").parts), tree


def _is_self_transformer(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "transformer" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


class _Unresolved(Exception):
    pass


def pipeline_value(model, name: str, fill=None):
    """The value diffusers' own pipeline passes as ``name`` to ``self.transformer(...)`` when it builds
    it with one call of constants and transformer attributes the probe can evaluate (an argument from
    the running state takes its default, or ``fill(param_name, annotation)``); None otherwise."""
    import importlib

    for module, func in pipeline_calls(type(model)):
        for call in (n for n in ast.walk(func) if isinstance(n, ast.Call) and _is_self_transformer(n.func)):
            kw = next((k for k in call.keywords if k.arg == name and isinstance(k.value, ast.Name)), None)
            if kw is None:
                continue
            assigns = [n for n in ast.walk(func) if isinstance(n, ast.Assign) and len(n.targets) == 1
                       and isinstance(n.targets[0], ast.Name) and n.targets[0].id == kw.value.id
                       and isinstance(n.value, ast.Call) and n.lineno < call.lineno]
            for a in sorted(assigns, key=lambda n: -n.lineno)[:1]:
                try:
                    mod = importlib.import_module(module)
                    return _evaluate_call(a.value, model, vars(mod), fill)
                except Exception:  # noqa: BLE001 - not evaluable here: the other rules decide
                    continue
    return None


def _evaluate_call(node: ast.Call, model, scope: dict, fill):
    fn = _pipeline_expr(node.func, model, scope)
    params = inspect.signature(fn).parameters
    args = [_pipeline_expr(a, model, scope) for a in node.args]
    kwargs = {}
    for k in node.keywords:
        try:
            kwargs[k.arg] = _pipeline_expr(k.value, model, scope)
        except _Unresolved:
            p = params.get(k.arg)
            if p is None or p.default is not inspect.Parameter.empty:
                continue  # the callee's default stands in for the pipeline's running state
            value = fill(k.arg, p.annotation) if fill else None
            if value is None:
                raise
            kwargs[k.arg] = value
    with torch.no_grad():
        return fn(*args, **kwargs)


def _pipeline_expr(node, model, scope: dict):
    """Constants, ``self.transformer[.attr...]``, module-level names, ``float(x)``/``int(x)``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "self" and chain and chain[-1] == "transformer":
            obj = model
            for attr in reversed(chain[:-1]):
                obj = getattr(obj, attr)
            return obj
        raise _Unresolved(ast.unparse(node))
    if isinstance(node, ast.Name) and node.id in scope and callable(scope[node.id]):
        return scope[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "float") \
            and len(node.args) == 1:
        return {"int": int, "float": float}[node.func.id](_pipeline_expr(node.args[0], model, scope))
    raise _Unresolved(ast.unparse(node))


