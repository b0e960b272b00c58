"""The intake form: in JupyterLab, a failed gate check asks for each missing item and writes
the completed card. The logic is plain functions, tested headless; the widgets are a thin view."""

from __future__ import annotations

import copy
import re
from pathlib import Path

from ..card import gate_problems, read_card_mapping

FORM_FIELDS = ("path", "pipeline.class", "pipeline.source", "transformer.class", "transformer.source")
_FIELD_RE = re.compile(r"^(path|pipeline\.class|pipeline\.source|transformer\.class|transformer\.source|pipeline|transformer)\b")


def fields_to_ask(problems: list[str]) -> list[str]:
    """The form fields that the gate's problems name (a missing section asks for both of its fields)."""
    out: list[str] = []
    for p in problems:
        m = _FIELD_RE.match(p)
        if not m:
            continue
        name = m.group(1)
        names = [f"{name}.class", f"{name}.source"] if name in ("pipeline", "transformer") else [name]
        out += [n for n in names if n not in out]
    return out


def _fill(data, answers: dict[str, str]) -> None:
    """Set each non-empty answer at its dotted key in ``data`` (a dict or a round-trip mapping),
    creating the sections it needs."""
    for key, value in answers.items():
        if value is None or str(value).strip() == "":
            continue
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = str(value).strip()


def complete_card(raw: dict, answers: dict[str, str]) -> dict:
    """The card mapping with the non-empty answers filled in (dotted keys)."""
    data = copy.deepcopy(raw)
    _fill(data, answers)
    return data


def _round_trip_yaml():
    from ruamel.yaml import YAML

    y = YAML()  # round-trip mode: comments, key order, quoting and flow style survive a rewrite
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long line the user wrote
    return y


def complete_card_text(text: str, answers: dict[str, str]) -> str:
    """The card's YAML text with the non-empty answers filled in, its comments and layout kept
    (ruamel.yaml round trip); a missing section is added at the end of the mapping."""
    import io

    y = _round_trip_yaml()
    data = y.load(text) if text.strip() else None
    if data is None:
        from ruamel.yaml.comments import CommentedMap

        data = CommentedMap()
    _fill(data, answers)
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def save_answers(card_path: str | Path, answers: dict[str, str], out_path: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the completed card (to ``out_path`` or over the card), keeping its comments and
    layout, and re-run the gate."""
    card_path = Path(card_path)
    if card_path.is_file():
        read_card_mapping(card_path)  # a card that is not a YAML mapping is refused with its reason
        text = card_path.read_text()
    else:
        text = ""
    target = Path(out_path or card_path)
    target.write_text(complete_card_text(text, answers))
    _, problems = gate_problems(target)
    return target, problems


def card_form(card_path: str | Path, problems: list[str]):
    """An ipywidgets form asking for each item the gate found missing or wrong."""
    import ipywidgets as w

    asked = fields_to_ask(problems) or list(FORM_FIELDS)
    inputs = {f: w.Text(description=f, placeholder=f"value for {f}", layout=w.Layout(width="640px"),
                        style={"description_width": "140px"}) for f in asked}
    out = w.Output()
    button = w.Button(description="Write card and re-check", button_style="primary")

    def on_click(_):
        out.clear_output()
        target, left = save_answers(card_path, {k: v.value for k, v in inputs.items()})
        with out:
            if left:
                print(f"wrote {target}; still to fix:\n" + "\n".join(f"  - {p}" for p in left))
            else:
                print(f"wrote {target}; the gate check passes — re-run the notebook")

    button.on_click(on_click)
    problems_box = w.HTML("<b>The gate check stopped this run:</b><ul>" + "".join(f"<li>{p}</li>" for p in problems) + "</ul>")
    return w.VBox([problems_box, *inputs.values(), button, out])
