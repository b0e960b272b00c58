"""The approval of an integration plan: its hash, the weights' identity it covers, and the gate
every stage after inspection passes (``check_approval``).

The approved hash covers what the reviewer approves: the plan (``inspect`` writes it), the acceptance
gates (the card's ``cache.gates`` and ``parallel.gates`` after its overrides) and the weights' identity
(``weights_identity``: every file of the saved model by relative path, size and a digest of its
bytes — the whole file up to ``FULL_HASH_LIMIT``, sampled chunks above; no mtimes, so a fresh clone
or copy of the same weights keeps the approval). The hash is computed from the content only (no
timestamps, no paths), so the same model and card give the same hash on every run.

``check_approval(card, run)`` is what ``StageContext.require_approved_plan()`` calls: it also
refuses a run whose gates are looser than the approved ones (``-p cache.gates.psnr=5``) and a
model folder whose files changed since the plan was made, each with ``ApprovalError`` naming why.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .loading import is_weight_file

class ApprovalError(RuntimeError):
    """A stage after inspection was asked to run without an approved, current plan."""

PLAN_JSON = "plan.json"
PLAN_MD = "plan.md"
STAGE = "inspect"
FULL_HASH_LIMIT = 64 << 20  # files up to this size are hashed whole; larger ones by samples
SAMPLE_CHUNKS, SAMPLE_BYTES = 16, 1 << 20


def _file_digest(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:  # evenly spaced chunks, first and last included: retrained or swapped weights change them
            for i in range(SAMPLE_CHUNKS):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLE_CHUNKS - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _walk(root: Path):
    for base, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(names):
            if not name.startswith(".") and not name.endswith(".pyc"):
                yield Path(base) / name


def _model_files(folder: Path) -> list[Path]:
    """A saved pipeline: ``model_index.json``, the other files beside it and every file of the
    components it lists. Any other folder: its weight files (by suffix), wherever they are."""
    index = folder / "model_index.json"
    if not index.is_file():
        return [p for p in _walk(folder) if is_weight_file(p)]
    try:
        entries = json.loads(index.read_text())
    except ValueError:
        entries = {}
    comps = [k for k, v in entries.items() if not k.startswith("_") and isinstance(v, list) and v and v[0] is not None]
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]
    for c in comps:
        if (folder / c).is_dir():
            files += list(_walk(folder / c))
    return files


def weights_identity(folder, exclude=()) -> dict | None:
    """``{"files": {relative path: [size, digest]}, "digest": ...}`` of the model's files (see
    ``_model_files``; no run folders, bytecode caches or hidden files) without the ``exclude``
    paths (the card, which ``ditbook approve`` writes, when it lives there); None without a folder."""
    if folder is None or not Path(folder).is_dir():
        return None
    folder = Path(folder)
    skip = {Path(p).resolve() for p in exclude if p}
    files = {}
    for p in _model_files(folder):
        if p.resolve() in skip:
            continue
        size = p.stat().st_size
        files[p.relative_to(folder).as_posix()] = [size, _file_digest(p, size)]
    blob = json.dumps(files, sort_keys=True).encode()
    return {"files": files, "digest": hashlib.sha256(blob).hexdigest()[:16]}


def acceptance_gates(card) -> dict:
    """The gates the later stages apply, from the card's typed sections (settings' defaults
    without a card)."""
    from .settings import ALWAYS_CHECKED, SECTIONS

    sec = lambda name: getattr(card, name) if card is not None else SECTIONS[name]()  # noqa: E731
    return {"cache": sec("cache").gates.to_dict(), "parallel": sec("parallel").gates.to_dict(),
            "always": list(ALWAYS_CHECKED)}


def plan_hash(plan: dict) -> str:
    content = {k: v for k, v in plan.items() if k != "hash"}
    blob = json.dumps(content, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_plan(path: str | Path) -> dict:
    plan = json.loads(Path(path).read_text())
    plan["hash"] = plan_hash(plan)  # never trust a stored hash: recompute from the content
    return plan


def find_plan_file(card, run=None, outputs_root: str | Path | None = None) -> Path | None:
    """This run's ``inspect/plan.json`` if it has one, else the newest run of the model that does."""
    from .runs import RunFolder, latest_run

    if run is not None:
        run = run if isinstance(run, RunFolder) else RunFolder(run)
        if (run.stage_dir(STAGE, create=False) / PLAN_JSON).is_file():
            return run.stage_dir(STAGE, create=False) / PLAN_JSON
        if outputs_root is None:
            outputs_root = run.path.parent.parent
    if outputs_root is None:
        from .runs import outputs_dir

        outputs_root = outputs_dir()
    latest = latest_run(outputs_root, card.name, with_stage=STAGE)
    if latest is not None and (latest.stage_dir(STAGE, create=False) / PLAN_JSON).is_file():
        return latest.stage_dir(STAGE, create=False) / PLAN_JSON
    return None


def approve_command(card, plan_path: Path | None = None) -> str:
    """The command that approves the plan; it names the plan's run when one is known, so it works
    whatever outputs root the run used."""
    run = f" --run {Path(plan_path).parent.parent}" if plan_path is not None else ""
    return f"ditbook approve {card.card_path}{run}"


def check_approval(card, run) -> dict:
    """The plan when the card's ``approved_plan`` is its hash; else ``ApprovalError`` naming the
    command that approves it."""

    path = find_plan_file(card, run)
    if path is None:
        raise ApprovalError(f"no integration plan for {card.name}: run the inspect stage first "
                            f"(ditbook run {card.card_path} --stages inspect, or ditbook inspect {card.card_path}), "
                            f"then approve it with: {approve_command(card)}")
    plan = read_plan(path)
    if card.approved_plan != plan["hash"]:
        what = "has no approved plan" if not card.approved_plan else f"approves plan {card.approved_plan}"
        raise ApprovalError(f"{card.card_path} {what}, but the current plan ({path}) has hash {plan['hash']}; "
                            f"review it and run: {approve_command(card, path)}")
    again = (f"run the inspect stage again (ditbook run {card.card_path} --stages inspect) and approve the "
             f"new plan: {approve_command(card, path)}")
    looser = gates_looser_than_approved(card, plan)
    if looser:
        raise ApprovalError(f"the gates of this run are looser than the approved plan {plan['hash']}'s: "
                            f"{'; '.join(looser)}; {again}")
    changed = weights_changed(card, plan)
    if changed:
        raise ApprovalError(f"the model's weights changed since plan {plan['hash']} was approved "
                            f"({card.path}: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}); {again}")
    record_approval(run, card, plan)
    return plan


def record_approval(run, card, plan: dict) -> None:
    """Write the approval a stage just accepted into the run's ``run.json`` (``runs.approval_state``
    reads it: the one approval state of the stages and the report's checklist), even when the card
    was approved after the run began (``ditbook approve --run RUN``, then ``run --resume RUN``)."""
    if run is not None and run.exists():
        run.record_approval(card.approved_plan, plan["hash"], str(card.card_path))


def gates_looser_than_approved(card, plan: dict) -> list[str]:
    """``section.gates.field old -> new`` for each gate this card (with its overrides) sets
    looser than the approved plan's; stricter gates are within the approval."""
    from .settings import GATED_SECTIONS, Gates

    approved = plan.get("acceptance_gates") or {}
    out = []
    for sec in GATED_SECTIONS:
        if not isinstance(approved.get(sec), dict):
            out.append(f"{sec}.gates: not in the approved plan")
            continue
        try:
            ref = Gates.from_dict(approved[sec])
        except ValueError as exc:
            out.append(f"{sec}.gates: the approved plan's gates are not readable ({exc})")
            continue
        out += [f"{sec}.gates.{x}" for x in getattr(card, sec).gates.looser_than(ref)]
    return out


def weights_changed(card, plan: dict) -> list[str]:
    """Files of the model folder added, removed or changed since the plan was made."""
    then = (plan.get("weights") or {}).get("files")
    now = (weights_identity(card.path, [card.card_path]) or {}).get("files")
    if then is None and now is None:
        return []
    if then is None or now is None:
        return ["the model folder " + ("is gone" if now is None else "was not recorded in the plan")]
    return ([f"{f} added" for f in sorted(set(now) - set(then))] + [f"{f} removed" for f in sorted(set(then) - set(now))]
            + [f"{f} changed" for f in sorted(set(now) & set(then)) if list(now[f]) != list(then[f])])


def not_this_models_plan(card, plan: dict, plan_path: str | Path) -> str | None:
    """Why the plan belongs to another model than ``card`` (None when it is this card's): the
    model its plan or its run names, or weights that are not the card's model folder's."""
    from .runs import RunFolder

    named = {"the plan": plan.get("model")}
    run_json = Path(plan_path).parent.parent / "run.json"
    if run_json.is_file():
        named["its run"] = RunFolder(run_json.parent).read_meta().get("model")
    for where, model in named.items():
        if model is not None and model != card.name:
            return f"{where} is of model {model!r}, the card is {card.name!r}"
    if (plan.get("weights") or {}).get("files") is not None:
        changed = weights_changed(card, plan)
        if changed:
            return (f"its weights are not those of {card.path} "
                    f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''})")
    return None


def approve(card, plan_path: str | Path) -> str:
    """Write the plan's hash into the card as ``approved_plan``; returns the hash."""
    from .card import set_card_field

    h = read_plan(plan_path)["hash"]
    set_card_field(card.card_path, "approved_plan", h)
    return h
