"""Stage records built as the stages build them (``ditbook.records``), for the tests of what reads them:
the verdict, the checklist, the report."""

from __future__ import annotations

from ditbook.quality import SetQuality
from ditbook.records import (BenchmarkResults, CacheResults, ChosenDetail, ConfigRow, ParallelResults, PlanRow,
                             StrategyRow, TimingState)
from ditbook.settings import Gates


def quality(psnr: float, ssim: float, n: int = 4, per_image: dict | None = None) -> SetQuality:
    return SetQuality(n=n, psnr_mean=psnr, psnr_min=psnr, ssim_mean=ssim, ssim_min=ssim, max_abs=0.01,
                      worst_tile_psnr=psnr, passed=psnr > 30 and ssim > 0.9, reasons=[], per_image=per_image or {})


def holdout_row(name: str, config: dict, psnr: float, ssim: float, skipped: float, split: str = "holdout") -> StrategyRow:
    q = quality(psnr, ssim)
    return StrategyRow(name, f"cache-dit {name}", config, q, skipped, skipped, 5, q.passed, split)


def cache_record(rows: list[StrategyRow] = (), chosen: StrategyRow | None = None, **fields) -> CacheResults:
    """A cache stage's record: its held-out ``rows`` and the row it chose (held-out figures kept)."""
    detail = None if chosen is None else ChosenDetail(chosen.name, chosen.family, chosen.config,
                                                      skipped_fraction=chosen.skipped_fraction,
                                                      holdout_quality=chosen.quality)
    return CacheResults(adapter_module="adapter_m.py", gates=Gates(psnr=30.0, ssim=0.9), strategies=list(rows),
                        chosen=detail, **fields)


def timing(seconds: float, spread: float = 0.02, n: int = 3) -> dict:
    return {"end_to_end": {"median": seconds, "min": seconds * (1 - spread), "max": seconds * (1 + spread), "n": n},
            "parts": {}, "peak_memory_mb": 100.0, "memory_kind": "cuda_peak"}


def config_row(name: str, speedup: float, psnr: float = 35.0, ssim: float = 0.96, passed: bool = True,
               error: str | None = None, spread: float = 0.02, family: str | None = None) -> ConfigRow:
    """A row timed beside a baseline of 1 s: ``speedup`` by the medians, ``spread`` each way."""
    return ConfigRow(name, family or f"cache/{name.split('[')[0]}", timing=timing(1.0 / speedup, spread),
                     speedup=speedup, psnr_min=psnr, ssim_min=ssim, passed=passed, error=error)


def bench_record(rows: list[ConfigRow], device: str = "cuda:0", drift: float = 1.0,
                 limit: float = 0.1) -> BenchmarkResults:
    base = ConfigRow("baseline", "baseline", timing=timing(1.0), speedup=1.0, psnr_min=100.0, ssim_min=1.0,
                     passed=True)
    res = BenchmarkResults(device=device, warmup=1, repeats=3, baseline=base, configs=list(rows),
                           timing=TimingState(drift, limit, abs(drift - 1.0) <= limit, 1, 3),
                           gates={"cache": Gates(psnr=30.0, ssim=0.9)})
    from ditbook.benchmark.summary import summary_rows

    res.summary = summary_rows(res)
    return res


def parallel_record(plans: list[PlanRow], **fields) -> ParallelResults:
    return ParallelResults(feasibility={}, passed=all(p.passed for p in plans), plans=plans, **fields)


__all__ = ["bench_record", "cache_record", "config_row", "holdout_row", "parallel_record", "quality", "timing"]
