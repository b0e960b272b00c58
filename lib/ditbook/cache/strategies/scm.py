"""cache-dit step computation masks (SCM): a fixed list of which steps compute (1) and which
reuse the cache (0), from ``cache_dit.steps_mask``; "dynamic" still checks the DBCache threshold
on masked steps, "static" always reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from .registry import Strategy, register
from .dbcache import enable_dbcache


@dataclass
class SCMSettings:
    mask: list = field(default_factory=list)  # 1 compute, 0 cache; one entry per step
    policy: str = "static"
    Fn: int = 1
    threshold: float = 0.5


@register
class SCM(Strategy):
    name = "scm"
    family = "cache-dit SCM step mask"
    Config = SCMSettings

    @classmethod
    def apply(cls, pipe, adapter, config, steps=None):
        mask = list(config.mask)
        kwargs = dict(Fn_compute_blocks=config.Fn, Bn_compute_blocks=0, residual_diff_threshold=config.threshold,
                      max_warmup_steps=0, num_inference_steps=len(mask), steps_computation_mask=mask,
                      steps_computation_policy=config.policy)
        return enable_dbcache(pipe, adapter, kwargs)

    @classmethod
    def grid(cls, adapter, steps):
        out = []
        warm = max(2, steps // 4)
        for every in (2, 3, 4):  # after warm-up, compute one step in `every`
            mask = [1] * warm + [1 if (i % every == 0) else 0 for i in range(steps - warm)]
            mask[-1] = 1
            for policy in ("static", "dynamic"):
                out.append(SCMSettings(mask=mask, policy=policy))
        return out

    @classmethod
    def disabled(cls, adapter, steps):
        return SCMSettings(mask=[1] * steps, policy="static")
