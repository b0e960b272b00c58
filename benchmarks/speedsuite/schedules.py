"""Step schedules for cache-dit's DBCache with a steps computation mask (SCM), shared by the
quality check on the reference model (CPU) and the speed runs on full-size shapes (GPU), so the
schedule whose speed is reported is exactly the one whose quality was measured.

A schedule is static: the mask alone says which steps are computed in full; the other steps
reuse the cache (cache-dit's ``steps_computation_policy="static"``). Random weights never look
"similar enough" to a dynamic threshold, so only a static schedule gives a speed that transfers
from a random-weight shape to a trained model.

``ditbook`` schedules place the computed steps where a trained flow model changes most: a run of
early steps (structure), then computed steps spaced by a gap that grows towards the end, and the
last step always computed. TaylorSeer (order 1 or 2) extrapolates the cached residual across the
skipped steps instead of holding it constant.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ditbook.accel.scm import spaced_mask  # the cache stage's SCM grid places its masks the same way


@dataclass(frozen=True)
class Schedule:
    name: str
    mask: tuple[int, ...]
    taylorseer_order: int = 0  # 0: plain cache reuse
    Fn: int = 1
    Bn: int = 0
    owner: str = "ditbook"  # who proposes it: "cache-dit" (its predefined policies) or "ditbook"

    @property
    def computed(self) -> int:
        return sum(self.mask)

    @property
    def steps(self) -> int:
        return len(self.mask)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mask"] = "".join(map(str, self.mask))
        d["computed"] = self.computed
        return d

    def cache_config(self):
        from cache_dit import DBCacheConfig

        return DBCacheConfig(Fn_compute_blocks=self.Fn, Bn_compute_blocks=self.Bn, max_warmup_steps=0,
                             residual_diff_threshold=0.08, steps_computation_mask=list(self.mask),
                             steps_computation_policy="static", num_inference_steps=self.steps)

    def calibrator_config(self):
        if not self.taylorseer_order:
            return None
        from cache_dit import TaylorSeerCalibratorConfig

        return TaylorSeerCalibratorConfig(taylorseer_order=self.taylorseer_order)

    def enable(self, pipe) -> None:
        import cache_dit

        cache_dit.enable_cache(pipe, cache_config=self.cache_config(), calibrator_config=self.calibrator_config())

    def apply(self, pipe):
        """``bench.timing.Config`` protocol: switch on, return the undo."""
        import cache_dit

        self.enable(pipe)
        return lambda: cache_dit.disable_cache(pipe)


def cache_dit_policy(policy: str, steps: int, taylorseer_order: int = 0) -> Schedule:
    """cache-dit's predefined SCM policy (slow / medium / fast / ultra) as a static schedule."""
    from cache_dit import steps_mask

    mask = tuple(int(m) for m in steps_mask(total_steps=steps, mask_policy=policy))
    suffix = f"+TS{taylorseer_order}" if taylorseer_order else ""
    return Schedule(f"cache-dit-{policy}{suffix}", mask, taylorseer_order, owner="cache-dit")


def ditbook_schedule(steps: int, warmup: int, computed: int, taylorseer_order: int = 1) -> Schedule:
    suffix = f"+TS{taylorseer_order}" if taylorseer_order else ""
    return Schedule(f"ditbook-w{warmup}c{computed}{suffix}", spaced_mask(steps, warmup, computed), taylorseer_order)


def candidates(steps: int = 28, budgets=(10, 9, 8), warmups=(3, 4), orders=(1,)) -> list[Schedule]:
    """The schedules compared: cache-dit's policies (with and without TaylorSeer) and ditbook's
    spaced ones for each computed-step budget, warm-up length and TaylorSeer order."""
    out = [cache_dit_policy(p, steps) for p in ("slow", "medium", "fast", "ultra")]
    out += [cache_dit_policy(p, steps, 1) for p in ("fast", "ultra")]
    for computed in budgets:
        for warmup in (w for w in warmups if w < computed):  # at least one computed step after the warm-up
            for order in orders:
                out.append(ditbook_schedule(steps, warmup, computed, order))
    return out
