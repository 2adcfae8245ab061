"""The control-plane overhead split: paired pull/direct turns and the gateway's per-hop timers."""

from __future__ import annotations

import pytest
from kvshuttle.services.devtools.bench.overhead import DIRECT, control_plane_overhead, hops
from kvshuttle.services.devtools.bench.samples import PULL, TurnSample


def sample(mode: str, conv: str, turn: int, ttft: float, decision: str = "pull") -> TurnSample:
    return TurnSample(mode=mode, conversation=conv, turn=turn, prompt_tokens=100, history_tokens=50, new_tokens=50,
                      ttft_ms=ttft, latency_ms=ttft + 10, output_tokens=4, decision=decision, pulled_tokens=50,
                      computed_tokens=50)


TIMINGS = {"prompt_ms": 3.0, "session_ms": 1.0, "plan_ms": 4.0, "prefill_ms": 80.0, "ttft_ms": 90.0}


def test_hops_split_the_client_side_ttft():
    got = hops(93.0, TIMINGS)
    assert got == {"client_http_ms": 3.0, "request_ms": 0.0, "session_ms": 1.0, "prompt_other_ms": 2.0,
                   "plan_ms": 4.0, "prefill_ms": 80.0, "decode_first_ms": 3.0}
    assert sum(got.values()) == pytest.approx(93.0)
    # the gateway's own time before the turn (request_ms) comes out of what the client's HTTP took
    split = hops(93.0, {**TIMINGS, "request_ms": 1.25})
    assert split["client_http_ms"] == 1.75 and split["request_ms"] == 1.25
    assert sum(split.values()) == pytest.approx(93.0)


def test_overhead_pairs_turns_with_the_same_decision_only():
    samples = [sample(PULL, "a", 1, 100.0, "recompute"), sample(DIRECT, "a", 1, 94.0, "recompute"),
               sample(PULL, "a", 2, 93.0), sample(DIRECT, "a", 2, 85.0),
               sample(PULL, "b", 2, 93.0), sample(DIRECT, "b", 2, 60.0, "recompute")]  # not comparable
    timings = {("a", 1): {**TIMINGS, "ttft_ms": 97.0}, ("a", 2): TIMINGS, ("b", 2): TIMINGS}
    o = control_plane_overhead(samples, timings)
    assert o["paired_turns"] == 2
    assert o["added_ttft_ms"]["min"] == 6.0 and o["added_ttft_ms"]["max"] == 8.0
    assert o["control_plane_ms"]["p50"] == 5.0  # registry read + plan
    assert o["hops"]["client_http_ms"]["max"] == 3.0 and o["hops"]["plan_ms"]["count"] == 3
    assert o["hop_share_of_ttft"]["prefill_ms"] == pytest.approx(240.0 / 286.0)
