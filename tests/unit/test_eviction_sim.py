"""The decode-KV eviction simulator: deterministic, bounded by the unbounded reference, and the rankings compared."""

from __future__ import annotations

import dataclasses

import pytest
from kvshuttle.services.common.config import ConfigError, from_namespace
from kvshuttle.services.devtools.bench.eviction_sim import (
    UNBOUNDED,
    EvictionSimConfig,
    format_report,
    run,
    simulate,
    workload,
)


def small(**kw) -> EvictionSimConfig:
    cfg = EvictionSimConfig(**{"sessions": 120, "duration_s": 1200.0, "capacity_tokens": 120_000, "runs": 1, "out": "",
                               **kw})
    cfg.validate()
    return cfg


def without_timings(rep: dict) -> dict:
    rep = {**rep, "results": {name: {k: v for k, v in r.items() if k != "cpu_s"} for name, r in rep["results"].items()}}
    return rep


def test_a_seed_gives_the_same_workload_and_report():
    cfg = small(seed=7)
    assert workload(cfg) == workload(cfg)
    assert workload(cfg) != workload(dataclasses.replace(cfg, seed=8))
    assert without_timings(run(cfg)) == without_timings(run(cfg))


def test_the_unbounded_reference_keeps_the_most_pulls():
    rep = run(dataclasses.replace(small(), runs=2))
    res = rep["results"]
    unbounded = res[UNBOUNDED]
    assert unbounded["evictions_total"] == 0 and unbounded["pulls_lost_to_evictions"] == 0
    assert unbounded["pulls_kept"] == unbounded["could_pull"] > 0
    for name in ("value", "lru"):
        r = res[name]
        assert r["evictions_total"] > 0, "the small config must put the decode worker under pressure"
        assert r["pulls_kept"] <= unbounded["pulls_kept"] and r["ttft_saved_s"] <= unbounded["ttft_saved_s"]
        assert r["pulls_kept"] + r["pulls_lost_to_evictions"] == r["could_pull"] == unbounded["could_pull"]
        assert r["peak_held_gib"] <= rep["capacity_gib"]
    text = format_report(rep)
    assert "value / lru" in text and "recompute_ms(n)" in text


def test_with_room_enough_nothing_is_evicted_and_the_rankings_are_equal():
    cfg = small()
    peak = simulate(cfg, workload(cfg), None).peak_tokens
    roomy = dataclasses.replace(cfg, capacity_tokens=2 * peak)
    res = run(roomy)["results"]
    assert res["value"]["evictions_total"] == res["lru"]["evictions_total"] == 0
    drop = ("policy", "cpu_s")
    same = [{k: v for k, v in res[name].items() if k not in drop} for name in ("value", "lru", UNBOUNDED)]
    assert same[0] == same[1] == same[2]


def test_room_is_made_for_a_turn_when_pressure_does_not():
    # high water at 100%: pressure only once D is full, so turns need room made for them first
    cfg = small(high_water=1.0, low_water=0.9, capacity_tokens=60_000)
    res = run(cfg)["results"]
    for name in ("value", "lru"):
        r = res[name]
        assert r["evictions"]["room"] > 0 and r["over_capacity"] == 0


PURE_TENANTS = "0.9/0.05/0.05,0.05/0.9/0.05,0.05/0.05/0.9"  # one tenant chatty, one returning, one abandoning


def test_value_beats_lru_where_tenants_differ_and_matches_it_on_the_mixed_default():
    """Measured, not hoped for (kvshuttle bench-eviction, docs/decode-kv.md): where each tenant's sessions behave
    alike, what the value ranking learns per tenant pays (more TTFT saved than LRU in every seeded run); on the
    default mix, where every tenant mixes all kinds, recency already says most of it and the two are within 1%."""
    pure = run(EvictionSimConfig(out="", tenant_mixes=PURE_TENANTS))
    runs = [(r["value"]["ttft_saved_s"], r["lru"]["ttft_saved_s"]) for r in pure["per_run"]]
    assert len(runs) == 4 and all(v > lru for v, lru in runs), runs
    mixed = run(EvictionSimConfig(out=""))["results"]
    assert mixed["value"]["ttft_saved_s"] >= 0.99 * mixed["lru"]["ttft_saved_s"]
    assert mixed["value"]["evictions_total"] > 0 and mixed["lru"]["evictions_total"] > 0


@pytest.mark.parametrize("environ, words", [
    ({"KVSHUTTLE_EVICTION_SIM_LOW_WATER": "0.9"}, "low water"),
    ({"KVSHUTTLE_EVICTION_SIM_TENANT_MIXES": "0.5/0.5"}, "--tenant-mixes"),
    ({"KVSHUTTLE_EVICTION_SIM_TENANT_MIXES": "a/b/c"}, "--tenant-mixes"),
    ({"KVSHUTTLE_EVICTION_SIM_SESSIONS": "0"}, "--sessions"),
    ({"KVSHUTTLE_EVICTION_SIM_TURN_TOKENS_MIN": "2000"}, "--turn-tokens-min"),
])
def test_bad_settings_are_refused(environ, words):
    with pytest.raises(ConfigError, match=words):
        from_namespace(EvictionSimConfig, None, environ=environ)
