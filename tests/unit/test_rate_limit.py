"""The per-tenant limiter (control_plane/rate_limit.py) on a hand-driven clock, and the keys file's limits."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane.rate_limit import TenantLimiter, TenantLimits, TokenBucket


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limiter(**per_tenant: TenantLimits) -> tuple[TenantLimiter, Clock]:
    clock = Clock()
    return TenantLimiter(lambda t: per_tenant.get(t, TenantLimits()), clock), clock


def test_a_bucket_refills_at_its_rate_up_to_its_capacity_and_may_go_into_debt():
    bucket = TokenBucket(rate=2, capacity=4, now=0)
    assert [bucket.take(1, 0) for _ in range(4)] == [0, 0, 0, 0]
    assert bucket.take(1, 0) == pytest.approx(0.5)  # refused: half a second to the next one
    assert bucket.take(1, 0.5) == 0
    assert bucket.wait_s(1, 100) == 0 and bucket.balance == 4  # capped at the capacity
    bucket.charge(10, 100)
    assert bucket.balance == -6 and bucket.wait_s(1, 100) == pytest.approx(3.5)
    assert bucket.take(10, 104) == pytest.approx(1.0)  # more than the capacity waits until the bucket is full
    assert bucket.take(10, 105) == 0  # and then passes
    bucket.resize(1, 2, 105)
    assert bucket.capacity == 2 and bucket.balance == -6


def test_requests_per_second_refuse_the_excess_with_the_wait_and_leave_other_tenants_alone():
    limits, clock = limiter(acme=TenantLimits(requests_per_second=2))
    assert limits.admit_request("acme") is None and limits.admit_request("acme") is None
    refusal = limits.admit_request("acme")
    assert refusal.limit == "requests_per_second" and refusal.retry_after_s == pytest.approx(0.5)
    assert refusal.retry_after_header == 1
    assert all(limits.admit_request("globex") is None for _ in range(100))  # no limits: never refused
    clock.now += 0.5
    assert limits.admit_request("acme") is None


def test_concurrent_turns_count_until_each_ends():
    limits, _ = limiter(acme=TenantLimits(concurrent_turns=2))
    assert limits.begin_turn("acme") is None and limits.begin_turn("acme") is None
    refusal = limits.begin_turn("acme")
    assert refusal.limit == "concurrent_turns" and refusal.retry_after_header == 1
    assert limits.begin_turn("globex") is None
    limits.end_turn("acme", 0)
    assert limits.begin_turn("acme") is None
    assert limits.running == {"acme": 2, "globex": 1}


def test_tokens_per_minute_charge_the_prompt_before_and_the_generated_tokens_after():
    limits, clock = limiter(acme=TenantLimits(tokens_per_minute=600))  # 10 tokens a second
    assert limits.begin_turn("acme") is None
    assert limits.charge_prompt("acme", 400) is None
    limits.end_turn("acme", 150)  # 550 used: 50 left
    assert limits.begin_turn("acme") is None
    refusal = limits.charge_prompt("acme", 100)
    assert refusal.limit == "tokens_per_minute" and refusal.retry_after_s == pytest.approx(5.0)
    limits.end_turn("acme", 0)  # the refused turn ends, having generated nothing
    clock.now += 5
    assert limits.begin_turn("acme") is None and limits.charge_prompt("acme", 100) is None
    # A turn that generates past what is left overdraws: the debt delays the next turn, whatever its size.
    limits.end_turn("acme", 300)
    refusal = limits.begin_turn("acme")
    assert refusal.limit == "tokens_per_minute" and refusal.retry_after_s == pytest.approx(30.1)
    clock.now += 30.2
    assert limits.begin_turn("acme") is None
    # A prompt longer than a whole minute's budget passes when the bucket is full (else it never could).
    clock.now += 60
    assert limits.charge_prompt("acme", 5000) is None


def test_changed_limits_apply_to_the_next_check():
    current = {"acme": TenantLimits(requests_per_second=1)}
    clock = Clock()
    limits = TenantLimiter(lambda t: current.get(t, TenantLimits()), clock)
    assert limits.admit_request("acme") is None and limits.admit_request("acme") is not None
    current["acme"] = TenantLimits()
    assert limits.admit_request("acme") is None
    current["acme"] = TenantLimits(requests_per_second=10)  # a bigger bucket keeps its balance, then refills
    assert limits.admit_request("acme") is not None
    clock.now += 1
    assert sum(limits.admit_request("acme") is None for _ in range(20)) == 10


@pytest.mark.parametrize("value, words", [
    ([], "must be an object"),
    ({"rps": 1}, "unknown fields ['rps']"),
    ({"requests_per_second": -1}, "'requests_per_second' must be a number >= 0"),
    ({"requests_per_second": True}, "must be a number"),
    ({"tokens_per_minute": 1.5}, "'tokens_per_minute' must be a whole number"),
    ({"concurrent_turns": "4"}, "'concurrent_turns' must be a whole number"),
])
def test_limits_in_the_keys_file_are_checked_by_name(value, words):
    with pytest.raises(ValueError, match=None) as err:
        TenantLimits.parse(value, "limits of 'acme'")
    assert words in str(err.value) and "limits of 'acme'" in str(err.value)


def test_limits_parse_with_defaults_of_no_limit():
    parsed = TenantLimits.parse({"requests_per_second": 0.5, "concurrent_turns": 3}, "x")
    assert parsed == TenantLimits(requests_per_second=0.5, tokens_per_minute=0, concurrent_turns=3) and parsed.any
    assert not TenantLimits.parse({}, "x").any
