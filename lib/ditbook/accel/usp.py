"""USP: ring x Ulysses context parallelism in one mesh (``usp<R>x<U>``: ring R, Ulysses U);
cache-dit's ring attention (its log-sum-exp taken from the flash SDPA kernel: CUDA only)."""

from __future__ import annotations

from . import plan_name, register
from .ring import ring_check
from .technique import Feasibility, NoSettings, ParallelTechnique
from .ulysses import ulysses_check


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@register
class Usp(ParallelTechnique):
    name = "usp"
    token = "usp"
    family = "ring x Ulysses context parallel"
    Settings = NoSettings
    order = 15  # before ulysses and ring: it names both degrees in one part

    @classmethod
    def grammar(cls) -> str:
        return "usp<R>x<U>"

    @classmethod
    def parse_part(cls, n: int, m: int | None) -> dict[str, int]:
        if m is None:
            raise ValueError("usp needs RxU, e.g. usp2x2")
        return {"ring": n, "ulysses": m}

    @classmethod
    def name_part(cls, degrees: dict[str, int]) -> str | None:
        if degrees.get("ring", 1) > 1 and degrees.get("ulysses", 1) > 1:
            return f"usp{degrees.pop('ring')}x{degrees.pop('ulysses')}"
        return None

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        """The split with the most Ulysses ranks where both the Ulysses and the ring part hold."""
        if n < 4:
            return [Feasibility("ulysses_x_ring", n, False, None, "needs at least 4 processes (2 x 2)")]
        for u in sorted(_divisors(n), reverse=True):
            r = n // u
            if u < 2 or r < 2:
                continue
            uok, uwhy = ulysses_check(f, u)
            rok, _ = ring_check(f, r)
            if uok and rok:
                return [Feasibility("ulysses_x_ring", n, True, plan_name(ring=r, ulysses=u), f"ring {r} x ulysses {u}; {uwhy}")]
        return [Feasibility("ulysses_x_ring", n, False, None,
                            f"no ring x ulysses split of {n} with heads and sequence divisible")]
