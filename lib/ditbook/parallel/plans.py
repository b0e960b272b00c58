"""Parallel plans by name: what a plan asks for, parsed from names like ``ulysses2`` or
``cfg2_ulysses2+cache``.

A plan is one degree per parallel technique (each ``ditbook.accel`` kind names its token: ``cfg``,
``ulysses``, ``ring``, ``usp`` (ring R x ulysses U), ``tp``, ``vae``, ``te``), joined by ``_``, plus
options after ``+`` (``cache``: cache-dit DBCache, decisions agreed across ranks; ``compile``: regional
torch.compile; ``graph``: CUDA graphs, with +cache only for a static schedule). ``single`` is the
one-process baseline. The world size is the product of the degrees of the kinds that take ranks of
their own, or the degree of a kind that rides on the plan's ranks (``vae<N>``, ``te<N>``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod

from .. import accel
from ..accel import plan_name  # noqa: F401 (the plan name of given degrees, in the registry's order)

_PART = re.compile(r"^([a-z]+)(\d+)(?:x(\d+))?$")
OPTIONS = ("cache", "compile", "graph")


class PlanNameError(ValueError):
    pass


@dataclass(frozen=True)
class PlanSpec:
    name: str
    degrees: dict = field(default_factory=dict, compare=False, hash=False)  # token -> degree (> 1)
    cache: bool = False
    compile: bool = False
    graph: bool = False
    options: dict = field(default_factory=dict, compare=False, hash=False)

    def degree(self, token: str) -> int:
        return self.degrees.get(token, 1)

    def __getattr__(self, name: str) -> int:  # spec.cfg, spec.tp, ...: a registered token's degree
        if not name.startswith("_") and name in {t.token for t in accel.parallel_kinds()}:
            return self.degrees.get(name, 1)
        raise AttributeError(name)

    @property
    def cp(self) -> int:
        """Context-parallel degree (ranks that share one sequence)."""
        return self.degree("ulysses") * self.degree("ring")

    @property
    def uses_cp(self) -> bool:
        return self.cp > 1

    @property
    def world_size(self) -> int:
        kinds = {t.token: t for t in accel.parallel_kinds()}
        core = prod(d for tok, d in self.degrees.items() if kinds[tok].multiplies)
        return max([core] + [d for tok, d in self.degrees.items() if not kinds[tok].multiplies])

    def kinds(self) -> list:
        """The parallel techniques this plan uses, in their order."""
        return [t for t in accel.parallel_kinds() if self.degree(t.token) > 1]

    def to_dict(self) -> dict:
        return {"name": self.name, **{t.token: self.degree(t.token) for t in accel.parallel_kinds()},
                "cache": self.cache, "compile": self.compile, "graph": self.graph, "world_size": self.world_size}


def _options(name: str, opts: list[str]) -> dict:
    flags = dict.fromkeys(OPTIONS, False)
    for o in opts:
        if o not in flags:
            raise PlanNameError(f"plan {name!r}: unknown option '+{o}' (known: {', '.join('+' + f for f in flags)})")
        if flags[o]:
            raise PlanNameError(f"plan {name!r}: +{o} given twice")
        flags[o] = True
    return flags


def parse_plan(name: str) -> PlanSpec:
    """``cfg2_ulysses2+cache`` -> PlanSpec(degrees={cfg: 2, ulysses: 2}, cache=True)."""
    raw = name.strip()
    if not raw:
        raise PlanNameError("empty plan name")
    base, *opts = raw.split("+")
    flags = _options(name, opts)
    if base == "single":
        return PlanSpec(name=raw, **flags)
    degrees: dict = {}
    tokens = {t.token: t for t in accel.parallel_kinds()}
    known = ", ".join(t.grammar() for t in tokens.values())
    for part in base.split("_"):
        m = _PART.match(part)
        technique = tokens.get(m.group(1)) if m else None
        if technique is None:
            raise PlanNameError(f"plan {name!r}: cannot read {part!r}; expected one of {known}, single")
        try:
            got = technique.parse_part(int(m.group(2)), int(m.group(3)) if m.group(3) else None)
        except ValueError as exc:
            raise PlanNameError(f"plan {name!r}: {exc}") from None
        if set(got) & set(degrees):
            raise PlanNameError(f"plan {name!r}: {technique.token} given twice")
        degrees.update(got)
    for tok, n in degrees.items():
        if n < 1:
            raise PlanNameError(f"plan {name!r}: {tok} must be >= 1")
        why = tokens[tok].degree_problem(n)
        if why:
            raise PlanNameError(f"plan {name!r}: {why}")
    core = prod(n for tok, n in degrees.items() if tokens[tok].multiplies)
    for tok, n in degrees.items():
        if not tokens[tok].multiplies and n > 1 and core > 1 and n != core:
            raise PlanNameError(f"plan {name!r}: {tok}{n} runs on the plan's {core} ranks, so it is {tok}{core}")
    return PlanSpec(name=raw, degrees={k: v for k, v in degrees.items() if v > 1}, **flags)


def refusal(spec: PlanSpec, device: str | None = None) -> str | None:
    """Why ditbook will not launch this plan (on ``device``, when given; each technique is asked); None when it can."""
    for technique in spec.kinds():
        why = technique.refusal(spec, device)
        if why:
            return why
    return None


__all__ = ["OPTIONS", "PlanNameError", "PlanSpec", "parse_plan", "plan_name", "refusal"]
