"""The library's shape: stage packages named like their notebooks, no import cycles, no
process-wide rebinding of torch functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "lib"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(LIB).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every ``ditbook`` module -> the ``ditbook`` modules it imports (at any depth of the file)."""
    files = {module_name(p): p for p in (LIB / "ditbook").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in files and t != name:
                    deps.add(t)
                    break
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if not state.get(nxt):
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_cycle():
    # the check itself can fail: a two-module loop is reported
    assert find_cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


STAGE_PACKAGES = ("intake", "inspect", "cache", "parallel", "benchmark")
PROBE = "ditbook.coverage"

# the layers, lowest first: a module imports only from its own layer or a lower one, and a stage
# package imports no other stage. Root modules (``ditbook/<name>.py``) are tools unless named here.
LAYERS = (
    ("tools", ()),  # every root module not named below
    ("facts", ("arch", "zoo")),
    ("technique machinery", ("adapter", "cp")),
    ("techniques", ("accel",)),
    ("stage support", ("context", "preflight")),
    ("stages", STAGE_PACKAGES),
    ("drivers", ("runner", "cli", "commands", "kernels", "widgets", "coverage", "__main__")),
)


def unit(module: str) -> str:
    """The package a module belongs to (``ditbook.cache.stage`` -> ``cache``), or the root module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(name: str) -> int:
    return next((i for i, (_, names) in enumerate(LAYERS) if name in names), 0)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b (why)`` for each import that goes up a layer or from one stage into another."""
    out = []
    for a, deps in graph.items():
        for b in deps:
            ua, ub = unit(a), unit(b)
            if ua == ub:
                continue
            la, lb = layer_of(ua), layer_of(ub)
            if lb > la:
                out.append(f"{a} -> {b} ({LAYERS[la][0]} importing {LAYERS[lb][0]})")
            elif ua in STAGE_PACKAGES and ub in STAGE_PACKAGES:
                out.append(f"{a} -> {b} (a stage importing another stage)")
    return sorted(out)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph collapsed to packages (root modules stay themselves)."""
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        out.setdefault(unit(a), set()).update(unit(b) for b in deps if unit(b) != unit(a))
    return out


def test_layers_hold_and_no_stage_imports_another():
    bad = layer_violations(import_graph())
    assert bad == [], "imports against the layers:\n" + "\n".join(bad)


def test_package_graph_has_no_cycle():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package-level import cycle: " + " -> ".join(cycle)


def test_layer_check_sees_a_sideways_stage_import_and_an_upward_one():
    graph = {"ditbook.cache.stage": {"ditbook.parallel.launch", "ditbook.accel.dbcache", "ditbook.hooks"},
             "ditbook.accel.dbcache": {"ditbook.cache.verify", "ditbook.adapter.build"},
             "ditbook.hooks": {"ditbook.arch.static"}, "ditbook.runner": {"ditbook.benchmark.report"}}
    assert layer_violations(graph) == [
        "ditbook.accel.dbcache -> ditbook.cache.verify (techniques importing stages)",
        "ditbook.cache.stage -> ditbook.parallel.launch (a stage importing another stage)",
        "ditbook.hooks -> ditbook.arch.static (tools importing facts)"]
    assert find_cycle(package_graph({"ditbook.cache.a": {"ditbook.parallel.b"},
                                     "ditbook.parallel.c": {"ditbook.cache.d"}})) == ["cache", "parallel", "cache"]


def arrows_into(graph: dict[str, set[str]], sources: tuple, target: str) -> list[str]:
    """``a -> b`` for each module ``a`` under one of the ``sources`` packages that imports ``target`` or
    a module under it."""
    def under(mod: str, pkg: str) -> bool:
        return mod == pkg or mod.startswith(pkg + ".")

    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if any(under(a, f"ditbook.{s}") for s in sources) and under(b, target))


def test_no_stage_package_imports_the_coverage_probe():
    # the probe (ditbook.coverage) imports the stages to test them; a stage never imports the probe
    arrows = arrows_into(import_graph(), STAGE_PACKAGES, PROBE)
    assert arrows == [], f"stage packages import the coverage probe: {arrows}"


def test_probe_arrow_check_sees_an_arrow():
    # the check itself can fail: a stage module importing a probe module is reported, the reverse is not
    graph = {"ditbook.parallel.launch": {"ditbook.coverage.cp"}, "ditbook.coverage.check": {"ditbook.adapter.build"},
             "ditbook.cachex": {"ditbook.coverage"}}
    assert arrows_into(graph, STAGE_PACKAGES, PROBE) == ["ditbook.parallel.launch -> ditbook.coverage.cp"]


def test_stage_packages_carry_the_notebook_names():
    stages = [re.sub(r"^\d+_", "", p.stem) for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    assert stages == ["intake", "inspect", "cache", "parallel", "benchmark"]
    for stage in stages:
        assert (LIB / "ditbook" / stage / "stage.py").is_file(), f"lib/ditbook/{stage}/stage.py is missing"
        nb = (ROOT / "notebooks").glob(f"*_{stage}.ipynb").__next__().read_text()
        assert f"ditbook.{stage}" in nb, f"the {stage} notebook does not call its package"


NOTEBOOK_HELPERS = ("ditbook.display", "ditbook.progress", "ditbook.widgets")  # display helpers


def notebook_imports(nb_text: str) -> set[str]:
    """The ``ditbook`` modules a notebook's code cells import."""
    import json

    out = set()
    for cell in json.loads(nb_text)["cells"]:
        if cell["cell_type"] == "code":
            out |= set(re.findall(r"^\s*(?:from|import)\s+(ditbook[\w.]*)", "".join(cell["source"]), re.M))
    return out


def test_each_notebook_imports_its_stage_and_display_helpers_only():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        stage = re.sub(r"^\d+_", "", path.stem)
        other = sorted(notebook_imports(path.read_text()) - {f"ditbook.{stage}.stage", *NOTEBOOK_HELPERS})
        assert other == [], f"{path.name} imports {other}: give its stage.py those names"


def test_notebook_import_check_sees_another_module():
    import json

    nb = json.dumps({"cells": [{"cell_type": "code", "source": ["from ditbook.cache.stage import x\n",
                                                                 "from ditbook.arch.report import ArchReport\n"]}]})
    assert notebook_imports(nb) == {"ditbook.cache.stage", "ditbook.arch.report"}


def test_no_library_module_loaded_through_importlib():
    # importlib is for the user's sources and the zoo's optional builders, never to hide an
    # import of another ditbook package from the graph above
    pattern = re.compile(r"import_module\((f?[\"']ditbook|[A-Z_]+\b)")
    offenders = [str(p.relative_to(ROOT)) for p in (LIB / "ditbook").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == [], f"ditbook modules loaded through importlib (hides the import graph): {offenders}"


REBINDING = re.compile(r"(torch\.nn\.functional|\bF)\.scaled_dot_product_attention\s*=[^=]")


def rebinding_offenders(files) -> list[str]:
    return [f for f, text in files if REBINDING.search(text)]


def test_no_process_wide_rebinding_of_torch_functions():
    files = [(str(p.relative_to(ROOT)), p.read_text())
             for p in list((LIB / "ditbook").rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py"))]
    offenders = rebinding_offenders(files)
    assert offenders == [], f"scaled_dot_product_attention rebound process-wide in {offenders}"


def test_rebinding_check_sees_a_rebinding():
    # the check itself can fail: both spellings are caught, a comparison or a call is not
    assert rebinding_offenders([("a.py", "F.scaled_dot_product_attention = fn\n"),
                                ("b.py", "torch.nn.functional.scaled_dot_product_attention=fn\n"),
                                ("c.py", "ok = F.scaled_dot_product_attention == fn\n"
                                         "F.scaled_dot_product_attention(q, k, v)\n"
                                         "FF.scaled_dot_product_attention = 1\n")]) == ["a.py", "b.py"]


# --- run-time changes only through ditbook.hooks ------------------------------------------------

SETTERS = ("setattr", "delattr", "object.__setattr__", "object.__delattr__")


def foreign_changes(source: str) -> list[str]:
    """Run-time changes made around ``ditbook.hooks``: ``unittest.mock`` (``mock.patch``), a function
    assigned as an attribute of another object (a method replaced), an attribute of an imported
    module assigned, and ``setattr``/``delattr`` on anything but ``self``."""
    tree = ast.parse(source)
    modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    funcs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.startswith("unittest.mock") for a in n.names) \
                or isinstance(n, ast.ImportFrom) and (n.module or "").startswith("unittest") \
                and (n.module == "unittest.mock" or any(a.name == "mock" for a in n.names)):
            out.append(f"{n.lineno}: unittest.mock")
        elif isinstance(n, ast.Attribute) and ast.unparse(n).endswith(("mock.patch", "patch.object")):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if not isinstance(t, ast.Attribute):
                    continue
                root = t.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                name = root.id if isinstance(root, ast.Name) else None
                method = isinstance(n.value, ast.Lambda) or isinstance(n.value, ast.Name) and n.value.id in funcs
                if name in modules or method and name not in ("self", "cls"):
                    out.append(f"{n.lineno}: {ast.unparse(t)} = {ast.unparse(n.value)[:40]}")
        elif isinstance(n, ast.Call) and ast.unparse(n.func) in SETTERS and n.args \
                and not (isinstance(n.args[0], ast.Name) and n.args[0].id == "self"):
            out.append(f"{n.lineno}: {ast.unparse(n)[:60]}")
    first = {}
    for x in out:  # one finding per line, in line order
        first.setdefault(int(x.split(":")[0]), x)
    return [first[k] for k in sorted(first)]


REGISTRY_WRITES = ("register", "update", "clear", "setdefault", "pop", "popitem", "__setitem__", "__delitem__")
# the process environment is the process's settings (entry points set them on purpose, child
# processes read them), not another library's registry of objects
PROCESS_SETTINGS = ("os.environ", "_os.environ")


def _foreign_names(tree) -> set[str]:
    """Names bound by importing another library: ``import x`` (the root name) and
    ``from x import Y`` where x is not ditbook; then names assigned an attribute of one of those
    (``table = Registry._adapters``), so an alias is seen too."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and not (n.module or "").startswith("ditbook"):
            names |= {a.asname or a.name for a in n.names}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and _root(n.value) in names:
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def _root(e) -> str | None:
    while isinstance(e, (ast.Attribute, ast.Subscript, ast.Call)):
        e = e.func if isinstance(e, ast.Call) else e.value
    return e.id if isinstance(e, ast.Name) else None


def registry_changes(source: str) -> list[str]:
    """Entries of another library's registry changed around ``ditbook.hooks.set_item``: an item
    assigned or deleted in something reached from an imported name (``Registry._registry[k] = v``,
    ``sys.modules[name] = m``, ``del ...``), and a registering or dict-writing call on one
    (``Registry.register(...)``, ``table.update(...)``, ``.clear()``, ``.pop(key)``; a list's
    ``pop(0)`` is not a registry's)."""
    tree = ast.parse(source)
    foreign = _foreign_names(tree)

    def foreign_obj(e) -> bool:
        return _root(e) in foreign and not ast.unparse(e).startswith(PROCESS_SETTINGS)

    out = []
    for n in ast.walk(tree):
        targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete))
                   else [n.target] if isinstance(n, ast.AugAssign) else [])
        out += [f"{n.lineno}: {ast.unparse(t)}" for t in targets if isinstance(t, ast.Subscript) and foreign_obj(t.value)]
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in REGISTRY_WRITES \
                and foreign_obj(n.func.value) and not (n.func.attr == "pop" and n.args and isinstance(n.args[0], ast.Constant)
                                                       and type(n.args[0].value) is int):
            out.append(f"{n.lineno}: {ast.unparse(n)[:60]}")
    return sorted(set(out), key=lambda x: int(x.split(":")[0]))


def test_run_time_changes_go_through_hooks():
    offenders = {str(p.relative_to(ROOT)): found for p in sorted((LIB / "ditbook").rglob("*.py"))
                 if p.name != "hooks.py" and (found := foreign_changes(p.read_text()) + registry_changes(p.read_text()))}
    assert offenders == {}, f"changes around ditbook.hooks (use wrap_method / swap_attribute / set_item): {offenders}"


def test_foreign_change_check_sees_each_kind():
    # the check itself can fail: each way around the hooks core is reported, the hooks' own ways are not
    bad = ("import unittest.mock\n"
           "from unittest import mock\n"
           "import diffusers.models.attention as am\n"
           "def fake(*a): pass\n"
           "def f(cm, mod, proc):\n"
           "    with mock.patch.object(mod, 'X', 1):\n"
           "        pass\n"
           "    cm.can_cache = fake\n"
           "    proc.step = lambda: 0\n"
           "    am.CONSTANT = 3\n"
           "    setattr(proc, '_cp_config', None)\n")
    assert [x.split(":")[0] for x in foreign_changes(bad)] == ["1", "2", "6", "8", "9", "10", "11"]
    ok = ("from ditbook.hooks import swap_attribute, wrap_method\n"
          "class A:\n"
          "    def f(self, proc, row):\n"
          "        setattr(self, 'n', 1)\n"
          "        row.outcome = 'correct'\n"
          "        swap_attribute(proc, '_cp_config', None)\n")
    assert foreign_changes(ok) == []


def test_registry_change_check_sees_each_kind():
    # the check itself can fail: a foreign registry written directly is reported (also through an
    # alias), set_item, ditbook's own registries, a list's pop(0) and the environment are not
    bad = ("import sys\n"
           "from cache_dit import BlockAdapterRegister\n"
           "def f(cls, meta, name, module):\n"
           "    from diffusers.hooks._helpers import TransformerBlockRegistry\n"
           "    TransformerBlockRegistry._registry[cls] = meta\n"
           "    TransformerBlockRegistry.register(cls, meta)\n"
           "    table = BlockAdapterRegister._adapters\n"
           "    table.clear()\n"
           "    table.update({})\n"
           "    sys.modules[name] = module\n"
           "    del sys.modules[name]\n"
           "    sys.modules.pop(name, None)\n"
           "    BlockAdapterRegister.register('X')(f)\n")
    assert [x.split(":")[0] for x in registry_changes(bad)] == ["5", "6", "8", "9", "10", "11", "12", "13"]
    ok = ("import os\n"
          "import sys\n"
          "from ditbook import hooks\n"
          "from .registry import register, REGISTRY\n"
          "def f(cls, meta, name, module, sub, rows):\n"
          "    from diffusers.hooks._helpers import TransformerBlockRegistry\n"
          "    hooks.set_item(TransformerBlockRegistry._registry, cls, meta)\n"
          "    REGISTRY[name] = module\n"
          "    module.register(sub)\n"
          "    rows[name] = 1\n"
          "    sys.path.pop(0)\n"
          "    os.environ['HF_HUB_OFFLINE'] = '1'\n"
          "    os.environ.setdefault('X', '1')\n")
    assert registry_changes(ok) == []


# --- function length: over LONG_LINES lines only with a reason ---------------------------------

LONG_LINES = 60
LONG_MARK = "# long:"


def long_functions_without_reason(source: str, limit: int = LONG_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function longer than ``limit`` lines whose body does
    not carry a ``# long: <reason>`` comment line and whose ``def`` is not directly preceded by
    one."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = node.end_lineno - node.lineno + 1
        if n <= limit:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        above = lines[first - 2].strip() if first >= 2 else ""
        body = lines[node.lineno - 1:node.end_lineno]
        reasoned = above.startswith(LONG_MARK) and len(above) > len(LONG_MARK) + 8
        reasoned = reasoned or any(ln.strip().startswith(LONG_MARK) and len(ln.strip()) > len(LONG_MARK) + 8
                                   for ln in body)
        if not reasoned:
            out.append((node.name, node.lineno, n))
    return out


def test_no_long_function_without_a_reason():
    offenders = []
    for path in sorted((LIB / "ditbook").rglob("*.py")):
        for name, line, n in long_functions_without_reason(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)")
    assert not offenders, ("functions over %d lines need splitting or a '# long: <reason>' comment:\n  "
                           % LONG_LINES) + "\n  ".join(offenders)


def test_length_check_sees_a_long_function_and_accepts_a_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    bare = f"def f():\n{body}\n"
    assert [(n, ln) for n, ln, _ in long_functions_without_reason(bare)] == [("f", 1)]
    reasoned = f"def f():\n    # long: one straight sequence of steps, read top to bottom\n{body}\n"
    assert long_functions_without_reason(reasoned) == []
    above = f"# long: a template of the generated file\ndef f():\n{body}\n"
    assert long_functions_without_reason(above) == []
    empty_reason = f"def f():\n    # long:\n{body}\n"
    assert len(long_functions_without_reason(empty_reason)) == 1
