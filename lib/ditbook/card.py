"""Model cards: the schema, ``${VAR}`` expansion, and the gate check.

A card is a YAML file that names a model on local disk and the classes that run it. The gate
check refuses to go on while anything is missing or wrong, with one message listing every
problem and the card field to fill; it never guesses a default path or class.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from . import hooks
from .settings import (DEVICES, DTYPES, SECTIONS, BenchmarkSettings, CacheSettings, Generation,  # noqa: F401
                       InspectSettings, ParallelSettings, RuntimeSettings, parse_section)

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

KNOWN_TOP_LEVEL = {
    "name", "path", "pipeline", "transformer", "generation", "runtime",
    "cache", "parallel", "benchmark", "inspect", "approved_plan", "notes",
}
OVERRIDE_SHORTHANDS = {"device": "runtime.device", "dtype": "runtime.dtype", "steps": "generation.steps",
                      "height": "generation.height", "width": "generation.width", "seeds": "generation.seeds",
                      "prompts": "generation.prompts"}


class CardError(ValueError):
    """The card file cannot be read or does not follow the schema."""


class GateError(CardError):
    """The gate check failed; ``problems`` lists each missing or wrong item."""

    def __init__(self, card_path: str | Path, problems: list[str]):
        self.card_path = str(card_path)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"model card {self.card_path} did not pass the gate check "
            f"({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{lines}"
        )


@dataclass
class ClassSpec:
    """Where a class comes from: ``source`` is ``diffusers``, a module path, or a .py file."""

    cls: str | None
    source: str | None
    subfolder: str | None = None

    def to_dict(self) -> dict:
        d = {"class": self.cls, "source": self.source}
        if self.subfolder is not None:
            d["subfolder"] = self.subfolder
        return d


@dataclass
class ModelCard:
    """A parsed model card. ``raw`` keeps the expanded YAML mapping as written; the sections are
    the typed objects of ``ditbook.settings`` (``card.cache.gates.psnr``, ``card.generation.steps``)."""

    name: str
    path: Path | None
    pipeline: ClassSpec
    transformer: ClassSpec
    generation: Generation
    runtime: RuntimeSettings
    cache: CacheSettings
    parallel: ParallelSettings
    benchmark: BenchmarkSettings
    inspect: InspectSettings
    approved_plan: str | None
    card_path: Path
    raw: dict

    @property
    def card_dir(self) -> Path:
        return self.card_path.parent

    def resolve_source(self, source: str) -> str:
        """A file source relative to the card's folder becomes absolute; modules stay as they are."""
        if _is_file_source(source):
            p = Path(source).expanduser()
            return str(p if p.is_absolute() else (self.card_dir / p).resolve())
        return source

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        d["path"] = str(self.path) if self.path else None
        d["card_path"] = str(self.card_path)
        return d

    def content_hash(self) -> str:
        """Hash of what the card asks for, without the approval itself."""
        d = copy.deepcopy(self.raw)
        d.pop("approved_plan", None)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def with_overrides(self, overrides: dict[str, Any]) -> "ModelCard":
        """A copy with dotted ``key=value`` overrides applied (``generation.steps=4``)."""
        return _from_mapping(apply_overrides(self.raw, overrides), self.card_path)


def override_key(key: str) -> str:
    """The dotted card key an override names (``steps`` -> ``generation.steps``)."""
    return OVERRIDE_SHORTHANDS.get(key, key)


def apply_overrides(raw: dict, overrides: dict[str, Any] | None) -> dict:
    """A copy of a card mapping with dotted overrides set (unknown keys are left for the schema
    check to refuse, naming the key)."""
    raw = copy.deepcopy(raw)
    for key, value in (overrides or {}).items():
        key = override_key(key)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise CardError(f"override {key!r}: {part!r} is not a mapping in the card")
        node[parts[-1]] = value
    return raw


def _is_file_source(source: str) -> bool:
    return source.endswith(".py") or "/" in source or os.sep in source


ENV_FIELDS = ("path", "pipeline.source", "transformer.source")  # where ${VAR} is expanded (README: paths)
MAX_CARD_VALUES = 100_000  # values a card may hold once its YAML aliases are expanded


def _expand_str(value: str, missing: list[str] | None) -> str:
    def sub(m: re.Match) -> str:
        var = m.group(1)
        if var not in os.environ:
            if missing is not None:
                missing.append(var)
            return m.group(0)
        return os.environ[var]
    return _ENV_RE.sub(sub, value)


def expand_env(value: Any, missing: list[str] | None = None) -> Any:
    """A copy of a card mapping with ``${VAR}`` expanded in the fields documented for it
    (``ENV_FIELDS``: the model folder and the classes' source files); unknown variables are
    recorded. Every other string — a prompt, a note — is the user's text as written."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for field in ENV_FIELDS:
        *parents, leaf = field.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node = None
                break
            node[part] = dict(node[part])  # copy only the path to the expanded field
            node = node[part]
        if node is not None and isinstance(node.get(leaf), str):
            node[leaf] = _expand_str(node[leaf], missing)
    return out


def _expanded_size(node, seen: dict) -> int:
    """How many values ``node`` stands for once every alias is expanded (linear in the nodes)."""
    key = id(node)
    if key not in seen:
        seen[key] = 1  # a recursive alias counts once
        children = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else []
        flat = [c for pair in children for c in pair] if isinstance(node, yaml.MappingNode) else children
        seen[key] = 1 + sum(_expanded_size(c, seen) for c in flat)
    return seen[key]


def _bounded_load(text: str, path: Path):
    """``yaml.safe_load`` that refuses a card whose aliases expand to more than
    ``MAX_CARD_VALUES`` values (an alias bomb), before anything is built from it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_CARD_VALUES:
            raise CardError(f"model card {path}: its YAML aliases expand to {size:,} values, more than "
                            f"{MAX_CARD_VALUES:,}; write the values out instead of nesting aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_card_mapping(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CardError(f"model card not found: {path} (pass the path of a models/<name>.yaml file)")
    try:
        data = _bounded_load(path.read_text(), path)
    except yaml.YAMLError as exc:
        raise CardError(f"model card {path} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CardError(f"model card {path} must be a YAML mapping at the top level, got {type(data).__name__}")
    return data


def load_card(path: str | Path, overrides: dict[str, Any] | None = None) -> ModelCard:
    """Read and expand a card with its overrides. Schema errors (every section's unknown keys and
    wrong types, see ``ditbook.settings``) raise ``CardError``; run ``gate_check`` for the gate."""
    path = Path(path).resolve()
    data = read_card_mapping(path)
    return _from_mapping(apply_overrides(data, overrides), path)


def _spec(data: dict, key: str) -> ClassSpec:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        return ClassSpec(None, None)
    return ClassSpec(section.get("class"), section.get("source"), section.get("subfolder"))


def parse_mapping(data: dict, card_path: Path) -> tuple[ModelCard, list[tuple[str, str]]]:
    """The card and every schema problem of its sections as ``(dotted key, message)``; a wrong
    value is replaced by its default in the returned card (which must then not be run)."""
    raw = expand_env(copy.deepcopy(data))
    sections, problems = {}, []
    for name, cls in SECTIONS.items():
        sections[name], found = parse_section(cls, raw.get(name), name)
        problems += found
    path_value = raw.get("path")
    path = None
    if isinstance(path_value, str) and path_value and not _ENV_RE.search(path_value):
        p = Path(path_value).expanduser()
        path = p if p.is_absolute() else (card_path.parent / p).resolve()
    name = raw.get("name") or card_path.stem
    card = ModelCard(
        name=str(name),
        path=path,
        pipeline=_spec(raw, "pipeline"),
        transformer=_spec(raw, "transformer"),
        approved_plan=raw.get("approved_plan"),
        card_path=card_path,
        raw=raw,
        **sections,
    )
    return card, problems


def _from_mapping(data: dict, card_path: Path) -> ModelCard:
    card, problems = parse_mapping(data, card_path)
    if problems:
        raise CardError(f"{card_path}: " + "; ".join(f"{k}: {m}" for k, m in problems))
    return card


IMPORT_TIMEOUT_ENV = "DITBOOK_IMPORT_TIMEOUT"  # seconds a source may take to import (default below)
IMPORT_TIMEOUT = 300.0


def import_timeout() -> float:
    text = os.environ.get(IMPORT_TIMEOUT_ENV, "").strip()
    try:
        return float(text) if text else IMPORT_TIMEOUT
    except ValueError:
        raise CardError(f"{IMPORT_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


def import_class(source: str, cls_name: str):
    """Import ``cls_name`` from a diffusers module, any module path, or a .py file, within
    ``$DITBOOK_IMPORT_TIMEOUT`` seconds (300): a source that never finishes importing raises
    ``TimeLimitExceeded`` naming the file instead of waiting forever."""
    from .processes import time_limit

    seconds = import_timeout()
    with time_limit(seconds, f"importing {source} did not finish within {seconds:g}s (it may wait forever at import; "
                             f"set {IMPORT_TIMEOUT_ENV} to allow longer)"):
        module = _import_source(source)
        try:
            return getattr(module, cls_name)  # a lazy module (diffusers) imports the class's file here
        except AttributeError:
            raise ImportError(f"{source} has no class {cls_name!r}") from None


def _import_source(source: str):
    if not _is_file_source(source):
        return importlib.import_module(source)
    file = Path(source)
    mod_name = f"ditbook_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import a module from {file}")
    module = importlib.util.module_from_spec(spec)
    entry = hooks.set_item(sys.modules, mod_name, module)  # an import: stays unless the file fails
    # sibling files of third-party code import each other by plain name
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        entry.remove()
        raise
    finally:
        if sys.path and sys.path[0] == str(file.parent):
            sys.path.pop(0)
    return module


def parse_overrides(items: list[str] | None) -> dict:
    """``-p key=value`` pairs; values are read as YAML scalars (``4`` is an int, ``true`` a bool)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise CardError(f"-p expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        if not value.strip():  # YAML reads "" as null, which would quietly put back the default
            raise CardError(f"-p {item!r}: the value is empty; give a value (write null to ask for the default)")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _path_problems(card: ModelCard) -> list[str]:
    """The model folder: present, existing, a folder."""
    problems: list[str] = []
    path_value = card.raw.get("path")
    if not path_value:
        problems.append("path: missing — set 'path' to the local folder of the model (absolute, ${VAR}, or relative to the card)")
    elif card.path is not None and not card.path.exists():
        problems.append(f"path: {card.path} does not exist — fix 'path' or create the model folder")
    elif card.path is not None and not card.path.is_dir():
        problems.append(f"path: {card.path} is not a folder — 'path' must name the saved pipeline's folder")
    return problems


def _class_problems(card: ModelCard) -> list[str]:
    """The pipeline and transformer classes: named, with a source that imports."""
    problems: list[str] = []
    for key in ("pipeline", "transformer"):
        section = card.raw.get(key)
        spec = getattr(card, key)
        if not isinstance(section, dict):
            problems.append(f"{key}: missing — add '{key}: {{class: ..., source: ...}}'")
            continue
        if not spec.cls:
            problems.append(f"{key}.class: missing — name the {key} class (e.g. {'FluxPipeline' if key == 'pipeline' else 'FluxTransformer2DModel'})")
        if not spec.source:
            problems.append(f"{key}.source: missing — 'diffusers', a module path, or the .py file that defines {spec.cls or 'the class'}")
        if not (spec.cls and spec.source):
            continue
        source = card.resolve_source(spec.source)
        if _is_file_source(spec.source) and not Path(source).is_file():
            problems.append(f"{key}.source: file {source} does not exist")
            continue
        try:
            import_class(source, spec.cls)
        except ModuleNotFoundError as exc:
            problems.append(f"{key}.source: module {spec.source!r} cannot be imported ({exc})")
        except ImportError as exc:
            problems.append(f"{key}.class: {exc}")
        except TimeoutError as exc:
            problems.append(f"{key}.source: {exc}")
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the user's file raised, or called sys.exit(), while importing
            problems.append(f"{key}.source: importing {source} raised {type(exc).__name__}: {exc}")
    return problems


def gate_problems(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[ModelCard | None, list[str]]:
    """Every problem that stops a run, each naming the card field to fill. Runs no model code
    beyond importing the named classes."""
    problems: list[str] = []
    try:
        data = read_card_mapping(path)
    except CardError as exc:
        return None, [str(exc)]
    missing_vars: list[str] = []
    expand_env(data, missing_vars)
    for var in sorted(set(missing_vars)):
        problems.append(f"environment variable ${{{var}}} used in the card is not set (export {var}=...)")
    try:
        card, schema = parse_mapping(apply_overrides(data, overrides), Path(path).resolve())
    except CardError as exc:
        return None, problems + [str(exc)]
    from_p = {override_key(k) for k in (overrides or {})}
    for key, msg in schema:
        by_p = any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in from_p)
        problems.append(f"{key}: {msg}" + (" (set by -p)" if by_p else ""))

    unknown = set(card.raw) - KNOWN_TOP_LEVEL
    if unknown:
        problems.append(f"unknown top-level field(s) {sorted(unknown)}; known: {sorted(KNOWN_TOP_LEVEL)}")
    problems += _path_problems(card)
    problems += _class_problems(card)

    if not card.generation.prompts and not any(k == "generation.prompts" for k, _ in schema):
        problems.append("generation.prompts: missing — list at least one prompt")
    return card, problems


def gate_check(path: str | Path, overrides: dict[str, Any] | None = None) -> ModelCard:
    """Load a card and raise ``GateError`` listing every problem, or return the card."""
    card, problems = gate_problems(path, overrides)
    if problems or card is None:
        raise GateError(path, problems)
    return card


def write_card(path: str | Path, data: dict) -> Path:
    """Write a card mapping back to YAML (used by the intake form and ``ditbook approve``)."""
    path = Path(path)
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


def _yaml_scalar(value: Any) -> str:
    """``value`` as YAML text that reads back as the same value."""
    if isinstance(value, str):
        try:
            if value and yaml.safe_load(value) == value and "#" not in value and "\n" not in value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value)


def _spliced(text: str, key: str, value: Any) -> str:
    """``text`` with the top-level ``key`` set to ``value``, every other character untouched:
    the old value's span (from the YAML parser's marks) is replaced, or the field is added at
    the end of the mapping — inside its braces when the card is written in flow style."""
    root = yaml.compose(text)
    new = _yaml_scalar(value)
    if root is None:
        return text.rstrip("\n") + ("\n" if text.strip() else "") + f"{key}: {new}\n"
    if not isinstance(root, yaml.MappingNode):
        raise CardError("a card must be a YAML mapping at the top level")
    for k, v in root.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            a, b = v.start_mark.index, v.end_mark.index
            if isinstance(v, yaml.ScalarNode) and v.value == "" and a == b:
                new = " " + new  # `key:` with no value
            return text[:a] + new + text[b:]
    if root.flow_style:  # after the last value (a comment may follow it), or just inside `{`
        at = root.value[-1][1].end_mark.index if root.value else root.start_mark.index + 1
        return text[:at] + (", " if root.value else "") + f"{key}: {new}" + text[at:]
    return text.rstrip("\n") + "\n" + f"{key}: {new}\n"


def set_card_field(path: str | Path, key: str, value: Any) -> None:
    """Set one top-level field in a card file and change nothing else: every comment (one on the
    field's own line included), the order, the quoting and the layout, block or flow style, stay
    as written. The file is replaced atomically, and only when it reads back as the card with
    that one change; else ``CardError`` and the file is untouched."""
    path = Path(path)
    text = path.read_text()
    try:
        before = yaml.safe_load(text) or {}
        new = _spliced(text, key, value)
        after = yaml.safe_load(new)
    except yaml.YAMLError as exc:
        raise CardError(f"model card {path} is not valid YAML: {exc}") from exc
    if not isinstance(before, dict) or after != {**before, key: value}:
        raise CardError(f"cannot write {key} into {path} without changing the rest of the card")
    from .files import atomic_write_text

    atomic_write_text(path, new)


__all__ = [
    "CardError", "GateError", "ClassSpec", "Generation", "ModelCard",
    "load_card", "parse_mapping", "apply_overrides", "override_key", "gate_check", "gate_problems", "import_class", "expand_env",
    "write_card", "set_card_field", "asdict",
]
