"""Folding a transformer's block loop into its blocks: cache-dit runs a block list as one cached unit, so loop work
besides the block call would run once per list. ``plan_fold`` reads the loop with ``ast``; the other functions give
the loop body, the rewritten methods and the methods reading elements, as plain source."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import asdict, dataclass, field


class FoldError(ValueError):
    """The loop cannot be folded automatically (the reason says why)."""


@dataclass
class LoopFold:
    """What the loop over one block list does, read from the forward's source."""

    path: str  # block list attribute, e.g. "blocks"
    block_var: str  # loop variable bound to the block
    index_var: str | None  # loop index from enumerate(...), if any
    carried: list[str]  # loop-carried names: [hidden stream, encoder stream?]
    inputs: list[str]  # outer names the body reads (passed as keywords)
    extra_statements: int  # statements in the body besides the block call
    keyword_call: bool  # the block is called with keyword arguments
    call_keywords: list[str] = field(default_factory=list)
    body_source: str = ""
    method: str = "forward"  # the method of the transformer that holds the loop
    element_methods: list[str] = field(default_factory=list)  # methods reading self.<path>[i].<attr>
    # carried names whose updates never read a block's output (a counter): precomputed per block
    control: list[str] = field(default_factory=list)
    # a zip loop's other lists: {loop variable: list path}; each folded block runs its partners too
    partners: dict[str, str] = field(default_factory=dict)
    flow: list[str] = field(default_factory=list)
    # block-call arguments that differ per block (``kv_cache[i]``)
    per_block_args: list[str] = field(default_factory=list)
    # the same list's loops in other methods that never run in one call (``_loop_mode``)
    modes: list["LoopFold"] = field(default_factory=list)

    @property
    def variants(self) -> list["LoopFold"]:
        """This fold and its modes' (``_loop_mode`` k is the k-th)."""
        return [self, *self.modes]

    @property
    def pattern(self) -> str:
        return "Pattern_0" if len(self.carried) == 2 else "Pattern_3"

    def input_keyword(self, name: str) -> str:
        """The keyword an outer input travels under: its name, unless that is a stream role of the call."""
        roles = ["hidden_states", "encoder_hidden_states"][: len(self.carried)]
        return f"_loop_in_{name}" if name in roles else name

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pattern"] = self.pattern
        d.pop("body_source")
        d["modes"] = [m.to_dict() for m in self.modes]
        return d


def _forward_function(cls, method: str = "forward") -> tuple[ast.FunctionDef, str]:
    fn = inspect.unwrap(getattr(cls, method))
    src = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(src)
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise FoldError(f"{cls.__name__}.{method} is not a plain function")
    return node, src


def element_methods(cls, path: str) -> list[str]:
    """The methods that read an attribute of an element of ``self.<path>`` outside its loop."""
    from ..arch.loop_source import list_uses

    return sorted({e.split(":")[0] for e in list_uses(cls, [path])[path].element_attrs})


def _names(node: ast.AST, ctx) -> list[str]:
    return list(dict.fromkeys(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)))


def _first_events(stmts: list[ast.stmt]) -> dict[str, str]:
    """For each name, whether the body first reads ("load") or writes ("store") it, in evaluation order."""
    events: dict[str, str] = {}

    def note(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id not in events:
                events[n.id] = "load" if isinstance(n.ctx, ast.Load) else "store"

    def visit(stmt):
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            if stmt.value is not None:
                note(stmt.value)
            if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
                events.setdefault(stmt.target.id, "load")
            for t in getattr(stmt, "targets", None) or [stmt.target]:
                note(t)
        elif isinstance(stmt, (ast.If, ast.While, ast.For)):
            note(stmt.iter if isinstance(stmt, ast.For) else stmt.test)
            if isinstance(stmt, ast.For):
                note(stmt.target)
            for s in stmt.body + stmt.orelse:
                visit(s)
        elif isinstance(stmt, ast.With):
            for item in stmt.items:
                note(item.context_expr)
                if item.optional_vars is not None:
                    note(item.optional_vars)
            for s in stmt.body:
                visit(s)
        else:
            note(stmt)

    for s in stmts:
        visit(s)
    return events


def _loop_list(loop: ast.For) -> tuple[str | None, str | None, str | None]:
    """(path, block_var, index_var) when the loop iterates ``self.X`` or ``enumerate(self.X)``."""
    it, target = loop.iter, loop.target
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
        inner = it.args[0]
        if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[0], ast.Name):
            zipped = _zip_vars(inner, target.elts[1])
            if zipped:
                return zipped[0][1], zipped[0][0], target.elts[0].id
            if isinstance(target.elts[1], ast.Name):
                return _self_attr(inner), target.elts[1].id, target.elts[0].id
        return None, None, None
    zipped = _zip_vars(it, target)
    if zipped:
        return zipped[0][1], zipped[0][0], None
    path = _self_attr(it)
    if path and isinstance(target, ast.Name):
        return path, target.id, None
    return None, None, None


def _zip_vars(it: ast.AST, target: ast.AST) -> list[tuple[str, str]]:
    """``zip(self.a, self.b)`` unpacked into names: [(name, list path)] per list; [] otherwise."""
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and it.args
            and isinstance(target, ast.Tuple) and len(target.elts) == len(it.args)):
        return []
    pairs = [(e.id if isinstance(e, ast.Name) else None, _self_attr(a)) for e, a in zip(target.elts, it.args)]
    return pairs if all(v and p for v, p in pairs) else []


def loop_partners(loop: ast.For) -> dict[str, str]:
    """The lists a zip loop runs besides its first: {loop variable: list path}."""
    it = loop.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
        return dict(_zip_vars(it.args[0], loop.target.elts[1])[1:]) if isinstance(loop.target, ast.Tuple) else {}
    return dict(_zip_vars(it, loop.target)[1:])


def _self_attr(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


def _block_calls(body: list[ast.stmt], block_var: str) -> list[ast.Call]:
    calls = []
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call):
                if isinstance(n.func, ast.Name) and n.func.id == block_var:
                    calls.append(n)
                elif any(isinstance(a, ast.Name) and a.id == block_var for a in n.args):
                    calls.append(n)  # e.g. self._gradient_checkpointing_func(block, ...)
    return calls


def _is_checkpoint_branch(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and "gradient_checkpointing" in ast.unparse(stmt.test)


def _the_loop(cls, fn: ast.FunctionDef, method: str, path: str) -> ast.For:
    """The one loop over ``self.<path>`` in ``fn`` to fold (of exclusive alternatives, the direct one)."""
    from ..arch.loop_source import for_reads_attributes

    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For) and _loop_list(n)[0] == path
             and not for_reads_attributes(n)]
    if not loops:
        raise FoldError(f"{cls.__name__}.forward has no loop 'for ... in self.{path}' "
                        f"(or enumerate(self.{path})) to fold")
    if len(loops) > 1:
        from ..arch.loop_source import Flow

        flow = Flow(fn)
        if not all(flow.never_both(a, b) for i, a in enumerate(loops) for b in loops[i + 1:]):
            raise FoldError(f"{cls.__name__}.{method} loops over self.{path} {len(loops)} times")
        # alternatives of one ``if`` (the gradient-checkpointing switch): fold the direct call
        direct = [lp for lp in loops if any(isinstance(c.func, ast.Name) for c in _block_calls(lp.body, _loop_list(lp)[1]))]
        if len({ast.dump(ast.Module(body=lp.body, type_ignores=[])) for lp in direct}) > 1:
            raise FoldError(f"{cls.__name__}.{method} loops over self.{path} {len(loops)} times, in alternatives "
                            f"with different loop bodies")
        loops = direct or loops
    return loops[0]


def _outer_names(fn: ast.FunctionDef, loop: ast.For) -> set[str]:
    """Names defined outside the loop body: parameters and assignments elsewhere in the method."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    if fn.args.vararg:
        params.append(fn.args.vararg.arg)
    if fn.args.kwarg:
        params.append(fn.args.kwarg.arg)
    body_ids = {id(n) for s in loop.body for n in ast.walk(s)}
    outer_stores = set(params)
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and id(n) not in body_ids:
            outer_stores.add(n.id)
    return outer_stores


def _control_slice(stmts: list[ast.stmt], control: set[str], tainted: set[str]) -> list[ast.stmt] | None:
    """The body's statements updating ``control`` (with their ``if`` tests); None if one reads ``tainted``."""
    out: list[ast.stmt] = []
    for st in stmts:
        if isinstance(st, (ast.Continue, ast.Break)):  # the loop's own exits: the updates after them are skipped
            out.append(st)
            continue
        stores = set(_names(st, ast.Store)) & control
        if isinstance(st, ast.If):
            body, orelse = _control_slice(st.body, control, tainted), _control_slice(st.orelse, control, tainted)
            if body is None or orelse is None or (set(_names(st.test, ast.Load)) & tainted and (body or orelse)):
                return None
            if body or orelse:
                out.append(ast.If(test=st.test, body=body or [ast.Pass()], orelse=orelse))
        elif stores:
            simple = isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and \
                all(isinstance(t, ast.Name) for t in getattr(st, "targets", [getattr(st, "target", None)]))
            if not simple or set(_names(st.value, ast.Load)) & tainted:
                return None
            out.append(st)
    return out


def _control_names(body: list[ast.stmt], carried: list[str], call_order: list[str], stored: list[str],
                   block_var: str) -> list[str]:
    """The carried names not passed to the block whose updates read no stream (see ``control``)."""
    control = [n for n in carried if n not in call_order]
    while control:
        tainted = (set(stored) - set(control)) | {block_var}
        bad = [n for n in control if _control_slice(body, {n}, tainted) is None]
        if not bad:
            return control
        control = [n for n in control if n not in bad]
    return []


# calls whose result is a Python value, never a tensor
_PY_VALUE_CALLS = {"float": "a float", "int": "an int", "bool": "a bool", "str": "a str", "len": "an int",
                   "list": "a list", "tuple": "a tuple", "dict": "a dict", "set": "a set", "round": "a number"}
_PY_VALUE_METHODS = {"item": "a Python number (.item())", "tolist": "a list (.tolist())"}


def _python_value(expr: ast.AST, name: str) -> str | None:
    """What ``expr`` certainly evaluates to when not a tensor (``name`` takes the other operand's kind)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, (bool, int, float, str)):
        return f"a {type(expr.value).__name__}"
    if isinstance(expr, (ast.List, ast.ListComp)):
        return "a list"
    if isinstance(expr, (ast.Tuple, ast.Dict, ast.Set, ast.DictComp, ast.SetComp)):
        return f"a {type(expr).__name__.replace('Comp', '').lower()}"
    if isinstance(expr, ast.Call):
        f = expr.func
        if isinstance(f, ast.Name) and f.id in _PY_VALUE_CALLS:
            return _PY_VALUE_CALLS[f.id]
        if isinstance(f, ast.Attribute) and f.attr in _PY_VALUE_METHODS:
            return _PY_VALUE_METHODS[f.attr]
        return None
    if isinstance(expr, ast.BinOp):
        left, right = expr.left, expr.right
        kinds = [None if isinstance(x, ast.Name) and x.id == name else _python_value(x, name) for x in (left, right)]
        self_ref = [isinstance(x, ast.Name) and x.id == name for x in (left, right)]
        if all(k is not None or s for k, s in zip(kinds, self_ref)) and any(k is not None for k in kinds):
            return next(k for k in kinds if k is not None)
        return None
    if isinstance(expr, ast.IfExp):
        a, b = _python_value(expr.body, name), _python_value(expr.orelse, name)
        return a if a is not None and b is not None else None
    return None


def _refuse_non_tensor_carried(loop: ast.For, path: str, carried: list[str]) -> None:
    """Raise ``FoldError`` for a second carried name whose update is certainly not a tensor."""
    for name in carried[1:]:
        for node in (n for s in loop.body for n in ast.walk(s)):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                kind = _python_value(node.value, name)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name) \
                    and node.target.id == name and node.value is not None:
                kind = _python_value(node.value, name)
            else:
                continue
            if kind is not None:
                raise FoldError(
                    f"the loop over self.{path} carries '{name}' besides the stream '{carried[0]}': its update "
                    f"`{ast.unparse(node)}` reads the blocks' output and makes {kind}, not a tensor; cache-dit "
                    f"carries a second loop name as the encoder stream (a tensor it caches and slices), and a "
                    f"value computed from the stream cannot be precomputed before the loop like a counter")


def loop_methods(cls, path: str) -> list[str]:
    """Every method that loops over ``self.<path>``, in the order ``list_uses`` finds them."""
    from ..arch.loop_source import list_uses

    loops = list_uses(cls, [path])[path].loops
    return list(dict.fromkeys(loop.split(":")[0] for loop in loops)) or ["forward"]


def plan_fold(cls, path: str) -> LoopFold:
    """Read the loop over ``self.<path>``; loops in other methods never run in one call go in ``modes``."""
    from ..arch.loop_source import list_uses

    methods = loop_methods(cls, path)
    folds = [_plan_fold_in(cls, path, m) for m in methods]
    if len(folds) > 1:
        uses = list_uses(cls, [path])[path]
        if not uses.exclusive:
            raise FoldError(f"{cls.__name__} loops over self.{path} in {methods}, which may run in one call")
        if len({len(f.carried) for f in folds}) > 1:
            raise FoldError(f"the loops over self.{path} in {methods} carry different streams "
                            f"{[f.carried for f in folds]}: one list has one forward pattern")
    folds[0].modes = folds[1:]
    return folds[0]


def _plan_fold_in(cls, path: str, method: str) -> LoopFold:
    """The fold of the loop over ``self.<path>`` in ``cls.<method>``."""
    fn, _ = _forward_function(cls, method)
    loop = _the_loop(cls, fn, method, path)
    _, block_var, index_var = _loop_list(loop)
    flow = _early_exits(loop, path)
    calls = [c for c in _block_calls(loop.body, block_var) if isinstance(c.func, ast.Name)]
    if not calls:
        raise FoldError(f"the loop over self.{path} never calls {block_var}(...)")
    call = calls[-1]
    outer_stores = _outer_names(fn, loop)
    loaded = list(dict.fromkeys(n for s in loop.body for n in _names(s, ast.Load)))
    stored = list(dict.fromkeys(n for s in loop.body for n in _names(s, ast.Store)))
    partners = loop_partners(loop)
    loop_vars = {block_var, index_var, *partners}
    first = _first_events(loop.body)
    carried_set = [n for n in stored if n in outer_stores and first.get(n) == "load" and n not in loop_vars]
    # order the carried names as the block call passes them
    call_order = [a.id for a in call.args if isinstance(a, ast.Name)]
    call_order += [k.value.id for k in call.keywords if isinstance(k.value, ast.Name)]
    carried = [n for n in call_order if n in carried_set] + [n for n in carried_set if n not in call_order]
    control = _control_names(loop.body, carried, call_order, stored + list(partners), block_var)
    carried = [n for n in carried if n not in control]
    if not 1 <= len(carried) <= 2:
        raise FoldError(f"the loop over self.{path} carries {len(carried)} names {carried} that depend on the "
                        f"blocks' outputs; one (hidden states) or two (hidden, encoder) can be folded")
    _refuse_non_tensor_carried(loop, path, carried)
    inputs = [n for n in loaded if n in outer_stores and first.get(n) == "load" and n not in carried
              and n not in control and n not in loop_vars and n != "self"]
    extra = [s for s in loop.body if not _is_checkpoint_branch(s) and not (
        isinstance(s, (ast.Assign, ast.Expr)) and any(c is call for c in ast.walk(s)))]
    # arguments that differ per block: they read a loop variable or a name the body assigns
    local = (loop_vars - {None}) | (set(stored) - set(carried))
    per_block = [ast.unparse(a) for a in [*call.args, *(k.value for k in call.keywords)]
                 if set(_names(a, ast.Load)) & local]
    body_src = "\n".join(ast.unparse(s) for s in loop.body)
    return LoopFold(path=path, method=method, per_block_args=per_block, element_methods=element_methods(cls, path), control=control, partners=partners,
                    block_var=block_var, index_var=index_var, carried=carried, inputs=inputs,
                    extra_statements=len(extra), keyword_call=bool(call.keywords) and not call.args,
                    call_keywords=[k.arg for k in call.keywords if k.arg], body_source=body_src, flow=flow)


def _early_exits(loop: ast.For, path: str) -> list[str]:
    """The loop's own ``continue`` / ``break``; a ``return``, ``yield`` or ``for ... else`` raises ``FoldError``."""
    from ..arch.loop_source import FOLDABLE_FLOW, own_flow_nodes

    kinds = sorted({type(n).__name__.lower() for n in own_flow_nodes(loop.body)} | ({"for-else"} if loop.orelse else set()))
    bad = [k for k in kinds if k not in FOLDABLE_FLOW]
    if bad:
        raise FoldError(f"the loop over self.{path} uses {'/'.join(bad)}: a folded block cannot leave the method")
    return kinds


class _RenameSelf(ast.NodeTransformer):
    def visit_Name(self, node):
        if node.id == "self":
            return ast.copy_location(ast.Name(id="owner", ctx=node.ctx), node)
        return node


def loop_body_class_name(cls, path: str) -> str:
    """The name of the module class that runs one block of ``self.<path>`` with the loop's work."""
    return f"{cls.__name__}{''.join(s[:1].upper() + s[1:] for s in path.replace('.', '_').split('_'))}LoopBody"


class _OriginalList(ast.NodeTransformer):
    """``self.<path>`` in a loop body -> ``_original_list`` (the blocks as they were)."""

    def __init__(self, path: str):
        self.path = path

    def visit_Attribute(self, node):
        if _self_attr(node) == self.path:
            return ast.copy_location(ast.Name(id="_original_list", ctx=ast.Load()), node)
        self.generic_visit(node)
        return node


def loop_body_source(fold: LoopFold, folded_paths=()) -> str:
    """``def loop_body(owner, index, block, <carried>, *, ...)``: the loop body for one block."""
    body = ast.parse(fold.body_source).body
    others = _OriginalElements(set(folded_paths) - {fold.path})
    body = [_RenameSelf().visit(others.visit(_OriginalList(fold.path).visit(s))) for s in body]
    returned = f"return {', '.join(fold.carried)}"
    body = [_EarlyExit(returned).visit(s) for s in body]
    args = ", ".join(["owner", "index", "block", *fold.carried])
    kw = "".join(f", {fold.input_keyword(n)}=None" for n in fold.inputs) + ", _original_list=None"
    kw += ", _loop_control=None" if fold.control else ""
    kw += ", _loop_stop=None" if "break" in fold.flow else ""
    lines = [f"def loop_body({args}, *{kw}):"]
    if "break" in fold.flow:  # an earlier block broke the loop: this one does nothing
        lines += ["    if _loop_stop is not None and _loop_stop[0]:", f"        {returned}"]
    lines += [f"    {n} = {fold.input_keyword(n)}" for n in fold.inputs if fold.input_keyword(n) != n]
    if fold.index_var:
        lines.append(f"    {fold.index_var} = index")
    if fold.control:  # their values at this block, computed before the loop
        lines.append(f"    {', '.join(fold.control)}, = _loop_control[index]")
    if fold.block_var != "block":
        lines.append(f"    {fold.block_var} = block")
    lines += [f"    {var} = owner.{p}[index]" for var, p in fold.partners.items()]
    lines += [textwrap.indent(ast.unparse(ast.fix_missing_locations(s)), "    ") for s in body]
    lines.append(f"    {returned}")
    return "\n".join(lines) + "\n"


class _EarlyExit(ast.NodeTransformer):
    """The loop's own ``continue`` / ``break`` -> ``return <carried>`` (``break`` sets ``_loop_stop``)."""

    def __init__(self, returned: str):
        self.returned = returned

    def visit_Continue(self, node):
        return ast.parse(self.returned).body

    def visit_Break(self, node):
        return ast.parse(f"_loop_stop[0] = True\n{self.returned}").body

    def _nested_loop(self, node):
        node.orelse = [self.visit(s) for s in node.orelse]  # body: the nested loop's own exits
        return node

    visit_For = visit_AsyncFor = visit_While = _nested_loop

    def visit_FunctionDef(self, node):
        return node

    visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef


def fold_methods(folds: list[LoopFold]) -> list[str]:
    """The methods holding the folded loops (each rewritten), modes' included."""
    return sorted({v.method for f in folds for v in f.variants})


class _OriginalElements(ast.NodeTransformer):
    """Reads of ``self.<path>`` elements and length -> the original blocks the functor keeps."""

    def __init__(self, paths):
        self.paths = set(paths)

    def _original(self, path: str) -> ast.AST:
        return ast.parse(f"self._ditbook_originals[{path!r}]", mode="eval").body

    def visit_Subscript(self, node):
        self.generic_visit(node)
        path = _self_attr(node.value)
        if path in self.paths:
            node.value = self._original(path)
        return node

    def _comprehension(self, node):
        """A comprehension that only reads the elements: over the original blocks."""
        from ..arch.loop_source import comprehension_element_var, comprehension_reads_attributes

        self.generic_visit(node)
        for gen in node.generators:
            _, it = comprehension_element_var(gen)
            path = _self_attr(it) if it is not None else None
            if path in self.paths and comprehension_reads_attributes(node, gen):
                self._iterate_original(gen, it, path)
        return node

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_Call(self, node):
        """``len(self.<path>)``: the number of original blocks."""
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "len" and len(node.args) == 1
                and _self_attr(node.args[0]) in self.paths):
            node.args[0] = self._original(_self_attr(node.args[0]))
        return node

    def visit_For(self, node):
        """A ``for`` that only reads each element's attributes: over the original blocks."""
        from ..arch.loop_source import comprehension_element_var, for_reads_attributes

        reads = for_reads_attributes(node)  # before the body's own reads are rewritten
        self.generic_visit(node)
        _, it = comprehension_element_var(node)
        path = _self_attr(it) if it is not None else None
        if reads and path in self.paths:
            self._iterate_original(node, it, path)
        return node

    def _iterate_original(self, holder, it, path: str) -> None:
        if holder.iter is it:
            holder.iter = self._original(path)
        else:  # enumerate(self.<path>)
            holder.iter.args[0] = self._original(path)


def _control_source(fold: LoopFold, k: int) -> str:
    """A loop before the folded one recording the control names' values at each block."""
    body = ast.parse(fold.body_source).body
    tainted = set(_names(ast.Module(body=body, type_ignores=[]), ast.Store)) - set(fold.control) | {fold.block_var}
    tainted |= set(fold.partners)
    sliced = _control_slice(body, set(fold.control), tainted) or []
    index = fold.index_var or "_control_index"
    lines = [f"_loop_control_{k} = []",
             f"for {index} in range(len(self._ditbook_originals[{fold.path!r}])):",
             f"    _loop_control_{k}.append(({', '.join(fold.control)},))"]
    lines += [textwrap.indent(ast.unparse(ast.fix_missing_locations(s)), "    ") for s in sliced]
    return "\n".join(lines) + "\n"


def _insert_before(fn: ast.AST, target: ast.stmt, stmts: list[ast.stmt]) -> None:
    """Insert ``stmts`` just before ``target`` in whichever statement list holds it."""
    for node in ast.walk(fn):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and any(s is target for s in block):
                i = next(j for j, s in enumerate(block) if s is target)
                block[i:i] = stmts
                return
    raise FoldError("the folded loop was not found in its method")


def rewritten_method_source(cls, folds: list[LoopFold], method: str | None = None) -> str:
    """``method`` with each folded loop reduced to one block call per block (modes: ``_loop_mode``)."""
    methods = fold_methods(folds)
    if method is None:
        if len(methods) > 1:
            raise FoldError(f"the folded loops live in methods {methods}: name the one to rewrite")
        method = methods[0] if methods else "forward"
    fn, _ = _forward_function(cls, method)
    fn.decorator_list = []
    by_path, mode = {}, {}
    for f in folds:
        for k, v in enumerate(f.variants):
            if v.method == method:
                by_path[f.path], mode[f.path] = v, (k if f.modes else None)
    controls: list[tuple[ast.For, str]] = []
    from ..arch.loop_source import for_reads_attributes

    for loop in [n for n in ast.walk(fn) if isinstance(n, ast.For) and not for_reads_attributes(n)]:
        path, block_var, _ = _loop_list(loop)
        if path not in by_path:
            continue
        fold = by_path[path]
        names = ["hidden_states", "encoder_hidden_states"][: len(fold.carried)]
        kws = [f"{role}={var}" for role, var in zip(names, fold.carried)] + \
            [f"{fold.input_keyword(n)}={n}" for n in fold.inputs]
        if fold.control:
            kws.append(f"_loop_control=_loop_control_{len(controls)}")
            controls.append((loop, _control_source(fold, len(controls))))
        if mode[path] is not None:
            kws.append(f"_loop_mode={mode[path]}")
        if "break" in fold.flow:  # one flag per run of the loop: set by the block that breaks
            kws.append(f"_loop_stop=_loop_stop_{len(controls)}")
            controls.append((loop, f"_loop_stop_{len(controls)} = [False]\n"))
        target = ", ".join(fold.carried)
        loop.body = ast.parse(f"{target} = {block_var}({', '.join(kws)})").body
    for loop, src in controls:
        _insert_before(fn, loop, ast.parse(src).body)
    fn = _OriginalElements([f.path for f in folds]).visit(fn)
    fn.name = method
    if ast.get_docstring(fn, clean=False) is not None:
        fn.body = fn.body[1:]
    return ast.unparse(ast.fix_missing_locations(fn)) + "\n"


def extra_method_sources(cls, folds: list[LoopFold]) -> dict[str, str]:
    """Other methods reading a folded list's element attributes, pointed at the original blocks: {name: source}."""
    out = {}
    for name in sorted({m for f in folds for m in f.element_methods} - set(fold_methods(folds))):
        fn, _ = _forward_function(cls, name)
        fn.decorator_list = []
        fn = _OriginalElements([f.path for f in folds]).visit(fn)
        out[name] = ast.unparse(ast.fix_missing_locations(fn)) + "\n"
    return out


def defining_globals(cls, method: str) -> dict:
    """The globals of the module defining ``cls.<method>`` (a base class's when inherited)."""
    return inspect.unwrap(getattr(cls, method)).__globals__
