"""The soak report's arithmetic: failures by kind, decisions, throughput windows, memory growth."""

from __future__ import annotations

from kvshuttle.services.devtools.bench.soak import (
    SoakConfig,
    TurnResult,
    _slope_per_min,
    format_report,
    kv_sample,
    report,
)


def test_report_counts_failures_decisions_and_memory_growth():
    cfg = SoakConfig(model_dir="m", sessions=2, duration_s=120, warmup_s=10)
    results = [TurnResult("s", i, i, 100.0 + i, True, i % 2 == 0, "pull" if i % 3 else "recompute", ttft_ms=10.0 + i)
               for i in range(90)]
    results += [TurnResult("s", 0, 5, 50.0, False, False, failure="http 503"),
                TurnResult("s", 1, 6, 50.0, False, True, failure="timeout")]
    memory = [{"t": t, "gateway": 100.0 + t / 60, "registry": 50.0} for t in range(0, 121, 5)]
    rep = report(results, memory, cfg, 120.0)
    assert rep["turns"] == 92 and rep["succeeded"] == 90 and rep["failed"] == 2
    assert rep["failures"] == {"http 503": 1, "timeout": 1}
    assert rep["decisions"] == {"pull": 60, "recompute": 30}
    assert rep["turns_per_s"] == 0.75
    assert [w["from_s"] for w in rep["per_minute"]] == [0, 60]
    gw = rep["memory"]["gateway"]
    assert gw["start_mib"] == 100.0 + 10 / 60 and abs(gw["slope_mib_per_min"] - 1.0) < 1e-6
    assert rep["memory"]["registry"]["slope_mib_per_min"] == 0.0
    assert "2 failed" in format_report(rep)


def test_slope_needs_three_points():
    assert _slope_per_min([(0, 1.0), (60, 2.0)]) is None
    assert _slope_per_min([(0, 1.0), (60, 2.0), (120, 3.0)]) == 1.0


def test_decode_kv_samples_come_from_the_scheduler_stats_and_are_reported_per_minute():
    stats = {  # GET /v1/scheduler/stats (the REST bridge's JSON of GetStats)
        "loads": [{"workerId": "decode-0", "usedTokens": "750", "capacityTokens": "1000", "waiting": 2, "running": 1},
                  {"workerId": "prefill-0", "usedTokens": "10", "capacityTokens": "1000"}],
        "decodeKv": [{"workerId": "decode-0", "heldSessions": "3", "heldTokens": "600",
                      "evictions": {"pressure": "4", "idle": "0", "room": "0"}}]}
    sample = kv_sample(stats)
    assert sample == {"decode-0": {"usage": 0.75, "waiting": 2, "running": 1, "held_sessions": 3, "held_tokens": 600,
                                   "evictions": {"pressure": 4, "idle": 0, "room": 0}}}
    # Without a KV manager there is no decodeKv: every worker with a capacity is listed.
    assert set(kv_sample({"loads": stats["loads"]})) == {"decode-0", "prefill-0"}

    cfg = SoakConfig(model_dir="m", sessions=1, duration_s=120, warmup_s=10)
    kv = [{"t": t, "decode-0": {**sample["decode-0"], "usage": 0.5 + t / 1000}} for t in range(0, 120, 5)]
    rep = report([], [], cfg, 120.0, kv)
    d = rep["decode_kv"]["decode-0"]
    assert [m["from_s"] for m in d["per_minute"]] == [0, 60]
    assert d["per_minute"][0]["max"] == 0.555 and d["max_usage"] == 0.615 and d["max_waiting"] == 2
    assert d["evictions"] == {"pressure": 4, "idle": 0, "room": 0}
    assert "decode-0 KV usage per minute" in format_report(rep) and not rep["sessions_ended"]
