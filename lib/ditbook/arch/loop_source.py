"""Reading the transformer's block loops from its source: what happens between block calls (a cache wrapper replaces the
whole loop). A loop is a ``for`` over ``self.<path>`` in ``forward`` or a method it calls; a statement calling the
loop variable is the block call; every other statement is loop work, *conditional* under an ``if`` testing a forward
argument against ``None``, else *active* (per-index block arguments too)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field


@dataclass
class LoopWork:
    block_list: str
    line: int  # line number in the source file
    code: str
    kind: str  # "residual", "skip_connection", "per_index_argument", "state", "other"
    active: bool  # False: only when an optional forward argument is given
    condition: str = ""

    def describe(self) -> str:
        cond = f" [only when {self.condition}]" if not self.active and self.condition else ""
        return f"{self.block_list}: line {self.line}: {self.kind}: {self.code}{cond}"


@dataclass
class LoopSource:
    loops: dict[str, int] = field(default_factory=dict)  # block list path -> line of its loop
    work: list[LoopWork] = field(default_factory=list)
    file: str | None = None
    error: str | None = None

    @property
    def active(self) -> list[LoopWork]:
        return [w for w in self.work if w.active]

    @property
    def conditional(self) -> list[LoopWork]:
        return [w for w in self.work if not w.active]


def _attr_path(node: ast.AST) -> str | None:
    """``self.a.b`` -> ``a.b``; ``self.a[0]`` -> ``a.0``."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            parts.append(str(node.slice.value))
            node = node.value
        else:
            break
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(reversed(parts))
    return None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _calls_block(node: ast.AST, block_vars: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Name) and n.func.id in block_vars:
                return True
            if any(isinstance(a, ast.Name) and a.id in block_vars for a in n.args) and (
                "checkpoint" in ast.unparse(n.func)
            ):
                return True
    return False


def _only_block_calls(stmts: list[ast.stmt], block_vars: set[str]) -> bool:
    return bool(stmts) and all(_calls_block(s, block_vars) or isinstance(s, ast.Pass) for s in stmts)


def _kind(code: str, targets: set[str]) -> str:
    low = code.lower()
    if "skip" in low:
        return "skip_connection"
    if "controlnet" in low or "control" in low or "residual" in low:
        return "residual"
    if any(t in ("hidden_states", "encoder_hidden_states", "x", "h", "img", "txt") for t in targets):
        return "residual"
    if ".append(" in code or ".pop(" in code:
        return "state"
    return "other"


class _LoopReader:
    def __init__(self, lines_offset: int, forward_args: set[str], path: str, index_vars: set[str], block_vars: set[str]):
        self.offset = lines_offset
        self.forward_args = forward_args
        self.path = path
        self.index_vars = index_vars
        self.block_vars = block_vars
        self.local_names: set[str] = set()
        self.block_outputs: set[str] = set()  # names a block call's result was assigned to
        self.work: list[LoopWork] = []

    def _condition(self, test: ast.AST) -> tuple[bool, str]:
        """(active, text): inactive when it only tests optional forward arguments for None."""
        text = ast.unparse(test)
        # ``arg is not None`` alone or as one term of an ``and``: off unless the caller passes ``arg``
        terms = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
        for t in terms:
            if (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.IsNot)
                    and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None
                    and isinstance(t.left, ast.Name) and t.left.id in self.forward_args):
                return False, text
        return True, text

    def read(self, stmts: list[ast.stmt], active: bool = True, condition: str = "") -> None:
        for s in stmts:
            if isinstance(s, ast.If):
                both = s.body + s.orelse
                if _only_block_calls(s.body, self.block_vars) and (not s.orelse or _only_block_calls(s.orelse, self.block_vars)):
                    for b in both:
                        self._block_call(b, active, condition)
                    continue
                if any(_calls_block(b, self.block_vars) for b in both):
                    # an index-dependent choice of how to call the block: read both branches
                    sub_active, text = self._condition(s.test)
                    self.read(s.body, active and sub_active, condition or ("" if sub_active else text))
                    self.read(s.orelse, active, condition)
                    continue
                sub_active, text = self._condition(s.test)
                self._add(s, active and sub_active, condition or ("" if sub_active else text))
                continue
            if _calls_block(s, self.block_vars):
                self._block_call(s, active, condition)
                continue
            if self._passes_output_on(s):
                continue  # ``x = out`` / ``x, c = out``: the block's output taken as is, no work
            self._add(s, active, condition)

    def _output_part(self, v: ast.AST) -> bool:
        """``out``, ``out[0]`` or ``out["key"]`` of a name a block call's result was assigned to."""
        if isinstance(v, ast.Subscript) and isinstance(v.slice, ast.Constant) and isinstance(v.slice.value, (int, str)):
            v = v.value
        return isinstance(v, ast.Name) and v.id in self.block_outputs

    def _passes_output_on(self, s: ast.stmt) -> bool:
        """``x = out`` / ``x, c = out`` / ``a, b = out[...], out[...]``: the block's output as is."""
        if not isinstance(s, ast.Assign):
            return False
        v = s.value
        return self._output_part(v) or (isinstance(v, ast.Tuple) and all(self._output_part(e) for e in v.elts))

    def _block_call(self, stmt: ast.stmt, active: bool, condition: str) -> None:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                self.block_outputs |= _names(t)
        for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
            if not (isinstance(call.func, ast.Name) and call.func.id in self.block_vars):
                continue
            for arg in list(call.args) + [k.value for k in call.keywords]:
                used = _names(arg)
                if used & (self.index_vars | self.local_names) and not isinstance(arg, ast.Name) or (
                        isinstance(arg, ast.Name) and arg.id in self.local_names):
                    self.work.append(LoopWork(self.path, self.offset + arg.lineno, ast.unparse(arg),
                                              "skip_connection" if "skip" in ast.unparse(arg).lower() else "per_index_argument",
                                              active, condition))

    def _add(self, stmt: ast.stmt, active: bool, condition: str) -> None:
        code = ast.unparse(stmt).splitlines()[0]
        targets: set[str] = set()
        for n in ast.walk(stmt):
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    targets |= _names(t)
        self.local_names |= targets
        value = getattr(stmt, "value", None)
        if active and isinstance(stmt, ast.Assign) and value is not None:
            # ``flag = ... if arg is not None and ... else ...``: conditional on ``arg``
            test = value.test if isinstance(value, ast.IfExp) else value
            sub_active, text = self._condition(test)
            if not sub_active:
                active, condition = False, text
        self.work.append(LoopWork(self.path, self.offset + stmt.lineno, code, _kind(ast.unparse(stmt), targets),
                                  active, condition))


def read_loops(module, block_paths: list[str]) -> LoopSource:
    """Find the loops over ``block_paths`` in ``type(module).forward`` and list their extra work."""
    cls = type(module)
    try:
        src, start = inspect.getsourcelines(cls.forward)
        file = inspect.getsourcefile(cls.forward)
    except (OSError, TypeError) as exc:
        return LoopSource(error=f"source of {cls.__name__}.forward is not available: {exc}")
    tree = ast.parse(textwrap.dedent("".join(src)))
    fn = tree.body[0]
    args = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self"}
    out = LoopSource(file=file)
    # forward, then the methods it calls as self.<name>(...) (a loop may live in a helper)
    methods = _method_asts(cls)
    bodies: list[tuple[ast.AST, int]] = [(fn, start)]
    seen, todo = {"forward"}, [fn]
    while todo:
        cur = todo.pop()
        for n in ast.walk(cur):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                    and n.func.value.id == "self" and n.func.attr in methods and n.func.attr not in seen:
                seen.add(n.func.attr)
                helper, off = methods[n.func.attr]
                bodies.append((helper, off + 1))
                todo.append(helper)
                args |= {a.arg for a in helper.args.args + helper.args.kwonlyargs} - {"self"}
    for node, start in ((n, st) for body, st in bodies for n in ast.walk(body)):
        if not isinstance(node, ast.For) or for_reads_attributes(node):
            continue  # a loop that only reads attributes of each block is no block loop
        paths = {p for p in (_attr_path(n) for n in ast.walk(node.iter)) if p}
        hit = [p for p in block_paths if p in paths]
        if not hit:
            continue
        path = hit[0]
        out.loops[path] = start - 1 + node.lineno
        loop_vars = _names(node.target)
        iter_text = ast.unparse(node.iter)
        if iter_text.startswith("enumerate(") and isinstance(node.target, ast.Tuple) and len(node.target.elts) == 2:
            index_vars, block_vars = _names(node.target.elts[0]), _names(node.target.elts[1])
        elif iter_text.startswith("range("):
            index_vars, block_vars = loop_vars, {f"__sub_{path}"}  # the call is a subscript ``self.blocks[i]``
        else:
            index_vars, block_vars = set(), loop_vars
        reader = _LoopReader(start - 1, args, path, index_vars, block_vars)
        if not block_vars or block_vars == {f"__sub_{path}"}:
            # index loops: a statement calling self.<path>[i] is the block call
            reader.block_vars = set()
            for s in node.body:
                if any(isinstance(n, ast.Call) and _attr_path(getattr(n.func, "value", n.func)) == path for n in ast.walk(s)):
                    continue
                reader._add(s, True, "")
        else:
            reader.read(node.body)
        out.work.extend(reader.work)
    return out


@dataclass
class ListUses:
    """Every place the transformer's code (forward and the methods it calls, recursively) touches ``self.<path>``."""

    path: str
    loops: list[str] = field(default_factory=list)  # "forward:123" per plain for-loop over the list
    exclusive: bool = False  # the loops sit in different branches of one ``if`` (only one runs per call)
    other: list[str] = field(default_factory=list)  # "method:line: code" per other use
    in_body: list[str] = field(default_factory=list)  # uses inside the loop's own body (len, indexing)
    conditional: list[str] = field(default_factory=list)  # other uses only under a test of an optional argument
    loop_flow: list[str] = field(default_factory=list)
    zipped_after: list[str] = field(default_factory=list)  # the list whose zip loop runs this one (not first)
    # outside the loop: element attributes read, or the length; safe pointed at the original blocks
    element_attrs: list[str] = field(default_factory=list)

    @property
    def early_exits(self) -> list[str]:
        """The loop's ``break`` / ``continue``: the loop must be folded."""
        return sorted({f for f in self.loop_flow if f in FOLDABLE_FLOW})

    def unsafe(self) -> str:
        """Why replacing the list by one cached unit would change what the code does ('' if safe)."""
        if self.other:
            return (f"the code touches self.{self.path} outside its loop ({'; '.join(self.other[:3])}): a cache that "
                    f"stands in one unit for the list would change what that code sees")
        if len(self.loops) > 1 and not self.exclusive:
            return f"the code loops over self.{self.path} {len(self.loops)} times ({', '.join(self.loops)})"
        stops = [f for f in self.loop_flow if f not in FOLDABLE_FLOW]
        if stops:
            return f"the loop over self.{self.path} uses {', '.join(stops)}: a cached unit cannot stop early"
        if not self.loops:
            return f"no loop over self.{self.path} found in the transformer's code"
        return ""


def _method_asts(cls) -> dict[str, tuple[ast.FunctionDef, int]]:
    out = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        for name, fn in vars(klass).items():
            if name in out or not inspect.isfunction(fn):
                continue
            try:
                src, start = inspect.getsourcelines(inspect.unwrap(fn))
                node = ast.parse(textwrap.dedent("".join(src))).body[0]
            except (OSError, TypeError, SyntaxError, IndexError):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[name] = (node, start - 1)
    return out


def _branches(fn: ast.AST) -> dict[int, list[tuple[int, str]]]:
    """For every node, the ``if`` statements above it and which branch it is in."""
    out: dict[int, list[tuple[int, str]]] = {}

    def visit(node, chain):
        out[id(node)] = chain
        if isinstance(node, ast.If):
            visit(node.test, chain)
            for s in node.body:
                visit(s, chain + [(id(node), "body")])
            for s in node.orelse:
                visit(s, chain + [(id(node), "orelse")])
            return
        for c in ast.iter_child_nodes(node):
            visit(c, chain)

    visit(fn, [])
    return out


def _optional_guard(fn, ifs: dict, chain: list) -> str:
    """The test of an enclosing ``if`` reading a parameter defaulting to None or False; '' when none."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = dict(zip([x.arg for x in pos[len(pos) - len(a.defaults):]], a.defaults))
    defaults.update({x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    optional = {k for k, d in defaults.items() if isinstance(d, ast.Constant) and d.value in (None, False)}
    for if_id, branch in chain:
        node = ifs.get(if_id)
        if node is not None and branch == "body" and _names(node.test) & optional:
            return ast.unparse(node.test)
    return ""


def exclusive_branches(branches: dict, a: ast.AST, b: ast.AST) -> bool:
    """True when ``a`` and ``b`` sit in different branches of one ``if``."""
    ca, cb = dict(branches.get(id(a), [])), dict(branches.get(id(b), []))
    return any(k in cb and cb[k] != v for k, v in ca.items())


class Flow:
    """Which two places of one function can both run in one call (conservative: loops, ``try`` count as may)."""

    def __init__(self, fn: ast.AST):
        self.fn = fn
        self.branches = _branches(fn)
        self.parents = {id(c): n for n in ast.walk(fn) for c in ast.iter_child_nodes(n)}

    def _up(self, node: ast.AST) -> list[ast.AST]:
        out = []
        while id(node) in self.parents:
            node = self.parents[id(node)]
            out.append(node)
        return out

    def never_both(self, a: ast.AST, b: ast.AST) -> bool:
        if exclusive_branches(self.branches, a, b):
            return True
        up_a, up_b = self._up(a), self._up(b)
        if any(isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and any(m is n for m in up_b) for n in up_a):
            return False  # a loop around both: the later one may run before the earlier on a next pass
        first, second = sorted((a, b), key=lambda n: (n.lineno, n.col_offset))
        return self._returns_before(first, second)

    def _returns_before(self, first: ast.AST, second: ast.AST) -> bool:
        """After ``first`` runs, the function always returns (or raises) before reaching ``second``."""
        second_stmt = self._statement(second)
        cur = self._statement(first)
        if any(n is second for n in ast.walk(cur)):
            return False  # one statement holds both (``return self._a() + self._b()``, an ``if`` test and its body)
        if any(isinstance(n, ast.Try) or type(n).__name__ == "TryStar" for n in self._up(cur)):
            return False  # a ``finally`` / handler may run more code after the return
        while True:
            if isinstance(cur, ast.Return):
                return True
            parent = self.parents.get(id(cur))
            block = next((getattr(parent, f) for f in ("body", "orelse", "finalbody")
                          if any(s is cur for s in getattr(parent, f, None) or [])), None)
            if block is None or isinstance(parent, (ast.Try, ast.For, ast.AsyncFor, ast.While)):
                return False  # a handler, a loop body that runs again, a finally clause: not followed
            for s in block[next(i for i, x in enumerate(block) if x is cur) + 1:]:
                if any(n is second_stmt for n in ast.walk(s)):
                    return False  # ``second`` reached
                if isinstance(s, (ast.Return, ast.Raise)):
                    return True
                if any(isinstance(n, (ast.Break, ast.Continue)) for n in own_flow_nodes([s])):
                    return False
            if parent is self.fn:
                return False
            cur = parent

    def _statement(self, node: ast.AST) -> ast.AST:
        while not isinstance(node, ast.stmt) and id(node) in self.parents:
            node = self.parents[id(node)]
        return node


def _loop_iter_lists(it: ast.AST) -> list[ast.AST]:
    """The ``self.<x>`` nodes a for-loop iterates one by one (plain, ``enumerate``, ``zip``)."""
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and len(it.args) == 1:
        it = it.args[0]
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and it.args \
            and not it.keywords and all(_attr_path(a) for a in it.args):
        return list(it.args)
    return [it] if _attr_path(it) else []


def _element_attribute(node: ast.AST, parents: dict) -> bool:
    """``node`` (``self.<list>``) is indexed and an attribute of the element read: ``self.<list>[i].attr``."""
    sub = parents.get(id(node))
    if not (isinstance(sub, ast.Subscript) and sub.value is node and isinstance(sub.ctx, ast.Load)):
        return False
    attr = parents.get(id(sub))
    return isinstance(attr, ast.Attribute) and attr.value is sub and isinstance(attr.ctx, ast.Load)


def length_read(node: ast.AST, parents: dict) -> bool:
    """``node`` (``self.<list>``) is only measured: ``len(self.<list>)``."""
    call = parents.get(id(node))
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "len"
            and len(call.args) == 1 and call.args[0] is node and not call.keywords)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def comprehension_element_var(gen) -> tuple[str | None, ast.AST | None]:
    """(element name, list node) of ``for b in self.<list>`` (or its ``enumerate``), else Nones."""
    it, target = gen.iter, gen.target
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" \
            and len(it.args) == 1 and not it.keywords:
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name)):
            return None, None
        it, target = it.args[0], target.elts[1]
    if not (_attr_path(it) and isinstance(target, ast.Name)):
        return None, None
    return target.id, it


def _only_attribute_reads(roots: list[ast.AST], var: str, skip: set[int]) -> bool:
    """Every ``var`` under ``roots`` (but ``skip``) is read as ``var.<attr>`` only."""
    parents = {id(c): n for root in roots for n in ast.walk(root) for c in ast.iter_child_nodes(n)}
    for n in (n for root in roots for n in ast.walk(root)):
        if not (isinstance(n, ast.Name) and n.id == var) or id(n) in skip:
            continue
        parent = parents.get(id(n))
        if not (isinstance(n.ctx, ast.Load) and isinstance(parent, ast.Attribute) and parent.value is n
                and isinstance(parent.ctx, ast.Load)):
            return False
    return True


def comprehension_reads_attributes(comp: ast.AST, gen: ast.comprehension) -> bool:
    """In ``comp``, the element ``gen`` takes from ``self.<list>`` is only used to read its attributes."""
    var, _ = comprehension_element_var(gen)
    if var is None or not isinstance(comp, _COMPREHENSIONS) or gen not in comp.generators:
        return False
    # the element may not be rebound by a later generator
    later = comp.generators[comp.generators.index(gen) + 1:]
    if any(isinstance(n, ast.Name) and n.id == var for g in later for n in ast.walk(g.target)):
        return False
    return _only_attribute_reads([comp], var, {id(n) for n in ast.walk(gen.target)})


def for_reads_attributes(loop: ast.AST) -> bool:
    """A ``for`` over ``self.<list>`` that only reads attributes of each element: not a block loop."""
    if not isinstance(loop, ast.For):
        return False
    var, _ = comprehension_element_var(loop)
    return var is not None and _only_attribute_reads(loop.body + loop.orelse, var, set())


def _comprehension_attribute(node: ast.AST, parents: dict) -> bool:
    """``node`` is iterated by a comprehension or ``for`` that only reads element attributes."""
    up = parents.get(id(node))
    if isinstance(up, ast.Call):
        up = parents.get(id(up))
    if not isinstance(up, (ast.comprehension, ast.For)) or comprehension_element_var(up)[1] is not node:
        return False
    if isinstance(up, ast.For):
        return for_reads_attributes(up)
    return comprehension_reads_attributes(parents.get(id(up)), up)


def _use_text(node: ast.AST, parent: ast.AST | None, parents: dict) -> str:
    """The code of one use of ``node`` for the record: its parent expression, or the comprehension / ``for`` header."""
    gen = parent if isinstance(parent, (ast.comprehension, ast.For)) else parents.get(id(parent))
    if isinstance(gen, ast.comprehension):
        return ast.unparse(parents.get(id(gen), gen))
    if isinstance(gen, ast.For) and gen.iter in (node, parent):
        return f"for {ast.unparse(gen.target)} in {ast.unparse(gen.iter)}: ..."
    return ast.unparse(parent if parent is not None else node)


def own_flow_nodes(stmts: list[ast.stmt]):
    """The ``break`` / ``continue`` / ``return`` / ``yield`` nodes under ``stmts`` acting on their loop."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Break, ast.Continue, ast.Return, ast.Yield, ast.YieldFrom)):
            yield node
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            # the nested loop's own break/continue stay inside it; a return still leaves the method
            todo.extend(n for s in node.body for n in ast.walk(s) if isinstance(n, (ast.Return, ast.Yield)))
            todo.extend(node.orelse)
            todo.append(node.iter if not isinstance(node, ast.While) else node.test)
            continue
        todo.extend(ast.iter_child_nodes(node))


# the early exits a folded loop body reproduces (``loopfold``): the block's body returns early
FOLDABLE_FLOW = ("break", "continue")


def _loop_flow(loop: ast.For) -> list[str]:
    """The ways a loop can stop early or run extra code: break/continue/return, for-else."""
    flow = sorted({type(n).__name__.lower() for n in own_flow_nodes(loop.body)})
    return flow + (["for-else"] if loop.orelse else [])


def list_uses(cls, paths: list[str]) -> dict[str, ListUses]:
    """Where the code of ``cls`` (``forward`` and methods reached from it) touches each list."""
    methods = _method_asts(cls)
    uses = {p: ListUses(p) for p in paths}
    seen: set[str] = set()
    todo = ["forward"]
    sites: dict[str, list[tuple[str, ast.AST, Flow]]] = {}  # method -> (caller, call node, caller's flow)
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        fn, offset = methods[name]
        loop_nodes: set[int] = set()
        body_nodes: dict[int, str] = {}
        flow = Flow(fn)
        branches = flow.branches
        ifs = {id(n): n for n in ast.walk(fn) if isinstance(n, ast.If)}
        loops_by_list: dict[str, list[ast.For]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                todo.append(node.func.attr)
                sites.setdefault(node.func.attr, []).append((name, node, flow))
            if isinstance(node, ast.For) and not for_reads_attributes(node):
                _record_loop(node, f"{name}:{offset + node.lineno}", uses, loop_nodes, loops_by_list, body_nodes)
        for p, found in loops_by_list.items():
            if len(found) > 1 and len(uses[p].loops) == len(found):
                uses[p].exclusive = all(flow.never_both(a, b) for i, a in enumerate(found) for b in found[i + 1:])
        parents = {id(c): n for n in ast.walk(fn) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Attribute) or id(node) in loop_nodes:
                continue
            p = _attr_path(node)
            if p not in uses:
                continue
            parent = parents.get(id(node))
            if isinstance(parent, ast.Attribute) and _attr_path(parent):
                continue  # counted at the outermost self.a.b
            if isinstance(parent, ast.Call) and parent.func is node:
                continue  # self.blocks(...)? not a list use
            if getattr(node, "ctx", None).__class__ is ast.Store:
                continue  # assignment in __init__-like helpers
            line = _use_text(node, parent, parents)
            element_attr = (_element_attribute(node, parents) or _comprehension_attribute(node, parents)
                            or length_read(node, parents))
            u = uses[p]
            where = u.in_body if body_nodes.get(id(node)) == p else u.element_attrs if element_attr else u.other
            guard = _optional_guard(fn, ifs, branches.get(id(node), []))
            if where is uses[p].other and guard:
                where = uses[p].conditional
                line = f"{line} [only when {guard}]"
            where.append(f"{name}:{offset + node.lineno}: {line[:80]}")
    for u in uses.values():
        _exclusive_methods(u, sites)
    return uses


def _record_loop(node: ast.For, where: str, uses: dict, loop_nodes: set, loops_by_list: dict, body_nodes: dict) -> None:
    """A for statement over one or more of the lists (``zip`` of several): recorded on each."""
    lists = _loop_iter_lists(node.iter)
    for k, it in enumerate(lists):
        if k and _attr_path(it) in uses:
            uses[_attr_path(it)].zipped_after.append(_attr_path(lists[0]))
        p = _attr_path(it)
        if p in uses:
            loop_nodes.add(id(it))
            loops_by_list.setdefault(p, []).append(node)
            uses[p].loops.append(where)
            body_nodes.update({id(n): p for st in node.body for n in ast.walk(st)})
            uses[p].loop_flow += _loop_flow(node)


def _exclusive_methods(u: ListUses, sites: dict) -> None:
    """Loops over one list in several methods called from places that never both run: exclusive."""
    methods = [loop.split(":")[0] for loop in u.loops]
    if len(methods) < 2 or len(set(methods)) != len(methods) or u.exclusive:
        return
    calls = [sites.get(m, []) for m in methods]
    if any(len(c) != 1 for c in calls) or len({c[0][0] for c in calls}) != 1:
        return
    nodes = [c[0][1] for c in calls]
    flow = calls[0][0][2]
    u.exclusive = all(flow.never_both(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:])
