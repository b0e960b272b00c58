"""Configurations the benchmark derives itself, beside those of the earlier stages: every
pipeline-wide technique (``ditbook.accel``: attention backend, fp8, compile) that the card asks for
(its ``requested(card)``) adds its rows, in the techniques' ``order``, each seeing the rows before it
(so a compiled twin is made of every fp8 row too). Nothing here names a technique."""

from __future__ import annotations

import json
from typing import Callable

from .. import accel
from ..configuration import Config


def pipeline_techniques() -> list:
    """The registered pipeline-wide techniques, in their composition order."""
    return sorted((t for t in accel.techniques() if issubclass(t, accel.PipelineTechnique)), key=lambda t: t.order)


def derived_configs(ctx, pipe, configs: list[Config], *, log: Callable[[str], None] = print,
                    **measure_kw) -> list[Config]:
    """``configs`` followed by the rows each requested pipeline-wide technique adds."""
    out = list(configs)
    for technique in pipeline_techniques():
        settings = technique.requested(ctx.card)
        if settings is not None:
            out += technique.variants(ctx, pipe, out, settings, log=log, **measure_kw)
    return out


def measured_table(run, name: str) -> dict | None:
    """A table a technique measured and wrote into the benchmark's folder (``attention_backends.json``)."""
    path = run.stage_dir("benchmark") / name
    return json.loads(path.read_text()) if path.is_file() else None


__all__ = ["derived_configs", "measured_table", "pipeline_techniques"]
