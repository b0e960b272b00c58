"""The code-surface report: how much of a model's pipeline and transformer source a port touches.

Every code line of the given files (blank lines, comments and docstrings are not counted) gets
one category, from the innermost rule that matches (``ast``-based heuristics, written out so a
reviewer can check them):

* ``attention_parallel`` — custom attention or parallel logic: classes and functions whose name
  says attention/processor/rotary/rope, and any statement that calls
  ``scaled_dot_product_attention``, ``dispatch_attention_fn``, ``flash_attn*``,
  ``repeat_interleave``/``repeat_kv`` (GQA expansion) or ``torch.distributed``;
* ``adapter`` — needs an adapter or wrapper: the transformer ``forward``'s loops over ``self.*``
  module lists (what a cache adapter replaces), and statements that call the transformer from
  the pipeline (``self.transformer(...)``, the call a CFG-parallel wrapper splits);
* ``scheduler_latent`` — scheduler or latent-shape handling: functions and methods named
  ``*latent*``, ``*timestep*``, ``*shift*``, ``*pack*``/``*patchif*``, and statements that
  mention ``scheduler``, ``timesteps``, or reshape with ``einsum``/``unflatten``/``permute``;
* ``benchmark_glue`` — benchmark-only glue: logging, warnings, ``deprecate``, progress bars,
  callbacks, ``XLA``, ``maybe_free_model_hooks``, ``output_type``/``return_dict`` handling;
* ``library`` — covered by library APIs: everything else (imports, layer construction, config
  plumbing, the pipeline's prompt encoding): runs as is under diffusers/cache-dit.

The estimate of the code a port needs beyond wrappers is documented on ``port_estimate``.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass, field
from pathlib import Path

CATEGORIES = ("library", "adapter", "attention_parallel", "scheduler_latent", "benchmark_glue")
ATTN_WORDS = ("attention", "attn", "processor", "rotary", "rope")
ATTN_CALLS = ("scaled_dot_product_attention", "dispatch_attention_fn", "flash_attn", "repeat_interleave",
              "repeat_kv", "torch.distributed", "dist.", "all_to_all", "all_gather")
LATENT_WORDS = ("latent", "timestep", "shift", "pack", "patchif", "sigmas")
LATENT_CALLS = ("scheduler", "timesteps", "einsum", "unflatten", "permute", "unpatchify", "patchify")
GLUE_CALLS = ("logger.", "logging.", "warnings.", "deprecate(", "progress_bar", "callback", "xla", "XLA",
              "maybe_free_model_hooks", "output_type", "return_dict", "print(", "interrupt")


@dataclass
class FileSurface:
    path: str
    lines: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CATEGORIES})
    examples: dict[str, list[str]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})


@dataclass
class CodeSurface:
    files: list[FileSurface] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CATEGORIES})
    total: int = 0
    port_estimate_lines: int | None = None
    port_estimate_reason: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for f in d["files"]:
            f["path"] = Path(f["path"]).name  # stable across machines
        return d

    def shares(self) -> dict[str, float]:
        return {c: round(n / self.total, 3) if self.total else 0.0 for c, n in self.counts.items()}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _stmt_category(text: str, inherited: str) -> str:
    if any(c in text for c in ATTN_CALLS):
        return "attention_parallel"
    if any(c in text for c in GLUE_CALLS):
        return "benchmark_glue"
    if inherited in ("attention_parallel",):
        return inherited
    if any(c in text for c in LATENT_CALLS):
        return "scheduler_latent"
    if "self.transformer(" in text or "self.transformer_2(" in text:
        return "adapter"
    return inherited


def _def_category(name: str, inherited: str) -> str:
    low = name.lower()
    if any(w in low for w in ATTN_WORDS):
        return "attention_parallel"
    if any(w in low for w in LATENT_WORDS):
        return "scheduler_latent"
    return inherited


class _Classifier:
    def __init__(self, source: str):
        self.source = source
        self.line_cat: dict[int, str] = {}

    def mark(self, node: ast.AST, cat: str) -> None:
        for ln in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            self.line_cat[ln] = cat

    def visit_body(self, body: list[ast.stmt], inherited: str, in_forward: bool = False) -> None:
        for s in body:
            self.visit(s, inherited, in_forward)

    def visit(self, s: ast.stmt, inherited: str, in_forward: bool) -> None:
        if isinstance(s, ast.ClassDef):
            cat = _def_category(s.name, "library")
            self.mark(s, cat)
            self.visit_body(s.body, cat)
            return
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cat = _def_category(s.name, inherited)
            self.mark(s, cat)
            self.visit_body(s.body, cat, in_forward=s.name == "forward")
            return
        if isinstance(s, ast.For) and in_forward and any(
                isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(s.iter)):
            self.mark(s, "adapter")
            return
        if isinstance(s, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
            header = ast.unparse(s.test if isinstance(s, (ast.If, ast.While)) else getattr(s, "iter", s)) if not isinstance(s, ast.Try) else ""
            cat = _stmt_category(header, inherited)
            for ln in range(s.lineno, (s.body[0].lineno if s.body else s.lineno)):
                self.line_cat[ln] = cat
            for part in ("body", "orelse", "finalbody"):
                self.visit_body(getattr(s, part, []) or [], cat, in_forward)
            for h in getattr(s, "handlers", []) or []:
                self.visit_body(h.body, cat, in_forward)
            return
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            self.mark(s, "library")
            return
        self.mark(s, _stmt_category(ast.unparse(s), inherited))


def classify_file(path: str | Path) -> FileSurface:
    path = Path(path)
    source = path.read_text()
    tree = ast.parse(source)
    c = _Classifier(source)
    c.visit_body(tree.body, "library")
    skip = _docstring_lines(tree)
    lines = source.splitlines()
    fs = FileSurface(str(path))
    for ln, text in enumerate(lines, 1):
        stripped = text.strip()
        if not stripped or stripped.startswith("#") or ln in skip:
            continue
        cat = c.line_cat.get(ln, "library")
        fs.counts[cat] += 1
        fs.lines += 1
        if len(fs.examples[cat]) < 3 and cat != "library" and len(stripped) > 12:
            fs.examples[cat].append(f"{path.name}:{ln}: {stripped[:90]}")
    return fs


def code_surface(paths, report=None) -> CodeSurface:
    """Classify the lines of ``paths`` (pipeline and transformer source files)."""
    surface = CodeSurface()
    for p in dict.fromkeys(str(p) for p in paths if p):
        if not Path(p).is_file():
            continue
        fs = classify_file(p)
        surface.files.append(fs)
        for k, v in fs.counts.items():
            surface.counts[k] += v
        surface.total += fs.lines
    if report is not None:
        surface.port_estimate_lines, surface.port_estimate_reason = port_estimate(surface, report)
    return surface


def port_estimate(surface: CodeSurface, report) -> tuple[int, str]:
    """Lines of new code a port needs beyond the wrappers cache-dit/diffusers provide:

    * the block loops (``adapter`` lines of the transformer file) again as a patch functor when
      the loop does extra work, or as a hand-written BlockAdapter when cache-dit has none;
    * the ``attention_parallel`` lines again as a context-parallel attention path when neither
      diffusers' ``_cp_plan`` nor a cache-dit CP planner covers the class;
    * nothing for ``library``, ``scheduler_latent`` (the pipeline keeps its loop) and glue.
    """
    parts, total = [], 0
    transformer_files = {Path(f).name for f in report.source_files}
    loop_lines = sum(f.counts["adapter"] for f in surface.files if Path(f.path).name in transformer_files)
    if report.loop_extra_work:
        total += loop_lines
        parts.append(f"{loop_lines} loop lines as a patch functor (loop does extra work)")
    if not report.support.cache_dit_adapter:
        n = 10 + 5 * len(report.block_lists)
        total += n
        parts.append(f"~{n} lines of BlockAdapter registration (cache-dit has none)")
    if not (report.support.diffusers_cp_plan or report.support.cache_dit_cp_planner):
        n = sum(f.counts["attention_parallel"] for f in surface.files if Path(f.path).name in transformer_files)
        total += n
        parts.append(f"{n} attention lines for a context-parallel plan (no _cp_plan or CP planner)")
    return total, "; ".join(parts) or "wrappers suffice: registered adapter, no loop work, CP plan available"
