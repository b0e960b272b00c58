"""Ulysses (all-to-all) context parallelism: every rank holds a slice of the sequence; around each
attention the heads are exchanged so each rank attends over the whole sequence for its share of
the heads (cache-dit's, with the CP plan of ``ditbook.cp.plan``). The split is judged from the
block inputs every rank recorded (``cp.sharding.check_sharding``)."""

from __future__ import annotations

from . import plan_name, register
from .technique import Feasibility, NoSettings, ParallelTechnique


def ulysses_check(f, n: int, uneven: bool = False) -> tuple[bool, str]:
    """Heads and sequence under Ulysses ``n``. ``uneven`` (Ulysses without ring: the launch can set
    cache-dit's ``ulysses_anything``): a token count ``n`` does not divide is split into
    ``tensor_split`` shares (every rank one token at least) instead of refused."""
    if f.heads is None:
        return False, "head count unknown (inspection found no attention)"
    notes = []
    if f.heads % n:
        return False, (f"{f.heads} query heads not divisible by {n}: needs head padding "
                       f"(cache-dit ulysses_anything), not planned by ditbook")
    if f.kv % n:
        notes.append(f"{f.kv} KV heads not divisible by {n}: K/V repeated to the {f.heads} query heads "
                     f"before the all-to-all")
    s = f.seq_reason(n)
    counts = [c for c in (f.s_img, f.s_txt if f.joint else None) if c is not None]
    if s and uneven and all(c >= n for c in counts):
        notes.append(s + ": split unevenly (torch.tensor_split shares, cache-dit's ulysses_anything)")
    elif s:
        why = "uneven split needs cache-dit's ulysses_anything, which ring attention does not take" if not uneven \
            else "fewer tokens than ranks"
        return False, f"{s}: {why}"
    notes.append(f.cp_how())
    return True, "; ".join(notes)


@register
class Ulysses(ParallelTechnique):
    name = "ulysses"
    token = "ulysses"
    family = "Ulysses context parallel"
    Settings = NoSettings
    order = 20

    @classmethod
    def judge(cls, f, n: int) -> list[Feasibility]:
        if n == 1:
            return [Feasibility("ulysses", 1, True, "single", "the single-process baseline")]
        ok, why = ulysses_check(f, n, uneven=True)
        return [Feasibility("ulysses", n, ok, plan_name(ulysses=n), why)]
