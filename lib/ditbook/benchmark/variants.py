"""Configurations the benchmark stage derives itself, beside those of the earlier stages:

- ``attention_backend`` (card ``benchmark.attention_backend``): ``"auto"`` measures the attention
  backends diffusers' dispatcher offers on this device on the pipeline's first transformer call
  (:mod:`ditbook.benchmark.attention_backends`), writes the table to
  ``benchmark/attention_backends.json`` and adds the fastest correct backend as a configuration
  (family ``attention``), so it is timed end to end and its images judged like every other row —
  only when an independent confirmation round agrees with the pick (within 3%);
  a backend name adds that backend without the table; None/false: off;
- ``compile`` (card ``benchmark.compile``): each configuration, the baseline included, is
  measured a second time compiled (regional, :mod:`ditbook.benchmark.compiled`), with its
  one-time compile cost in ``params.compile``; see :func:`~ditbook.benchmark.compiled.compile_options`.
"""

from __future__ import annotations

import json
from typing import Callable

from ..configuration import Config, baseline_config
from .attention_backends import backend_config, measure_pipeline_backends
from .compiled import compile_options, compiled_config

BACKENDS_FILE = "attention_backends.json"


def attention_backend_configs(ctx, pipe, setting, *, log: Callable[[str], None] = print,
                              **measure_kw) -> tuple[list[Config], dict | None]:
    """The backend configuration(s) for ``setting`` and the measured table (None when not measured);
    ``measure_kw`` go to :func:`~ditbook.benchmark.attention_backends.measure_backends`."""
    if not setting:
        return [], None
    if setting != "auto":
        return [backend_config(str(setting))], None
    from ..render import call_kwargs, cases, make_generator

    _, prompt, seed = cases(ctx.card)[0]
    kwargs = call_kwargs(pipe, ctx.card)
    table = measure_pipeline_backends(pipe, lambda: pipe(prompt=prompt, generator=make_generator(seed), **kwargs),
                                      log=log, **measure_kw)
    data = table.to_dict()
    path = ctx.run.stage_dir("benchmark") / BACKENDS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    if not table.applicable:
        log(f"attention backend: {table.reason}")
        return [], data
    if table.pick is not None and not table.confirmed:
        log(f"attention backend: not applied: the confirmation round puts the pick {table.pick} at "
            f"{table.pick_over_fastest}x the fastest ({table.fastest_confirmed}), beyond "
            f"{table.confirm_tolerance:.0%}: timings on this device are not stable enough to choose")
        return [], data
    if table.pick is None or table.pick == table.default:
        log(f"attention backend: the default ({table.default}) is the fastest correct one; nothing to add")
        return [], data
    return [backend_config(table.pick, table)], data


def derived_configs(ctx, pipe, configs: list[Config], *, compile=None, attention_backend=None,
                    log: Callable[[str], None] = print, **measure_kw) -> tuple[list[Config], dict | None]:
    """``configs`` plus the attention backend pick and, with ``compile``, a compiled twin of the
    baseline and of every configuration. Returns (configurations, backend table or None)."""
    added, table = attention_backend_configs(ctx, pipe, attention_backend, log=log, **measure_kw)
    out = list(configs) + added
    opts = compile_options(compile)
    if opts is not None:
        out += [compiled_config(c, **opts) for c in [baseline_config()] + out]
    return out, table


__all__ = ["BACKENDS_FILE", "attention_backend_configs", "derived_configs"]
