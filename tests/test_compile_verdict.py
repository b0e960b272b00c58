"""Compile in the stages (issue 16 item 2): the verdict ships the fastest correct form of the cache
stage's choice — compiled when the benchmark's ``+compile`` twin is faster and passes every check —
with the one-time compile cost beside it."""

from __future__ import annotations

from records_fixtures import bench_record, cache_record, config_row, holdout_row

from ditbook.benchmark.verdict import headline, verdict
from ditbook.records import CompiledCheck

CHOSEN = "dbcache_taylorseer[Fn=1,threshold=0.24]"


def _cache(psnr=33.1):
    row = holdout_row("dbcache_taylorseer", {"Fn": 1, "threshold": 0.24}, psnr, 0.95, 0.5)
    return cache_record([row], chosen=row)


def _with_twin(speedup=2.6, passed=True, compile_s=14.2):
    twin = config_row(CHOSEN + "+compile", speedup, 34.8, 0.96, passed=passed)
    twin.params = {"compile": {"compile_s": compile_s, "first_call_s": 15.0, "steady_call_s": 0.8}}
    return bench_record([config_row(CHOSEN, 1.9), twin])


def test_the_faster_compiled_twin_is_shipped_with_its_compile_cost():
    v = verdict(_with_twin(), _cache())
    assert v.ship and v.name == CHOSEN + "+compile" and v.speedup == 2.6 and v.form == "compiled"
    assert v.compile["compile_s"] == 14.2 and v.runner_ups[0]["name"] == CHOSEN
    assert v.holdout.psnr_min == 33.1  # held-out quality of the chosen configuration, as before
    text = headline(v)
    assert text.startswith(f"Ship {CHOSEN}+compile: 2.60× end to end"), text
    assert "(one-time compile 14.2 s)" in text


def test_a_compiled_twin_that_fails_a_check_or_is_slower_is_not_shipped():
    # fails its gates on the benchmark's images
    v = verdict(_with_twin(passed=False), _cache())
    assert v.ship and v.name == CHOSEN and v.speedup == 1.9
    assert "do not pass the gates" in next(r["why_not"] for r in v.refused if r["name"] == CHOSEN + "+compile")
    # the cache stage's compiled check saw the compiled images change
    cache = _cache()
    cache.compiled = CompiledCheck(ran=True, ok=False, quality={"psnr_min": 20.0})
    v = verdict(_with_twin(), cache)
    assert v.name == CHOSEN and any("compiled images differ" in r["why_not"] for r in v.refused)
    # slower compiled: the uncompiled one ships, the compiled a runner-up
    v = verdict(_with_twin(speedup=1.5), _cache())
    assert v.name == CHOSEN and v.runner_ups[0]["name"] == CHOSEN + "+compile"
    # held-out quality below the gates: nothing is shipped, compiled or not
    v = verdict(_with_twin(), _cache(psnr=29.0))
    assert not v.ship and v.name == CHOSEN


def test_without_a_compiled_twin_the_verdict_is_unchanged():
    v = verdict(bench_record([config_row(CHOSEN, 1.9)]), _cache())
    assert v.compile is None and v.name == CHOSEN and v.form == "plain"


def test_the_benchmarks_compiled_twin_carries_the_name_the_verdict_looks_for():
    """The cache stage's configuration reaches the benchmark as ``name[label]``; with
    ``runtime.compile`` its twin is ``name[label]+compile`` — the row ``compiled_twin`` reads."""
    from ditbook.benchmark.variants import derived_configs
    from ditbook.benchmark.verdict import chosen_row_name
    from ditbook.configuration import Config

    chosen = _cache().chosen
    name = chosen_row_name(chosen)
    assert name == CHOSEN
    from types import SimpleNamespace

    card = SimpleNamespace(runtime=SimpleNamespace(compile="eager"),
                           benchmark=SimpleNamespace(fp8=False, attention_backend=None))
    configs = derived_configs(SimpleNamespace(card=card), None, [Config(name, "cache/dbcache_taylorseer", lambda p: None)],
                              log=lambda m: None)
    assert [c.name for c in configs] == [CHOSEN, "baseline+compile", CHOSEN + "+compile"]
