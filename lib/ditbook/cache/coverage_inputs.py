"""Inputs for a model's forward found from its code, for the coverage probe (issue 13).

Three generic mechanisms, no class names:

* **data flow** (``forward_needs``): the forward's source (AST) tells, per parameter, what the
  code does with it first: which submodule it is passed to (``self.x_embedder(hidden_states)``:
  a ``Linear`` fixes the last dim, a ``ConvNd`` the rank, channel count and a spatial multiple,
  an ``Embedding`` makes it long indices below the vocabulary size; any other module is followed
  into its own forward), how its ``.shape`` is unpacked (``b, f, c, h, w = x.shape``: the rank
  and which axis is channels/frames/height/width), and the shape its docstring documents;
* **tensors from needs** (``tensor_for``): a tensor built to those needs on one coherent latent
  grid (frames x height x width), text of a fixed length;
* **error-directed repair** (``repair``): when the forward raises, the traceback says what to
  change: a forward parameter that is ``None`` where the code uses it (a local of the failing
  frame, or the parameter a ``missing required argument`` error names) is supplied; a matrix
  product ``(AxB and CxD)`` whose left side is an input with last dim ``B`` gets last dim ``C``;
  an index tensor that is not an integer tensor becomes one; a tensor unpacked into more or fewer
  names than its rank gets that rank (with the axes its target names say); inputs that the
  condition setting an unset local tests are supplied; an int grid whose elements index tables
  becomes per-axis position ranges; a view's rows are filled; a concatenated input takes the
  other operand's size, or (the noisy input with another) the output's width and the rest; a
  reshape of an input that a Linear/norm/conv rejects resizes the input; an int input that sizes
  a table takes the like-named tensor's size; a shape the message states (``expected to have
  resolution (64, 64)``, ``seq_len=8`` for documented ``(seq_len,)`` inputs) is applied; an input
  unpacked into pairs becomes a list of pairs; tensors inside list/tuple inputs get the same
  repairs;
* **docstring sizes** (``doc_sizes``): axes a documented shape names after config entries
  (``num_text_layers``), int literals, sums (``text_seq_len + image_seq_len``, ``T + 1``);
* **pipelines** (``pipeline_value``): an input diffusers' own pipeline builds with one call the
  probe can evaluate (found from the pipelines' AST) is built that way.

Also read from the code: unpacked axes through a ``permute``, documented dims written with
config entries, lists fed element-wise to a ModuleList, tags compared with module constants,
second text inputs sized by config entries with their suffix (``text_len_t5``).
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap
import traceback
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
        need.conv_dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(mod)] if type(mod) in (
            nn.Conv1d, nn.Conv2d, nn.Conv3d) else len(mod.kernel_size)
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
    """The roles of the value ``name`` held when the forward began, from the roles of the value
    it holds at ``line``: the same when it is not rebound before; through the inverse of
    ``name = name.permute(...)`` when that is its only rebinding before; None (unknown) when
    another statement rebinds it first. Only the forward's top-level statements count (a
    rebinding under a condition is one input layout among several)."""
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
    """(count, need of one element) when the forward iterates the parameter ``name`` as
    ``for i, x in enumerate(name)`` and feeds each element to ``self.<list>[i](x)``: a list of one
    tensor per module of that ModuleList."""
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
    """A value for a parameter annotated as a structure of ints/tensors (``list[tuple[int, int,
    int]]``: one (frames, height, width) token grid per sample; ``list[torch.Tensor]``: one
    tensor per sample; ``tuple[int, int, int]``: the grid; ``list[int]``: the frame count),
    or None."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) \
        if isinstance(annotation, type) else str(annotation)
    if not text:
        return None
    text = text.replace("typing.", "").replace("List[", "list[").replace("Tuple[", "tuple[").replace(" ", "")
    text = re.sub(r"\|None$|^Optional\[(.*)\]$", r"\1", text)
    g = (max(1, grid.frames // grid.patch_t), grid.height // grid.patch, grid.width // grid.patch)

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
    """Per parameter, the sizes its documented shape names: ``(batch_size, text_seq_len,
    num_text_layers, text_hidden_dim)`` with ``num_text_layers``/``text_hidden_dim`` config
    entries gives their values; ``(text_seq_len + image_seq_len, 3)`` gives the sum of the text
    and image token counts, then 3. Axes it says nothing about are None."""
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
            elif r == "frames":
                shape.append(grid.frames)
            elif r == "height":
                shape.append(grid.height)
            elif r == "width":
                shape.append(grid.width)
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
    global _PIPELINE_CALLS
    if _PIPELINE_CALLS is not None:
        return _PIPELINE_CALLS
    import pathlib

    import diffusers.pipelines as pipes

    out: dict[str, list[set]] = {}
    for path in pathlib.Path(pipes.__path__[0]).rglob("*.py"):
        try:
            text = path.read_text()
            if "self.transformer(" not in text:
                continue
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for name, calls in pipeline_calls_in(tree).items():
            out.setdefault(name, []).extend(calls)
    _PIPELINE_CALLS = out
    return out


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


_PIPELINE_CALLS: dict | None = None


def pipeline_state_inputs(cls: type) -> list[str]:
    """The keywords naming running-pipeline state (kv caches) that every call of a transformer of
    class ``cls`` in diffusers' pipelines passes; empty when some call passes none, or no
    pipeline annotates the class."""
    calls = _pipeline_calls().get(cls.__name__, [])
    if not calls:
        return []
    state = [{k for k in c if any(w in k.lower() for w in _STATE_WORDS)} for c in calls]
    if not all(state):
        return []
    return sorted(set().union(*state))


# --- error-directed repair ---------------------------------------------------------------------

_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")
_MISSING = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)")
_SIZE = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton "
                   r"dimension (\d+)")
_UNPACK = re.compile(r"(?:not enough|too many) values to unpack \(expected (\d+)")


def statement_text(frame) -> str:
    """The whole statement a frame is executing (a call spread over several lines included)."""
    try:
        lines, start = inspect.getsourcelines(frame.f_code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        try:
            return (inspect.getframeinfo(frame).code_context or [""])[0]
        except Exception:
            return ""
    line = frame.f_lineno - max(start, 1) + 1
    best = None
    for n in ast.walk(tree):
        if isinstance(n, ast.stmt) and not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                             ast.If, ast.For, ast.While, ast.With, ast.Try)) \
                and n.lineno <= line <= (n.end_lineno or n.lineno):
            if best is None or (n.end_lineno - n.lineno) < (best.end_lineno - best.lineno):
                best = n
    return ast.unparse(best) if best is not None else ""


def _model_frames(exc: BaseException):
    return [f for f, _ in traceback.walk_tb(exc.__traceback__)]


def _none_params(exc: BaseException, params: set[str], kwargs: dict) -> list[str]:
    """Forward parameters that are None in a frame of the failing call, innermost first, and
    that the failing line reads."""
    out = []
    for frame in reversed(_model_frames(exc)):
        text = statement_text(frame)
        for name, val in frame.f_locals.items():
            if val is None and name in params and kwargs.get(name) is None and name not in out \
                    and re.search(rf"\b{re.escape(name)}\b", text):
                out.append(name)
    if not out and not _own_none(exc):
        # the None reached a helper: any parameter the model frames hold as None and we gave none
        for frame in _model_frames(exc):
            for name, val in frame.f_locals.items():
                if val is None and name in params and kwargs.get(name) is None and name not in out:
                    out.append(name)
    return out


def _own_none(exc: BaseException) -> str | None:
    """``self.config.x`` (or another ``self.`` attribute) that the failing statement reads and
    that is None: the None is the model's own (a setting its defaults leave unset), not a
    missing input. Its text, or None."""
    for frame in reversed(_model_frames(exc)):
        owner = frame.f_locals.get("self")
        if owner is None:
            continue
        try:
            tree = ast.parse(statement_text(frame))
        except SyntaxError:
            return None
        for n in ast.walk(tree):
            chain, x = [], n
            while isinstance(x, ast.Attribute):
                chain.append(x.attr)
                x = x.value
            if not (chain and isinstance(x, ast.Name) and x.id == "self"):
                continue
            obj = owner
            try:
                for part in reversed(chain):
                    obj = getattr(obj, part)
            except Exception:
                continue
            if obj is None:
                return ast.unparse(n)
        return None
    return None


def _failing_locals(exc: BaseException) -> list[tuple[str, object]]:
    out = []
    for frame in reversed(_model_frames(exc)):
        out += list(frame.f_locals.items())
    return out


def never_supplied(name: str) -> bool:
    """Parameters the probe never makes up: option dicts, caches, control residuals, flags."""
    low = name.lower()
    return any(w in low for w in ("kwargs", "cache", "controlnet", "return_dict", "block_samples")) \
        or low.startswith(("return", "use_", "enable_", "is_"))


def repair(exc: BaseException, kwargs: dict, make, forbid: set) -> tuple[dict, str] | None:
    """New keyword inputs that address ``exc`` (or None when the error says nothing usable).
    ``make(name, kwargs)`` builds a value for a parameter; ``forbid`` holds (name, fix) already
    tried, so a repair is never repeated."""
    msg = str(exc)
    params = set(kwargs) | set(getattr(make, "params", ()))
    for rule in _REPAIRS:
        fixed = rule(exc, msg, kwargs, make, forbid, params)
        if fixed is not None:
            return fixed
    return None


def _supply_missing(exc, msg, kwargs, make, forbid, params):
    """``missing required argument(s) 'a', 'b'``: supply them."""
    m = _MISSING.search(msg)
    if m:
        names = re.findall(r"'(\w+)'", m.group(1))
        new = dict(kwargs)
        for n in names:
            if ("supply", n) not in forbid:
                forbid.add(("supply", n))
                new[n] = make(n, new)
        if new != kwargs:
            return new, f"supplied {names}"
    return None


def _matmul_last_dim(exc, msg, kwargs, make, forbid, params):
    """A matrix product ``(AxB and CxD)`` whose left side is an input with last dim B: make it C."""
    m = _MATMUL.search(msg)
    if m:
        a, b, c, _ = (int(x) for x in m.groups())
        for name, val in list(kwargs.items()):
            if isinstance(val, torch.Tensor) and val.is_floating_point() and val.ndim >= 2 and val.shape[-1] == b \
                    and val.numel() // b == a and (name, "last", c) not in forbid:
                forbid.add((name, "last", c))
                new = dict(kwargs)
                new[name] = torch.randn(tuple(val.shape[:-1]) + (c,))
                return new, f"{name}: last dim {b} -> {c}"
    return None


def _supply_none(exc, msg, kwargs, make, forbid, params):
    """A forward parameter that is None where the failing code uses it: supply it."""
    if ("NoneType" in msg or "None" in msg) and "not callable" not in msg and "must be a mapping" not in msg:
        for n in _none_params(exc, params, kwargs):
            if ("supply", n) in forbid or never_supplied(n):
                continue
            forbid.add(("supply", n))
            val = make(n, kwargs)
            if val is not None:
                new = dict(kwargs)
                new[n] = val
                return new, f"supplied {n}"
    return None


def _boolean_mask(exc, msg, kwargs, make, forbid, params):
    """``where`` wants a boolean condition: the mask input the failing frame holds becomes one."""
    if "where expected condition to be a boolean" in msg:
        for name, val in kwargs.items():
            if isinstance(val, torch.Tensor) and val.dtype != torch.bool and "mask" in name.lower() \
                    and (name, "bool") not in forbid \
                    and any(v is val for _, v in _failing_locals(exc)):
                forbid.add((name, "bool"))
                new = dict(kwargs)
                new[name] = val != 0
                return new, f"{name}: a boolean mask"
    return None


def _supply_named(exc, msg, kwargs, make, forbid, params):
    """The error message names a forward parameter: supply it when missing."""
    for n in re.findall(r"[`'\"](\w+)[`'\"]", msg):
        if n in params and kwargs.get(n) is None and ("supply", n) not in forbid and not never_supplied(n):
            forbid.add(("supply", n))
            val = make(n, kwargs)
            if val is not None:
                new = dict(kwargs)
                new[n] = val
                return new, f"supplied {n} (named by the error)"
    return None


def _integer_indices(exc, msg, kwargs, make, forbid, params):
    """Indices must be integers: the float input the failing frame holds becomes long zeros."""
    low_msg = msg.lower()
    if "indices" in low_msg and ("long" in low_msg or "int" in low_msg):
        for name, val in kwargs.items():
            if isinstance(val, torch.Tensor) and val.is_floating_point() and (name, "long") not in forbid:
                if any(v is val for _, v in _failing_locals(exc)):
                    return _as_long_zeros(kwargs, name, forbid, f"{name}: integer indices")
    return None


def _as_long_zeros(kwargs: dict, name: str, forbid: set, note: str) -> tuple[dict, str]:
    """``kwargs`` with input ``name`` made long zeros of its shape (once per input: ``forbid``)."""
    forbid.add((name, "long"))
    new = dict(kwargs)
    new[name] = torch.zeros(kwargs[name].shape, dtype=torch.long)
    return new, note


def _like_concatenated(exc, msg, kwargs, make, forbid, params):
    """A concatenation of an input with another: make the one we made up like the other."""
    if "Sizes of tensors must match" in msg or "same number of dimensions" in msg:
        for frame in reversed(_model_frames(exc)):
            try:
                text = (inspect.getframeinfo(frame).code_context or [""])[0]
            except Exception:
                text = ""
            if "cat(" not in text and "stack(" not in text:
                continue
            present = [(n, v) for n, v in kwargs.items() if isinstance(v, torch.Tensor) and any(
                v is lv for ln, lv in frame.f_locals.items() if re.search(rf"\b{re.escape(ln)}\b", text))]
            first = getattr(make, "first", None)
            for name, val in sorted(present, key=lambda nv: nv[0] == first):
                others = [v for n, v in present if n != name]
                if name != first and others and (name, "like") not in forbid:
                    forbid.add((name, "like"))
                    new = dict(kwargs)
                    new[name] = torch.randn(others[0].shape).to(val.dtype)
                    return new, f"{name}: shaped like the tensor it is concatenated with"
            break
    return None


def _size_mismatch(exc, msg, kwargs, make, forbid, params):
    """Sizes ``a`` and ``b`` differ at dim ``d``: the input the failing frame holds takes the other.
    An input of lower rank than the broadcast (the largest rank the frame holds) takes part in it
    right-aligned: its own dim is ``d`` less the ranks it lacks (a ``(B, S)`` mask against
    ``(B, H, S, S)`` scores)."""
    m = _SIZE.search(msg)
    if m:
        a, b, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
        held = [lv for _, lv in _failing_locals(exc) if isinstance(lv, torch.Tensor)]
        rank = max([t.ndim for t in held], default=0)
        seen_ids = set()
        for lv in held:
            if id(lv) in seen_ids:
                continue
            seen_ids.add(id(lv))
            for name, val in kwargs.items():
                k = d if val is lv and val.ndim > d else d - (rank - val.ndim) if val is lv and rank > d else -1
                if k >= 0 and val.shape[k] in (a, b) and (name, "dim", d) not in forbid:
                    forbid.add((name, "dim", d))
                    shape = list(val.shape)
                    shape[k] = b if shape[k] == a else a
                    new = dict(kwargs)
                    new[name] = torch.randn(shape).to(val.dtype) if val.is_floating_point() else \
                        torch.zeros(shape, dtype=val.dtype)
                    return new, f"{name}: dim {k} {val.shape[k]} -> {shape[k]}"
    return None


_MASKED = re.compile(r"value tensor of shape \[([\d, ]*)\] cannot be broadcast to indexing result of shape "
                     r"\[([\d, ]+)\]")


def _masked_count(exc, msg, kwargs, make, forbid, params):
    """A masked assignment ``x[:, mask] = v`` whose boolean mask selects another number of rows
    than ``v`` has: the boolean input the frame's mask expands from (``k`` selected positions per
    True: the ratio of their True counts) keeps its length and is True at its last ``rows / k``
    positions (the masked slots after the others, as tokens appended after a prompt)."""
    m = _MASKED.search(msg)
    if not m:
        return None
    value = [int(x) for x in m.group(1).split(",") if x.strip()]
    result = [int(x) for x in m.group(2).split(",")]
    masks = [lv for _, lv in _failing_locals(exc) if isinstance(lv, torch.Tensor) and lv.dtype == torch.bool]
    for name, val in kwargs.items():
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or not val.any() or (name, "count") in forbid:
            continue
        have = int(val.reshape(-1, val.shape[-1])[0].sum())
        for sel in {int(mk.sum()) for mk in masks}:
            d, off = (result.index(sel) if sel in result else -1), len(result) - len(value)
            rows = value[d - off] if d >= off >= 0 and d >= 0 else 0
            k = sel // have if sel % have == 0 else 0
            if not k or not rows or rows % k or rows // k > val.shape[-1]:
                continue
            forbid.add((name, "count"))
            new = dict(kwargs)
            new[name] = torch.zeros_like(val)
            new[name][..., val.shape[-1] - rows // k:] = True
            return new, f"{name}: True at its last {rows // k} of {val.shape[-1]} positions"
    return None


def _grid_rows(val) -> list | None:
    """The per-sample lists of ``(frames, height, width)`` tuples of a ``list[list[tuple]]`` (or one
    ``list[tuple]``) input, else None."""
    def is_grid(t):
        return isinstance(t, tuple) and t and all(isinstance(x, int) and not isinstance(x, bool) for x in t)

    if isinstance(val, list) and val and all(is_grid(t) for t in val):
        return [val]
    if isinstance(val, list) and val and all(isinstance(r, list) and r and all(is_grid(t) for t in r) for r in val):
        return val
    return None


def _grid_token_count(exc, msg, kwargs, make, forbid, params):
    """The error names a grid-list input whose token count (the sum of its grids' products) is one
    number of the message and another number what the code counts elsewhere: the last grid's
    leading (frames) axis takes the difference."""
    nums = [int(x) for x in re.findall(r"\b\d+\b", msg)]
    for name, val in kwargs.items():
        rows = _grid_rows(val)
        if rows is None or not re.search(rf"\b{name}\b", msg) or (name, "tokens") in forbid:
            continue
        total = sum(math.prod(t) for t in rows[0])
        rest, last = total - math.prod(rows[0][-1]), rows[0][-1]
        for want in (n for n in nums if n != total and total in nums):
            per = math.prod(last[1:])
            if want > rest and (want - rest) % per == 0:
                forbid.add((name, "tokens"))
                grid = ((want - rest) // per,) + tuple(last[1:])
                new = dict(kwargs)
                new[name] = [r[:-1] + [grid] for r in rows] if rows is val else rows[0][:-1] + [grid]
                return new, f"{name}: last grid {last} -> {grid} ({want} tokens)"
    return None


_REPEATS = re.compile(r"repeats must have the same size as input along dim, but got repeats\.size\(0\) = (\d+) "
                      r"and input\.size\(\d+\) = (\d+)")


def _computed_from(frame, size: int, kwargs: dict) -> list[str]:
    """Inputs that a 1-D tensor of ``size`` the frame's failing statement reads is computed from
    (the names on the right of the statement in the frame's function that assigns it)."""
    try:
        used = {n.id for n in ast.walk(ast.parse(statement_text(frame).strip())) if isinstance(n, ast.Name)}
    except SyntaxError:
        return []
    _, node = _source_tree(frame.f_code)
    out = []
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in used for t in n.targets):
            lv = frame.f_locals.get(next(t.id for t in n.targets if isinstance(t, ast.Name) and t.id in used))
            if isinstance(lv, torch.Tensor) and lv.ndim == 1 and lv.shape[0] == size:
                out += [m.id for m in ast.walk(n.value) if isinstance(m, ast.Name) and m.id in kwargs
                        and m.id not in out]
    return out


def _repeats_length(exc, msg, kwargs, make, forbid, params):
    """``repeat_interleave`` with one repeat count per position of an input of another length: the
    input the counts are computed from takes that length (a boolean one keeps its last positions,
    so a mask True at its end stays so)."""
    m = _REPEATS.search(msg)
    if not m:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    for name in (n for f in reversed(_model_frames(exc)) for n in _computed_from(f, a, kwargs)):
        val = kwargs[name]
        if not isinstance(val, torch.Tensor) or val.shape[-1] != a or (name, "repeats") in forbid:
            continue
        forbid.add((name, "repeats"))
        new = dict(kwargs)
        if b <= a:
            new[name] = val[..., a - b:].clone()
        else:
            new[name] = torch.cat([torch.zeros(*val.shape[:-1], b - a, dtype=val.dtype), val], dim=-1)
        return new, f"{name}: last dim {a} -> {b} (one repeat count per position)"
    return None


def _unpack_rank(exc, msg, kwargs, make, forbid, params):
    """A tensor unpacked into more or fewer names than its rank: remake it with that rank."""
    m = _UNPACK.search(msg)
    if m:
        want = int(m.group(1))
        frames = _model_frames(exc)
        if frames:
            frame = frames[-1]
            try:
                text = (inspect.getframeinfo(frame).code_context or [""])[0]
            except Exception:
                text = ""
            sm = re.search(r"=\s*(\w+)\.(?:shape|size\(\))", text)
            if sm:
                local = frame.f_locals.get(sm.group(1))
                for name, val in kwargs.items():
                    if val is local and isinstance(val, torch.Tensor) and (name, "rank", want) not in forbid:
                        forbid.add((name, "rank", want))
                        new = dict(kwargs)
                        new[name] = make(name, kwargs, rank=want, **_unpacked_roles(make, frame, want))
                        if new[name] is not None:
                            return new, f"{name}: rank {want}"
    return None


def _unpacked_roles(make, frame, want: int) -> dict:
    """``{"roles": [...]}``: the axis roles the failing unpack's target names tell
    (``batch_size, num_frames = t.shape``: batch, frames), when ``make`` takes them."""
    try:
        if "roles" not in inspect.signature(make).parameters:
            return {}
        stmt = ast.parse(statement_text(frame)).body[0]
    except (TypeError, ValueError, SyntaxError, IndexError):
        return {}
    if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple) and len(stmt.targets[0].elts) == want:
        roles = [axis_role(e.id) if isinstance(e, ast.Name) else None for e in stmt.targets[0].elts]
        if any(r not in (None, "batch") for r in roles):
            return {"roles": roles}
    return {}


def _supply_guarded(exc, msg, kwargs, make, forbid, params):
    """A local read before it is set (``UnboundLocalError``) because the code sets it only under
    a condition on optional inputs (``if latents is not None and ids is not None: x = ...``):
    supply the forward parameters that condition tests and that are None."""
    if not isinstance(exc, UnboundLocalError):
        return None
    m = re.search(r"local variable '(\w+)'", msg)
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    local = m.group(1)
    frame = frames[-1]
    try:
        lines, _ = inspect.getsourcelines(frame.f_code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    tested: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and any(isinstance(t, ast.Name) and t.id == local
                                         for b in n.body for a in ast.walk(b) if isinstance(a, ast.Assign)
                                         for t in a.targets for t in ast.walk(t)):
            tested += [x.id for x in ast.walk(n.test) if isinstance(x, ast.Name) and x.id not in tested]
    new = dict(kwargs)
    supplied = []
    for n in tested:
        if n in params and kwargs.get(n) is None and ("supply", n) not in forbid and not never_supplied(n):
            forbid.add(("supply", n))
            val = make(n, new)
            if val is not None:
                new[n] = val
                supplied.append(n)
    return (new, f"supplied {supplied}: the condition that sets {local!r} tests them") if supplied else None


def _grid_as_positions(exc, msg, kwargs, make, forbid, params):
    """A grid of ints we made up from an annotation (``tuple[int, int, int]``) whose elements the
    failing function uses as indices (``table[pos[0]]``): read it the other way, as one range
    of positions per axis (``[arange(f), arange(h), arange(w)]``), once per made-up value."""
    frames = _model_frames(exc)
    if not frames:
        return None
    frame = frames[-1]
    try:
        lines, _ = inspect.getsourcelines(frame.f_code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    # names whose elements index something in the failing function: ``table[pos[0]]``
    indexing = {n.slice.value.id for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                and isinstance(n.slice, ast.Subscript) and isinstance(n.slice.value, ast.Name)}
    held = {id(v) for k, v in frame.f_locals.items() if k in indexing}
    for name, val in kwargs.items():
        if isinstance(val, (tuple, list)) and val and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                          for x in val) \
                and id(val) in held and (name, "positions", id(val)) not in forbid:
            forbid.add((name, "positions", id(val)))  # once per made-up value (a regrid makes it again)
            new = dict(kwargs)
            new[name] = [torch.arange(x) for x in val]
            return new, f"{name}: one range of positions per axis"
    return None


def missing_dependency(exc: BaseException) -> str | None:
    """A ``NameError`` for a name the failing code's module imports only under a condition
    (``if is_x_available(): from x import y``): the optional dependency is not installed and the
    forward cannot run on any input. The reason, or None."""
    if not isinstance(exc, NameError) or not getattr(exc, "name", None):
        return None
    frames = _model_frames(exc)
    if not frames:
        return None
    mod = inspect.getmodule(frames[-1].f_code)
    try:
        tree = ast.parse(inspect.getsource(mod)) if mod is not None else None
    except (OSError, TypeError, SyntaxError):
        return None
    for n in ast.walk(tree) if tree is not None else ():
        if isinstance(n, (ast.If, ast.Try)):
            for imp in (x for b in n.body for x in ast.walk(b) if isinstance(x, (ast.Import, ast.ImportFrom))):
                for alias in imp.names:
                    if (alias.asname or alias.name).split(".")[0] == exc.name:
                        src = imp.module if isinstance(imp, ast.ImportFrom) else alias.name
                        return (f"the forward uses {exc.name!r}, which {mod.__name__} imports from {src!r} only when "
                                f"that optional dependency is installed, and it is not")
    return None


_VIEW = re.compile(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)")


def _view_multiple(exc, msg, kwargs, make, forbid, params):
    """``x.view(-1, K)`` of an input the failing statement names, whose elements (times what the
    code made of each) do not fill rows of K: the input with as many values per sample as fill
    one row (``image_meta_size`` as 6 numbers where 2 were made up)."""
    m = _VIEW.search(msg)
    if not m:
        return None
    dims = [int(x) for x in m.group(1).split(",") if x.strip()]
    total = int(m.group(2))
    if dims.count(-1) != 1:
        return None
    row = 1
    for d in dims:
        row *= d if d != -1 else 1
    frames = _model_frames(exc)
    named = set(re.findall(r"\w+", statement_text(frames[-1]))) if frames else set()
    for name, val in kwargs.items():
        if name not in named or not isinstance(val, torch.Tensor) or val.ndim not in (1, 2) or not val.numel() \
                or total % val.numel() or (name, "view") in forbid:
            continue
        each = total // val.numel()  # what the code made of one value
        per = (row * each // math.gcd(row, each)) // each  # values that fill one row
        forbid.add((name, "view"))
        new = dict(kwargs)
        fill = val.flatten()[0].item()
        new[name] = torch.full((1, per) if val.ndim == 2 else (per,), fill, dtype=val.dtype)
        return new, f"{name}: {per} values per sample (a row of {row})"
    return None


_CAT_SIZES = re.compile(r"Sizes of tensors must match except in dimension (-?\d+)\. Expected size (\d+) but got "
                        r"size (\d+) for tensor number (\d+)")


def _cat_operand_size(exc, msg, kwargs, make, forbid, params):
    """``torch.cat([ours, theirs], dim=D)`` where ``theirs`` was computed by the code: the input
    among the listed operands takes the other operand's size on the axis that differs (the
    first operand's size X against operand k's size Y)."""
    m = _CAT_SIZES.search(msg)
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    cat_dim, x, y, k = (int(g) for g in m.groups())
    frame = frames[-1]
    try:
        stmt = ast.parse(statement_text(frame))
    except SyntaxError:
        return None
    lists = [c.args[0] for c in ast.walk(stmt) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and c.func.attr in ("cat", "concat", "concatenate") and c.args and isinstance(c.args[0], (ast.List, ast.Tuple))]
    if not lists:
        return None
    names = [e.id if isinstance(e, ast.Name) else None for e in lists[0].elts]
    for pos, want_from, want_to in ((0, x, y), (k, y, x)):
        if pos >= len(names) or names[pos] is None:
            continue
        local = frame.f_locals.get(names[pos])
        for name, val in kwargs.items():
            if val is not local or not isinstance(val, torch.Tensor) or (name, "cat", want_to) in forbid:
                continue
            axes = [d for d in range(val.ndim) if val.shape[d] == want_from and d != cat_dim % val.ndim]
            if not axes:
                continue
            forbid.add((name, "cat", want_to))
            shape = list(val.shape)
            shape[axes[-1]] = want_to
            new = dict(kwargs)
            new[name] = torch.randn(shape).to(val.dtype) if val.is_floating_point() else torch.zeros(shape, dtype=val.dtype)
            return new, f"{name}: dim {axes[-1]} {want_from} -> {want_to} (like the tensor it is concatenated with)"
    return None


_CHANNELS = re.compile(r"expected input\[[\d, ]+\] to have (\d+) channels, but got (\d+) channels")


def _output_width(model) -> int | None:
    """The width of the model's last layer (its output's channels)."""
    last = None
    for m in model.modules():
        w = getattr(m, "out_channels", None) or getattr(m, "out_features", None)
        if isinstance(w, int) and not list(m.children()):
            last = w
    return last


def _split_concat_channels(exc, msg, kwargs, make, forbid, params):
    """An embedding that expects C channels gets the concatenation of the noisy input with other
    inputs (``x = torch.cat([cond, x], dim=-1)`` in a frame of the failing call): the noisy input
    (the forward's first) keeps the width of the model's output (a denoiser returns what it
    takes), the other concatenated input takes the rest of C."""
    m = _CHANNELS.search(msg)
    model = getattr(make, "model", None)
    first = getattr(make, "first", None)
    if not m or model is None or first not in kwargs:
        return None
    want = int(m.group(1))
    out_w = _output_width(model)
    if not out_w or out_w >= want:
        return None
    for frame in reversed(_model_frames(exc)):
        try:
            lines, _ = inspect.getsourcelines(frame.f_code)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            continue
        for c in ast.walk(tree):
            if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in ("cat", "concat")
                    and c.args and isinstance(c.args[0], (ast.List, ast.Tuple))):
                continue
            names = [e.id for e in c.args[0].elts if isinstance(e, ast.Name)]
            dim = next((k.value.value if isinstance(k.value, ast.Constant) else
                        -k.value.operand.value if isinstance(k.value, ast.UnaryOp) else None
                        for k in c.keywords if k.arg == "dim"), None)
            others = [n for n in names if n != first and isinstance(kwargs.get(n), torch.Tensor)]
            if first not in names or len(others) != 1 or not isinstance(dim, int):
                continue
            other = others[0]
            key = (other, "split", want)
            if key in forbid:
                continue
            forbid.add(key)
            new = dict(kwargs)
            for n, w in ((first, out_w), (other, want - out_w)):
                shape = list(kwargs[n].shape)
                shape[dim] = w
                new[n] = torch.randn(shape)
            return new, f"{first}: width {out_w} (the output's), {other}: the other {want - out_w} of {want}"


_NORM_SHAPE = re.compile(r"normalized_shape=\[(\d+)\], expected input with shape \[\*,? ?\d+\], but got input of "
                         r"size\s?\[([\d, ]+)\]")


def _input_held(exc, kwargs) -> list[tuple[str, torch.Tensor]]:
    """The tensor inputs some frame of the failing call holds (by identity), innermost first."""
    out, seen = [], set()
    for _, lv in _failing_locals(exc):
        for name, val in kwargs.items():
            if val is lv and isinstance(val, torch.Tensor) and name not in seen:
                seen.add(name)
                out.append((name, val))
    return out


def _reshaped_last_dim(exc, msg, kwargs, make, forbid, params):
    """A Linear (``mat1 (AxB and CxD)``) or a norm (``normalized_shape=[C] ... got [.., B]``) rejects
    a reshape of an input (same element count A x B, its last dim L folded ``B / L`` times into the
    row, e.g. a patchify view): the input's last dim becomes ``L * C / B``."""
    m, n = _MATMUL.search(msg), _NORM_SHAPE.search(msg)
    if m:
        rows, b, c = int(m.group(1)), int(m.group(2)), int(m.group(3))
    elif n:
        size = [int(x) for x in n.group(2).replace(" ", "").split(",") if x]
        c, b, rows = int(n.group(1)), size[-1], math.prod(size[:-1])
    else:
        return None
    for name, val in _input_held(exc, kwargs):
        last = val.shape[-1] if val.ndim else 0
        if not val.is_floating_point() or val.ndim < 2 or val.numel() != rows * b or not last or b % last \
                or (c * last) % b or (name, "last", c * last // b) in forbid:
            continue
        want = c * last // b
        forbid.add((name, "last", want))
        new = dict(kwargs)
        new[name] = torch.randn(tuple(val.shape[:-1]) + (want,))
        return new, f"{name}: last dim {last} -> {want} (a reshape of it meets a width {c})"
    return None


def _flat_leaves(kwargs: dict) -> dict:
    """``{"x[0]": t, "pairs[0][1]": u}``: the tensors inside list/tuple inputs, by their path."""
    out = {}

    def walk(key, val):
        if isinstance(val, torch.Tensor):
            out[key] = val
        elif isinstance(val, (list, tuple)):
            for i, v in enumerate(val):
                walk(f"{key}[{i}]", v)

    for name, val in kwargs.items():
        if isinstance(val, (list, tuple)):
            walk(name, val)
    return out


def _path(key: str) -> tuple[str, list[int]]:
    name = key.split("[", 1)[0]
    return name, [int(i) for i in re.findall(r"\[(\d+)\]", key)]


def _put(val, idx: list, new):
    if not idx:
        return new
    items = list(val)
    items[idx[0]] = _put(items[idx[0]], idx[1:], new)
    return type(val)(items) if isinstance(val, tuple) else items


def _nested_inputs(exc, msg, kwargs, make, forbid, params):
    """Tensors inside list/tuple inputs (one tensor per sample, ``(encoding, mask)`` pairs) get the
    shape repairs the top-level tensors get; a per-sample element is made like one sample of a
    batched input (its batch axis dropped)."""
    flat = _flat_leaves(kwargs)
    if not flat:
        return None

    def make_leaf(key, kw, rank=None):
        name, idx = _path(key)
        if rank is None:
            return None
        val = make(name, kwargs, rank=rank + 1 if len(idx) == 1 else rank)
        if isinstance(val, torch.Tensor) and len(idx) == 1 and val.ndim == rank + 1 and val.shape[0] == 1:
            val = val[0]
        return val if isinstance(val, torch.Tensor) and val.ndim == rank else None

    for rule in (_matmul_last_dim, _integer_indices, _boolean_mask, _size_mismatch, _unpack_rank,
                 _reshaped_last_dim, _last_axis_width):
        fixed = rule(exc, msg, flat, make_leaf, forbid, set(flat))
        if fixed is None:
            continue
        new_flat, note = fixed
        new, changed = dict(kwargs), False
        for key, val in new_flat.items():
            if val is not flat.get(key):
                name, idx = _path(key)
                new[name], changed = _put(new[name], idx, val), True
        if changed:
            return new, note
    return None


_TUPLE_DOC = re.compile(r"`?\(([\w ,]+)\)`? tuples")


def _iterated_tuples(exc, msg, kwargs, make, forbid, params):
    """``for a, b in <input>`` unpacks each item of an input into N names: the input becomes a list
    of one N-tuple; items named (by the loop or by the docstring's ``(encoding, mask) tuples``) like
    a mask are ones of (batch, text), the others (batch, text, width) states."""
    m = _UNPACK.search(msg)
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    want = int(m.group(1))
    for frame, n in _unpacking_loops(frames[-2:], want):
        local = frame.f_locals.get(n.iter.id)
        name = next((k for k, v in kwargs.items() if v is local and isinstance(v, torch.Tensor)), None)
        if name is None or (name, "tuples", want) in forbid:
            continue
        forbid.add((name, "tuples", want))
        names = [e.id if isinstance(e, ast.Name) else "" for e in n.target.elts]
        doc = _TUPLE_DOC.search(_param_doc(frame, name))
        if doc and len(doc.group(1).split(",")) == want:
            names = [x.strip() for x in doc.group(1).split(",")]
        text = getattr(getattr(make, "grid", None), "text", TEXT_LEN)
        width = getattr(getattr(make, "grid", None), "channels", 4)
        item = tuple(torch.ones(1, text) if "mask" in x.lower() else torch.randn(1, text, width) for x in names)
        new = dict(kwargs)
        new[name] = [item]
        return new, f"{name}: a list of {want}-tuples {tuple(names)}"
    return None


def _unpacking_loops(frames, want: int):
    """(frame, loop node) of each ``for a, b, ... in <name>`` with ``want`` names in the statements
    the frames run (a comprehension runs in a frame of its own: its caller's statement holds it)."""
    for frame in reversed(frames):
        try:
            tree = ast.parse(statement_text(frame))
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.comprehension, ast.For)) and isinstance(n.target, ast.Tuple) \
                    and len(n.target.elts) == want and isinstance(n.iter, ast.Name):
                yield frame, n


def _param_doc(frame, name: str) -> str:
    """The docstring paragraph of parameter ``name`` of the function a frame runs."""
    doc = frame.f_code.co_consts[0] if frame.f_code.co_consts and isinstance(frame.f_code.co_consts[0], str) else ""
    m = re.search(rf"^\s*{re.escape(name)} \(.*?(?=^\s*\w+ \(|\Z)", doc, re.M | re.S)
    return m.group(0) if m else ""


def last_axis_mismatch(exc) -> tuple | None:
    """(a, b, d) when a size mismatch is on the last axis of the tensors the innermost frame holds
    (a feature width, e.g. a norm's weight against its input), not on a sequence axis."""
    m = _SIZE.search(str(exc))
    frames = _model_frames(exc)
    if not m or not frames:
        return None
    a, b, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    tensors = [v for v in frames[-1].f_locals.values() if isinstance(v, torch.Tensor)]
    on_last = any(t.ndim - 1 == d and t.shape[d] in (a, b) for t in tensors)
    elsewhere = any(t.ndim - 1 > d and t.shape[d] in (a, b) for t in tensors)
    return (a, b, d) if on_last and not elsewhere else None


def _last_axis_width(exc, msg, kwargs, make, forbid, params):
    """A width mismatch on the last axis (``last_axis_mismatch``) of a tensor that is an input, or
    has an input's elements (a concatenation of one per-sample tensor, a view): the input's last dim
    takes the other width."""
    found = last_axis_mismatch(exc)
    if not found:
        return None
    a, b, _ = found
    frames = _model_frames(exc)
    locals_ = [v for v in frames[-1].f_locals.values() if isinstance(v, torch.Tensor)]
    same = [(n, v, loc) for n, v in kwargs.items() for loc in locals_ if isinstance(v, torch.Tensor)
            and v.is_floating_point() and v.ndim >= 2 and loc.shape[-1] == v.shape[-1] and v.shape[-1] in (a, b)
            and v.numel() <= loc.numel()]
    # the same elements first, then a padded concatenation of them (more rows, same width)
    for name, val, loc in sorted(same, key=lambda x: x[1].numel() != x[2].numel()):
        want = b if val.shape[-1] == a else a
        if (name, "last", want) in forbid:
            continue
        forbid.add((name, "last", want))
        new = dict(kwargs)
        new[name] = torch.randn(tuple(val.shape[:-1]) + (want,))
        return new, f"{name}: last dim {val.shape[-1]} -> {want} (a width its consumer fixes)"
    return None


_NAME_NOISE = {"num", "hidden", "states", "n", "size", "len", "length", "of", "input", "inputs"}


def int_input_size(exc, kwargs: dict) -> tuple[str, int] | None:
    """(name, size) when a size mismatch ``a`` vs ``b`` sets an int input that equals one side
    (a token count given as an int: ``audio_num_frames``) against a tensor input that has the other
    side on that axis and shares a word of its name (``audio_hidden_states``): the int takes the
    tensor's size."""
    m = _SIZE.search(str(exc))
    if not m:
        return None
    a, b, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    best, score = None, 0
    for iname, ival in kwargs.items():
        if isinstance(ival, bool) or not isinstance(ival, int) or ival not in (a, b):
            continue
        other = b if ival == a else a
        words = set(iname.lower().split("_")) - _NAME_NOISE
        for tname, t in kwargs.items():
            if isinstance(t, torch.Tensor) and t.ndim > d and t.shape[d] == other:
                sc = len(words & (set(tname.lower().split("_")) - _NAME_NOISE))
                if sc > score:
                    best, score = (iname, other), sc
    return best


def _int_input_size(exc, msg, kwargs, make, forbid, params):
    """See ``int_input_size``."""
    found = int_input_size(exc, kwargs)
    if not found or (found[0], "int", found[1]) in forbid:
        return None
    forbid.add((found[0], "int", found[1]))
    new = dict(kwargs)
    new[found[0]] = found[1]
    return new, f"{found[0]}: {kwargs[found[0]]} -> {found[1]} (the size of the tensor it describes)"


_EXPECTED_TUPLE = re.compile(r"has (?:shape|resolution|size) \(([\d, ]+)\),? but (?:is |was )?expected (?:to have )?"
                             r"(?:shape |resolution |size )?\(([\d, ]+)\)")


def _expected_tuple(exc, msg, kwargs, make, forbid, params):
    """``... has resolution (8, 8) but is expected to have resolution (64, 64)``: the input the failing
    frames hold whose axes read (8, 8) (the last such run of axes) gets (64, 64) there."""
    m = _EXPECTED_TUPLE.search(msg)
    if not m:
        return None
    have = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
    want = [int(x) for x in m.group(2).replace(" ", "").split(",") if x]
    if len(have) != len(want) or not have or any(w > 4096 for w in want):
        return None
    low = msg.lower().replace("_", " ")
    named = [(n, v) for n, v in kwargs.items() if isinstance(v, torch.Tensor) and n.replace("_", " ") in low]
    for name, val in _input_held(exc, kwargs) + named:  # held by the failing frames, or named by the message
        shape = list(val.shape)
        for start in range(len(shape) - len(have), -1, -1):
            if shape[start:start + len(have)] == have and (name, "axes", tuple(want)) not in forbid:
                forbid.add((name, "axes", tuple(want)))
                shape[start:start + len(have)] = want
                new = dict(kwargs)
                new[name] = torch.randn(shape).to(val.dtype) if val.is_floating_point() else \
                    torch.zeros(shape, dtype=val.dtype)
                return new, f"{name}: axes {tuple(have)} -> {tuple(want)} (the error's expected shape)"
    return None


_CONV_CHANNELS = re.compile(r"expected input\[([\d, ]+)\] to have (\d+) channels, but got (\d+) channels")


def _conv_channels(exc, msg, kwargs, make, forbid, params):
    """A convolution wants C channels and gets G from an input or a reshape of it (same element
    count; frames folded into the batch): the input's axis of size G (axis 1 first) becomes C."""
    m = _CONV_CHANNELS.search(msg)
    if not m:
        return None
    seen = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
    want, got = int(m.group(2)), int(m.group(3))
    held = _input_held(exc, kwargs)
    others = [(n, v) for n, v in kwargs.items() if isinstance(v, torch.Tensor) and all(n != h for h, _ in held)]
    for name, val in held + others:
        if val.numel() != math.prod(seen) or val.ndim < 2 or (name, "channels", want) in forbid:
            continue
        axes = [i for i in range(1, val.ndim) if val.shape[i] == got]
        if not axes:
            continue
        forbid.add((name, "channels", want))
        shape = list(val.shape)
        shape[axes[0]] = want
        new = dict(kwargs)
        new[name] = torch.randn(shape).to(val.dtype) if val.is_floating_point() else torch.zeros(shape, dtype=val.dtype)
        return new, f"{name}: axis {axes[0]} {got} -> {want} (a convolution's channels)"
    return None


def _documented_symbol(exc, msg, kwargs, make, forbid, params):
    """The message gives a documented size symbol's value (``... for seq_len=8``) and names inputs
    (in backticks) documented with that symbol (``timestep_indices (... of shape `(seq_len,)`)``):
    each such input gets that size on that axis."""
    model = getattr(make, "model", None)
    values = {k: int(v) for k, v in re.findall(r"\b(\w+)\s*=\s*(\d+)\b", msg)}
    if model is None or not values:
        return None
    dims = {n: [p.strip() for p in d.split(",") if p.strip()] for n, d in doc_shapes(type(model).forward)}
    named = set(re.findall(r"`(\w+)`", msg))
    new, notes = dict(kwargs), []
    for name in sorted(named):
        val = kwargs.get(name)
        if not isinstance(val, torch.Tensor) or name not in dims:
            continue
        shape = list(val.shape) if val.ndim == len(dims[name]) else [1] * len(dims[name])
        for i, sym in enumerate(dims[name]):
            if sym in values:
                shape[i] = values[sym]
        if shape != list(val.shape) and (name, "symbol", tuple(shape)) not in forbid:
            forbid.add((name, "symbol", tuple(shape)))
            whole = val.is_floating_point() and not name.lower().endswith(("ids", "indices"))
            new[name] = torch.randn(shape) if whole else torch.zeros(shape, dtype=torch.long)
            notes.append(f"{name}: {tuple(shape)}")
    return (new, "documented sizes the message gives: " + ", ".join(notes)) if notes else None


def _index_dtype(exc, msg, kwargs, make, forbid, params):
    """``Expected dtype int32 or int64 for index``: the float input shaped like the float index the
    innermost frame holds (an index computed from inputs, e.g. ``row * k + tags``) becomes integers."""
    if "for index" not in msg or "int" not in msg:
        return None
    frames = _model_frames(exc)
    given = {id(v) for v in kwargs.values()}
    shapes = {tuple(v.shape) for v in (frames[-1].f_locals.values() if frames else ())
              if isinstance(v, torch.Tensor) and v.is_floating_point() and id(v) not in given}
    for name, val in kwargs.items():
        if isinstance(val, torch.Tensor) and val.is_floating_point() and tuple(val.shape) in shapes \
                and (name, "long") not in forbid:
            return _as_long_zeros(kwargs, name, forbid, f"{name}: integer indices (an index computed from it)")
    return None


def _empty_mapping(exc, msg, kwargs, make, forbid, params):
    """``argument after ** must be a mapping, not NoneType``: the forward parameter the failing
    statement spreads with ``**`` (an options dict left None) becomes an empty dict."""
    if "must be a mapping, not NoneType" not in msg:
        return None
    for frame in reversed(_model_frames(exc)):
        for name in re.findall(r"\*\*(\w+)", statement_text(frame)):
            if name in params and frame.f_locals.get(name, 0) is None and kwargs.get(name) is None \
                    and (name, "mapping") not in forbid:
                forbid.add((name, "mapping"))
                new = dict(kwargs)
                new[name] = {}
                return new, f"{name}: an empty options dict (spread with **)"
    return None


# the repairs ``repair`` tries, in order: each is (exc, msg, kwargs, make, forbid, params) -> (new, note) | None
_REPAIRS = (_supply_missing, _matmul_last_dim, _supply_none, _boolean_mask, _supply_named, _integer_indices,
            _like_concatenated, _size_mismatch, _masked_count, _grid_token_count, _repeats_length,
            _unpack_rank, _supply_guarded, _grid_as_positions, _view_multiple,
            _cat_operand_size, _split_concat_channels, _reshaped_last_dim, _iterated_tuples, _nested_inputs,
            _last_axis_width, _int_input_size, _expected_tuple, _conv_channels, _documented_symbol,
            _index_dtype, _empty_mapping)


def explain(exc: BaseException, model) -> str:
    """A named reason for an error no repair addresses, when the code says more than the message:
    a ``KeyError`` on a dict built from a dict-annotated forward parameter (named features of a
    running pipeline that the probe does not make up)."""
    if not isinstance(exc, KeyError) or not exc.args:
        return ""
    try:
        sig = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return ""
    dicts = [n for n, p in sig.items() if "dict" in str(p.annotation).lower() or "mapping" in str(p.annotation).lower()]
    dicts = [n for n in dicts if not never_supplied(n)]
    if not dicts:
        return ""
    return (f" (the forward reads key {exc.args[0]!r} of the features it builds from the dict input "
            f"{', '.join(repr(d) for d in dicts)}: named features the probe does not make up)")


# --- inputs as diffusers' own pipelines build them --------------------------------------------------

_PIPELINE_CALLS: dict = {}


def pipeline_calls(cls: type) -> list[tuple]:
    """(module, function node) of every function of a diffusers pipeline class whose ``__init__``
    annotates ``transformer: <cls>`` and that calls ``self.transformer(...)``: found from the
    pipelines' source (AST), cached per class."""
    if cls in _PIPELINE_CALLS:
        return _PIPELINE_CALLS[cls]
    import importlib
    import pathlib

    out = []
    needle = f"transformer: {cls.__name__}"
    for prefix, root in _pipeline_roots():
        out += _pipeline_functions(cls, needle, prefix, pathlib.Path(root))
    _PIPELINE_CALLS[cls] = out
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


def _pipeline_functions(cls, needle: str, prefix: str, root) -> list[tuple]:
    out = []
    for path in root.rglob("*.py"):
        try:
            text = path.read_text()
        except OSError:
            continue
        if needle not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        module = prefix + "." + ".".join(path.relative_to(root).with_suffix("").parts)
        for c in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            init = next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None or not any(a.arg == "transformer" and a.annotation is not None
                                       and ast.unparse(a.annotation).split("|")[0].strip() == cls.__name__
                                       for a in init.args.args):
                continue
            for f in (x for x in c.body if isinstance(x, ast.FunctionDef)):
                if any(_is_self_transformer(n.func) for n in ast.walk(f) if isinstance(n, ast.Call)):
                    out.append((module, f))
    return out


def _is_self_transformer(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "transformer" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


class _Unresolved(Exception):
    pass


def pipeline_value(model, name: str, fill=None):
    """The value diffusers' own pipeline passes as ``name`` to ``self.transformer(...)`` when the
    pipeline builds it with one call the probe can evaluate: a function of the pipeline module (or
    a method of the transformer) whose arguments are constants or attributes of the transformer
    (``self.transformer.head_dim``); an argument built from the pipeline's running state is left to
    its default, or to ``fill(param_name, annotation)`` (the probe's own rules) when it has none.
    None when no pipeline builds it that way."""
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


__all__ = ["Grid", "Need", "axis_role", "forward_needs", "module_need", "repair", "tensor_for"]
