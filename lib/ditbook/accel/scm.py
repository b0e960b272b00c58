"""cache-dit step computation masks (SCM): a fixed list of which steps compute (1) and which
reuse the cache (0); "static" always reuses on masked steps, "dynamic" still checks the DBCache
threshold there. TaylorSeer (``taylorseer_order`` 1 or 2) extrapolates the cached residual across
the skipped steps. The grid places the computed steps where a flow model changes most
(:func:`spaced_mask`), from half the steps computed down to a quarter, each with TaylorSeer order 2
and without (``benchmarks/schedule_quality.py`` measures them against evenly spaced masks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import register
from .technique import CacheTechnique
from .dbcache import enable_dbcache


def spaced_mask(steps: int, warmup: int, computed: int) -> tuple[int, ...]:
    """``warmup`` computed steps, then the rest of the ``computed`` budget spread with a gap that
    grows linearly towards the end, the last step always computed."""
    if computed > steps or warmup >= computed:
        raise ValueError(f"need warmup < computed <= steps, got {warmup}, {computed}, {steps}")
    mask = [1] * warmup + [0] * (steps - warmup)
    mask[-1] = 1
    rest = computed - warmup - 1  # computed steps strictly between the warm-up and the last step
    span = steps - 1 - warmup  # steps warmup .. steps-2 available
    total, acc = sum(range(1, rest + 2)), 0.0  # gaps grow linearly: weights 1, 2, ..., rest+1 partition the span
    for w in range(1, rest + 1):
        acc += w * span / total
        p = min(max(warmup - 1 + max(1, round(acc)), warmup), steps - 2)
        while mask[p] and p < steps - 2:
            p += 1
        mask[p] = 1
    return tuple(mask)


@dataclass
class SCMSettings:
    mask: list = field(default_factory=list)  # 1 compute, 0 cache; one entry per step
    policy: str = "static"
    Fn: int = 1
    threshold: float = 0.5
    taylorseer_order: int = 0  # 0: the cached residual is reused unchanged
    computed: int = 0  # the mask's computed steps (set from the mask): names masks apart in the rows

    def __post_init__(self):
        if self.mask:
            self.computed = int(sum(self.mask))


@register
class SCM(CacheTechnique):
    name = "scm"
    family = "cache-dit SCM step mask"
    Settings = SCMSettings

    @classmethod
    def enable(cls, pipe, adapter, config, steps=None):
        import cache_dit

        mask = list(config.mask)
        kwargs = dict(Fn_compute_blocks=config.Fn, Bn_compute_blocks=0, residual_diff_threshold=config.threshold,
                      max_warmup_steps=0, num_inference_steps=len(mask), steps_computation_mask=mask,
                      steps_computation_policy=config.policy)
        calibrator = (cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=config.taylorseer_order)
                      if config.taylorseer_order else None)
        return enable_dbcache(pipe, adapter, kwargs, calibrator)

    @classmethod
    def grid(cls, adapter, steps):
        # the gentlest budget first; only masks that skip a step (none for 3 steps or fewer)
        warm = 2 if steps >= 6 else 1
        budgets = sorted({max(warm + 2, round(steps * f)) for f in (0.5, 0.35, 0.25)}, reverse=True)
        return [SCMSettings(mask=list(spaced_mask(steps, warm, c)), policy="static", taylorseer_order=order)
                for c in budgets if warm < c < steps for order in (2, 0)]

    @classmethod
    def disabled(cls, adapter, steps):
        return SCMSettings(mask=[1] * steps, policy="static")
