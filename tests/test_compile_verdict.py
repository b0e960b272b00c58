"""Compile in the stages (issue 16 item 2): the verdict ships the fastest correct form of the cache
stage's choice — compiled when the benchmark's ``+compile`` twin is faster and passes every check —
with the one-time compile cost beside it."""

from __future__ import annotations

from ditbook.benchmark.verdict import headline, verdict

from test_bench_plots import _bench, _cache

CHOSEN = "dbcache_taylorseer[Fn=1,threshold=0.24]"


def _with_twin(speedup=2.6, passed=True, compile_s=14.2):
    b = _bench(speedup=1.9)
    b["summary"].append({"name": CHOSEN + "+compile", "family": "cache/dbcache_taylorseer", "source": "measured here",
                         "speedup": speedup, "e2e_ms": 120.0, "psnr_min": 34.8, "ssim_min": 0.96, "passed": passed})
    b["configs"] = [{"name": CHOSEN + "+compile", "params": {"compile": {"compile_s": compile_s, "first_call_s": 15.0,
                                                                         "steady_call_s": 0.8}}}]
    return b


def test_the_faster_compiled_twin_is_shipped_with_its_compile_cost():
    v = verdict(_with_twin(), _cache())
    assert v["ship"] and v["name"] == CHOSEN + "+compile" and v["speedup"] == 2.6
    assert v["compile"]["uncompiled_speedup"] == 1.9 and v["compile"]["compile_s"] == 14.2
    assert v["holdout"]["psnr_min"] == 33.1  # held-out quality of the chosen configuration, as before
    text = headline(v)
    assert text.startswith(f"Ship {CHOSEN}+compile: 2.60× end to end (one-time compile 14.2 s)"), text


def test_a_compiled_twin_that_fails_a_check_or_is_slower_is_not_shipped():
    # fails its gates on the benchmark's images
    v = verdict(_with_twin(passed=False), _cache())
    assert v["ship"] and v["name"] == CHOSEN and v["speedup"] == 1.9
    assert not v["compile"]["shipped"] and "did not pass its gates" in v["compile"]["why_not"]
    # the cache stage's compiled check saw the compiled images change
    cache = {**_cache(), "compiled": {"ran": True, "ok": False, "quality": {"psnr_min": 20.0}}}
    v = verdict(_with_twin(), cache)
    assert v["name"] == CHOSEN and "compiled images differ" in v["compile"]["why_not"]
    # slower compiled: the uncompiled one stays
    v = verdict(_with_twin(speedup=1.5), _cache())
    assert v["name"] == CHOSEN and v["compile"]["why_not"].startswith("not faster")
    # held-out quality below the gates: nothing is shipped, compiled or not
    v = verdict(_with_twin(), _cache(psnr=29.0))
    assert not v["ship"] and v["name"] == CHOSEN


def test_without_a_compiled_twin_the_verdict_is_unchanged():
    v = verdict(_bench(), _cache())
    assert "compile" not in v and v["name"] == CHOSEN


def test_the_benchmarks_compiled_twin_carries_the_name_the_verdict_looks_for():
    """The cache stage's configuration reaches the benchmark as ``name[label]``; with
    ``runtime.compile`` its twin is ``name[label]+compile`` — the row ``compiled_twin`` reads."""
    from ditbook.benchmark.variants import derived_configs
    from ditbook.benchmark.verdict import chosen_row_name
    from ditbook.configuration import Config

    chosen = _cache()["chosen"]
    name = chosen_row_name(chosen)
    assert name == CHOSEN
    from types import SimpleNamespace

    card = SimpleNamespace(runtime=SimpleNamespace(compile="eager"),
                           benchmark=SimpleNamespace(fp8=False, attention_backend=None))
    configs = derived_configs(SimpleNamespace(card=card), None, [Config(name, "cache/dbcache_taylorseer", lambda p: None)],
                              log=lambda m: None)
    assert [c.name for c in configs] == [CHOSEN, "baseline+compile", CHOSEN + "+compile"]
