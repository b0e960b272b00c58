"""Configurations the benchmark stage derives itself, beside those of the earlier stages:

- ``attention_backend`` (card ``benchmark.attention_backend``): ``"auto"`` measures the attention
  backends diffusers' dispatcher offers on this device on the pipeline's first transformer call
  (:mod:`ditbook.benchmark.attention_backends`), writes the table to
  ``benchmark/attention_backends.json`` and adds the fastest correct backend as a configuration
  (family ``attention``), so it is timed end to end and its images judged like every other row —
  only when an independent confirmation round agrees with the pick (within 3%);
  a backend name adds that backend without the table; None/false: off;
- ``fp8`` (card ``benchmark.fp8``): each configuration, the baseline included, is measured a
  second time with the block linears in fp8 (:mod:`ditbook.accel.fp8`, torchao float8), judged
  by its family's gates (fp8 alone: the cache gates — it changes the result by design); with
  ``compile`` the fp8 twins are compiled too (``cache+fp8+compile``). Where the device has no fp8
  one ``fp8`` row records the refusal and its reason;
- ``compile`` (card ``benchmark.compile``): each configuration, the baseline included, is
  measured a second time compiled (regional, :mod:`ditbook.accel.compiled`), with its
  one-time compile cost in ``params.compile``; see :func:`~ditbook.accel.compiled.compile_options`.
"""

from __future__ import annotations

import json
from typing import Callable

from ..configuration import Config, baseline_config
from ..settings import FAMILY_SECTION, SECTIONS, Gates
from .attention_backends import backend_config, measure_pipeline_backends
from ..accel.compiled import compile_options, compiled_config

BACKENDS_FILE = "attention_backends.json"


def backend_gate(card) -> Gates:
    """The gates that judge another attention backend: the card's section for the ``attention``
    family (``settings.FAMILY_SECTION``); that section's defaults without a card."""
    name = FAMILY_SECTION["attention"]
    section = getattr(card, name, None) if card is not None else None
    return section.gates if section is not None else SECTIONS[name]().gates


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
    psnr = backend_gate(ctx.card).psnr  # the card's gates, not the default ones
    measure_kw = {"min_psnr": psnr, "min_kernel_psnr": psnr, **measure_kw}
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


def fp8_configs(pipe, configs: list[Config], *, log: Callable[[str], None] = print) -> list[Config]:
    """fp8 twins of the baseline and of ``configs``, or, where fp8 cannot run, one ``fp8`` row whose
    apply raises the refusal (so the table records it and its reason)."""
    from ..accel.fp8 import Fp8Refused, fp8_config, fp8_refusal_for

    why = fp8_refusal_for(pipe.transformer)
    if why:
        log(f"fp8: refused: {why}")

        def refuse(_pipe):
            raise Fp8Refused(why)
        return [Config("fp8", "fp8", refuse, params={"fp8": {"refused": why}}, notes="refused on this device")]
    # a configuration already in fp8 (the cache stage's fp8 composition) gets no second twin
    return [fp8_config(c) for c in [baseline_config()] + list(configs) if "fp8" not in c.params]


def derived_configs(ctx, pipe, configs: list[Config], *, compile=None, attention_backend=None, fp8=None,
                    log: Callable[[str], None] = print, **measure_kw) -> tuple[list[Config], dict | None]:
    """``configs`` plus the attention backend pick, with ``fp8`` (None: the card's
    ``benchmark.fp8``) an fp8 twin of the baseline and of every configuration, and with
    ``compile`` a compiled twin of all of them. Returns (configurations, backend table or None)."""
    added, table = attention_backend_configs(ctx, pipe, attention_backend, log=log, **measure_kw)
    out = list(configs) + added
    if fp8 is None:
        fp8 = bool(getattr(getattr(getattr(ctx, "card", None), "benchmark", None), "fp8", False))
    if fp8:
        out += fp8_configs(pipe, out, log=log)
    opts = compile_options(compile)
    if opts is not None:
        out += [compiled_config(c, **opts) for c in [baseline_config()] + out if c.params.get("fp8", {}).get("refused") is None]
    return out, table


__all__ = ["BACKENDS_FILE", "attention_backend_configs", "backend_gate", "derived_configs", "fp8_configs"]
