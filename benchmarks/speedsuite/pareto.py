"""Equal-quality comparison against the peers (issue 16): the configurations, how each is switched
on, what it really computes, and the dominance check.

A *point* is a JSON-able dict ``{"name", "owner", "kind", "params"}``:

- ``kind="dbcache"``: cache-dit's DBCache (``cache_dit.enable_cache``) with a steps computation
  mask. The peers are cache-dit's SCM policies slow / medium / fast as cache-dit's own command
  line builds them for ``--scm POLICY`` (``cache_dit/_utils/utils.py``, 1.5.3): Fn 1, Bn 0,
  residual_diff_threshold 0.12, max_warmup_steps 8, warmup_interval 1, max_continuous_cached_steps
  3, ``steps_mask(mask_policy=POLICY, total_steps=28)``, ``steps_computation_policy`` "dynamic"
  (DBCacheConfig's default, the one cache-dit's README recommends with SCM), no TaylorSeer (the
  command line's default). The README's example block uses Fn 8 — more blocks than the reference
  model has (2 + 4), which would compute every block of every step there, so it is not used.
  ditbook's points are the same mechanism with a static mask (policy "static", Fn 1) and
  optionally TaylorSeer.
- ``kind="fbc"``: diffusers' FirstBlockCache through diffusers' own hook API
  (``transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))``, the threshold of diffusers'
  documented example). ``params["forced"]`` (timing only): the real hooks run, but the head hook's
  decision is replaced by the recorded one (its own residual test still runs, so the per-step work
  is the same).
- ``kind="magcache"``: diffusers' MagCache (``MagCacheConfig`` defaults: threshold 0.06,
  max_skip_steps 3, retention_ratio 0.2) with magnitude ratios either from a calibration run on
  the reference model (``MagCacheConfig(calibrate=True)``, one run, the ratios it prints — how
  diffusers' docs say to get them for a new model) or diffusers' ``FLUX_MAG_RATIOS``. MagCache's
  decisions depend only on the ratios and the step index, so the same config decides the same
  steps on any weights (checked by counting on the GPU run).

What each point computes is *counted*, not read from its config: every original block's forward
is wrapped before the cache goes on (``ditbook.adapter.counting.EvalCounter``), so per transformer
call we know how many blocks really ran: ``F`` all of them, ``P`` some (a cache's first block),
``S`` none. ``work`` is block evaluations / blocks per call, in full-step equivalents on the
reference model (the first-block work of a cached step counts for both sides).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from typing import Callable

import torch

STEPS = 28
SCM_POLICIES = ("slow", "medium", "fast")
FBC_THRESHOLD = 0.2  # diffusers' documented example (apply_first_block_cache docstring, cache guide)
AGGREGATES = ("mean", "min")  # a ditbook point must be >= the peer under each aggregate over the images


# --- the points -----------------------------------------------------------------------------------
def scm_peer(policy: str, steps: int = STEPS) -> dict:
    from cache_dit import steps_mask

    mask = "".join(str(int(m)) for m in steps_mask(total_steps=steps, mask_policy=policy))
    return {"name": f"cache-dit SCM {policy}", "owner": "cache-dit", "kind": "dbcache",
            "params": {"mask": mask, "policy": "dynamic", "Fn": 1, "Bn": 0, "rdt": 0.12, "max_warmup_steps": 8,
                       "warmup_interval": 1, "max_continuous_cached_steps": 3, "taylorseer_order": 0,
                       "documented": f"cache-dit CLI --scm {policy} (DBCacheConfig from _utils/utils.py defaults)"}}


def fbc_peer(threshold: float = FBC_THRESHOLD) -> dict:
    return {"name": f"diffusers FBC {threshold:g}", "owner": "diffusers", "kind": "fbc",
            "params": {"threshold": threshold}}


def magcache_peer(ratios: list[float], source: str, steps: int = STEPS) -> dict:
    from diffusers.hooks import MagCacheConfig

    d = MagCacheConfig(mag_ratios=[1.0] * steps, num_inference_steps=steps)  # the documented defaults
    return {"name": f"diffusers MagCache ({source})", "owner": "diffusers", "kind": "magcache",
            "params": {"threshold": d.threshold, "max_skip_steps": d.max_skip_steps,
                       "retention_ratio": d.retention_ratio, "num_inference_steps": steps,
                       "ratios_source": source, "mag_ratios": [round(float(r), 6) for r in ratios]}}


def static_point(name: str, mask: str, taylorseer_order: int = 0) -> dict:
    """ditbook's configuration: cache-dit DBCache with a static steps computation mask."""
    return {"name": name, "owner": "ditbook", "kind": "dbcache",
            "params": {"mask": mask, "policy": "static", "Fn": 1, "Bn": 0, "rdt": 0.08, "max_warmup_steps": 0,
                       "warmup_interval": 1, "max_continuous_cached_steps": -1,
                       "taylorseer_order": taylorseer_order}}


def flux_mag_ratios() -> list[float]:
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    return [float(x) for x in FLUX_MAG_RATIOS]


# --- switching a point on (returns the undo) ------------------------------------------------------
def apply_point(pipe, point: dict) -> Callable[[], None]:
    kind, p = point["kind"], point["params"]
    if kind == "dbcache":
        import cache_dit
        from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

        mask = [int(c) for c in p["mask"]]
        cfg = DBCacheConfig(Fn_compute_blocks=p["Fn"], Bn_compute_blocks=p["Bn"], residual_diff_threshold=p["rdt"],
                            max_warmup_steps=p["max_warmup_steps"], warmup_interval=p["warmup_interval"],
                            max_continuous_cached_steps=p["max_continuous_cached_steps"],
                            steps_computation_mask=mask, steps_computation_policy=p["policy"],
                            num_inference_steps=len(mask))
        cal = TaylorSeerCalibratorConfig(taylorseer_order=p["taylorseer_order"]) if p["taylorseer_order"] else None
        restore = _instance_attrs(pipe.transformer, ("forward", "_is_patched"))
        cache_dit.enable_cache(pipe, cache_config=cfg, calibrator_config=cal)

        def undo():
            cache_dit.disable_cache(pipe)
            restore()  # cache-dit's Flux patch functor leaves its transformer forward behind
        return undo
    if kind == "fbc":
        from diffusers.hooks import FirstBlockCacheConfig

        tr = pipe.transformer
        tr.enable_cache(FirstBlockCacheConfig(threshold=p["threshold"]))
        handle = _force_fbc(tr, p["forced"]) if p.get("forced") is not None else None

        def undo():
            if handle is not None:
                handle.remove()
            tr.disable_cache()
        return undo
    if kind == "magcache":
        from diffusers.hooks import MagCacheConfig

        tr = pipe.transformer
        tr.enable_cache(MagCacheConfig(threshold=p["threshold"], max_skip_steps=p["max_skip_steps"],
                                       retention_ratio=p["retention_ratio"],
                                       num_inference_steps=p["num_inference_steps"], mag_ratios=p["mag_ratios"]))
        return tr.disable_cache
    raise ValueError(f"unknown point kind {kind!r} ({point.get('name')})")


_MISSING = object()


def _instance_attrs(transformer, names) -> Callable[[], None]:
    """Snapshot ``names`` in the instance dicts of the transformer and its modules; the returned
    call puts back exactly what was there (removes what was added)."""
    saved = [(m, n, m.__dict__.get(n, _MISSING)) for m in transformer.modules() for n in names]
    # the order of the children too: cache-dit re-sets the block lists, which moves them last, and
    # diffusers' FirstBlockCache takes the first list it meets as the head
    orders = [(m, list(m._modules.items())) for m in transformer.modules()]

    def restore():
        for m, items in orders:
            if list(m._modules.keys()) != [k for k, _ in items] and set(m._modules) == {k for k, _ in items}:
                now = dict(m._modules)
                m._modules.clear()
                m._modules.update((k, now[k]) for k, _ in items)
        for m, n, before in saved:
            now = m.__dict__.get(n, _MISSING)
            if now is before:
                continue
            if before is _MISSING:
                del m.__dict__[n]
            else:
                m.__dict__[n] = before
    return restore


def _force_fbc(transformer, forced: list[int]):
    """Keep diffusers' FBC hooks, but make the head hook decide as recorded: its own residual test
    still runs (same work per step), its answer is replaced by ``forced[step]``."""
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    from ditbook.hooks import wrap_method

    heads = [reg.get_hook(_FBC_LEADER_BLOCK_HOOK) for m in transformer.modules()
             if (reg := getattr(m, "_diffusers_hook", None)) is not None]
    heads = [h for h in heads if h is not None]
    if len(heads) != 1:
        raise RuntimeError(f"expected one FirstBlockCache head hook, found {len(heads)}")
    state = {"n": 0}

    def decide(original, *args, **kwargs):
        original(*args, **kwargs)
        step = state["n"] % len(forced)
        state["n"] += 1
        return bool(forced[step])

    return wrap_method(heads[0], "pareto-forced-decisions", decide, attr="_should_compute_remaining_blocks")


def calibrate_magcache(pipe, render: Callable[[], None], steps: int = STEPS) -> list[float]:
    """diffusers' documented way to get MagCache ratios for a new model: one run with
    ``MagCacheConfig(calibrate=True)``; the hook prints the ratios at the end of the run."""
    from diffusers.hooks import MagCacheConfig

    tr = pipe.transformer
    tr.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            render()
    finally:
        tr.disable_cache()
    text = buf.getvalue()
    m = re.search(r"Copy these values to MagCacheConfig\(mag_ratios=\.\.\.\):\s*\[([^\]]*)\]", text)
    if not m:
        raise RuntimeError(f"MagCache calibration printed no ratios: {text[-500:]!r}")
    ratios = [float(x) for x in m.group(1).split(",") if x.strip()]
    if len(ratios) != steps:
        raise RuntimeError(f"MagCache calibration gave {len(ratios)} ratios for {steps} steps")
    return ratios


# --- counting what ran ------------------------------------------------------------------------------
def transformer_blocks(transformer) -> list:
    """The blocks: every item of the transformer's direct ``ModuleList`` children (the lists
    diffusers' cache hooks and cache-dit's adapters walk)."""
    return [b for _, m in transformer.named_children() if isinstance(m, torch.nn.ModuleList) for b in m]


def pattern_of(calls: list[int], blocks: int) -> str:
    """Per transformer call: F (every block ran), P (some), S (none)."""
    return "".join("F" if c >= blocks else ("S" if c == 0 else "P") for c in calls)


def work_of(calls: list[int], blocks: int) -> float:
    """Block evaluations in full-step equivalents."""
    return sum(calls) / blocks


def pattern_summary(patterns: dict[str, str], works: dict[str, float]) -> dict:
    """Over the images of one point: the least-work image's pattern (the one a peer is timed with:
    its fastest observed behaviour) and the ranges."""
    if not patterns:
        return {}
    least = min(works, key=lambda k: (works[k], k))
    distinct = sorted(set(patterns.values()))
    return {"work_min": min(works.values()), "work_max": max(works.values()),
            "full_min": min(p.count("F") for p in patterns.values()),
            "full_max": max(p.count("F") for p in patterns.values()),
            "least_work_image": least, "least_work_pattern": patterns[least],
            "distinct_patterns": len(distinct), "per_image": patterns}


def timing_form(point: dict) -> dict:
    """The form a point is timed in at the FLUX shape (random weights), and how it was derived.
    Needs ``point["counts"]`` (the reference-model patterns)."""
    counts = point["counts"]
    pat = counts["least_work_pattern"]
    p = dict(point["params"])
    if point["kind"] == "dbcache" and p["policy"] == "dynamic":
        p.update(policy="static", mask="".join("1" if c == "F" else "0" for c in pat))
        how = ("cache-dit's own DBCache with the steps it fully computed on the reference model (its least-work image) "
               "as a static mask; cached steps still compute the Fn block (its residual test is skipped)")
    elif point["kind"] == "fbc":
        p["forced"] = [1 if c == "F" else 0 for c in pat]
        how = ("diffusers' FirstBlockCache hooks as they are, the head hook's decision forced to the one it took on the "
               "reference model (its least-work image); the residual test still runs every step")
    elif point["kind"] == "magcache":
        how = "diffusers' MagCache as configured: its decisions depend only on the ratios and the step, not the weights"
    else:
        how = "static: the same configuration"
    return {"name": point["name"], "owner": point["owner"], "kind": point["kind"], "params": p,
            "expected_pattern": pat, "how": how}


# --- dominance ---------------------------------------------------------------------------------------
def quality_ge(a: dict, b: dict, aggregates=AGGREGATES) -> bool:
    """``a`` at least as good as ``b`` (SetQuality dicts) in PSNR and SSIM under each aggregate."""
    for agg in aggregates:
        for metric in ("psnr", "ssim"):
            x, y = a.get(f"{metric}_{agg}"), b.get(f"{metric}_{agg}")
            if x is None or y is None or (isinstance(x, float) and math.isnan(x)) or x < y:
                return False
    return True


def quality_shortfall(a: dict, b: dict, aggregates=AGGREGATES) -> list[str]:
    out = []
    for agg in aggregates:
        for metric in ("psnr", "ssim"):
            x, y = a.get(f"{metric}_{agg}"), b.get(f"{metric}_{agg}")
            if x is None or y is None or x < y:
                out.append(f"{metric} {agg} {x} < {y}")
    return out
