"""Per-tenant limits as pure logic: token buckets and a concurrency count per tenant, on an injected clock.

Three limits, each optional (0: none):

* ``requests_per_second``: a bucket of ``max(1, rate)`` requests, refilled at ``rate`` per second; one per request.
* ``tokens_per_minute``: a bucket of ``limit`` tokens, refilled at ``limit / 60`` per second. A turn is admitted
  when the bucket holds its prompt's tokens (or is full, for a prompt longer than a minute's budget); the prompt is
  charged then, the generated tokens when the turn ends. A turn that generates more than the bucket held leaves it
  below zero: the debt delays the tenant's next turns until the refill has paid it back.
* ``concurrent_turns``: turns of the tenant running at once (admitted, not yet ended).

No I/O and no clock of its own: the gateway enforces the answers (services/gateway/edge/tenant_limits.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

LIMIT_KINDS = ("requests_per_second", "tokens_per_minute", "concurrent_turns")


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; 0 means none for that kind."""

    requests_per_second: float = 0.0
    tokens_per_minute: int = 0
    concurrent_turns: int = 0

    @property
    def any(self) -> bool:
        return bool(self.requests_per_second or self.tokens_per_minute or self.concurrent_turns)

    @classmethod
    def parse(cls, value: object, where: str) -> TenantLimits:
        """From a keys file's object; ValueError naming the field at fault."""
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: must be an object with any of {list(LIMIT_KINDS)}")
        unknown = sorted(set(value) - set(LIMIT_KINDS))
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown} (known: {list(LIMIT_KINDS)})")
        out = {}
        for f in fields(cls):
            if f.name not in value:
                continue
            raw = value[f.name]
            integral = f.type in ("int", int)
            ok = isinstance(raw, int) if integral else isinstance(raw, int | float)
            if isinstance(raw, bool) or not ok or not math.isfinite(raw) or raw < 0:
                kind = "a whole number" if integral else "a number"
                raise ValueError(f"{where}: {f.name!r} must be {kind} >= 0 (0: no limit), got {raw!r}")
            out[f.name] = raw
        return cls(**out)


class TokenBucket:
    """``capacity`` units, refilled at ``rate`` per second up to ``capacity``; the balance may go below zero
    (``charge``)."""

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity = rate, capacity
        self.balance, self._at = capacity, now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.balance = min(self.capacity, self.balance + (now - self._at) * self.rate)
        self._at = max(self._at, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount`` (capped at its capacity); 0 when it does now."""
        self._refill(now)
        missing = min(amount, self.capacity) - self.balance
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if the bucket holds it (or is full, for more than its capacity): 0.0; otherwise take
        nothing and return the seconds to wait."""
        wait = self.wait_s(amount, now)
        if wait == 0.0:
            self.balance -= amount
        return wait

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` whatever the balance (it may go below zero)."""
        self._refill(now)
        self.balance -= amount

    def resize(self, rate: float, capacity: float, now: float) -> None:
        """New limits (a reloaded keys file); the balance is kept, capped at the new capacity."""
        self._refill(now)
        self.rate, self.capacity = rate, capacity
        self.balance = min(self.balance, capacity)


@dataclass(frozen=True)
class Refusal:
    """Over a limit: which one, and how long until a retry may pass (seconds)."""

    limit: str
    retry_after_s: float
    detail: str

    @property
    def retry_after_header(self) -> int:
        """Whole seconds for HTTP ``Retry-After`` (at least 1)."""
        return max(1, math.ceil(self.retry_after_s))


class TenantLimiter:
    """The buckets and turn counts of every tenant, against the limits ``limits_of(tenant)`` answers now (they may
    change between calls: a reloaded keys file)."""

    def __init__(self, limits_of: Callable[[str], TenantLimits], clock: Callable[[], float]):
        self._limits_of, self._clock = limits_of, clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self.running: dict[str, int] = {}

    def _bucket(self, buckets: dict[str, TokenBucket], tenant: str, rate: float, capacity: float,
                now: float) -> TokenBucket:
        bucket = buckets.get(tenant)
        if bucket is None:
            bucket = buckets[tenant] = TokenBucket(rate, capacity, now)
        elif (bucket.rate, bucket.capacity) != (rate, capacity):
            bucket.resize(rate, capacity, now)
        return bucket

    def admit_request(self, tenant: str) -> Refusal | None:
        """One request (any route): None when within ``requests_per_second``."""
        rps = self._limits_of(tenant).requests_per_second
        if not rps:
            return None
        now = self._clock()
        wait = self._bucket(self._requests, tenant, rps, max(1.0, rps), now).take(1, now)
        if not wait:
            return None
        return Refusal("requests_per_second", wait, f"over {rps:g} requests per second")

    def begin_turn(self, tenant: str) -> Refusal | None:
        """A turn starts: None (and it counts as running until ``end_turn``) when within ``concurrent_turns`` and
        the tenant's token bucket is not in debt."""
        limits = self._limits_of(tenant)
        if limits.concurrent_turns and self.running.get(tenant, 0) >= limits.concurrent_turns:
            return Refusal("concurrent_turns", 1.0, f"{limits.concurrent_turns} turns already running")
        if limits.tokens_per_minute:
            now = self._clock()
            bucket = self._bucket(self._tokens, tenant, limits.tokens_per_minute / 60, limits.tokens_per_minute, now)
            wait = bucket.wait_s(1, now)
            if wait:
                return Refusal("tokens_per_minute", wait, f"over {limits.tokens_per_minute} tokens per minute")
        self.running[tenant] = self.running.get(tenant, 0) + 1
        return None

    def charge_prompt(self, tenant: str, tokens: int) -> Refusal | None:
        """A begun turn's prompt: None (the tokens charged) when the bucket holds them (or is full); else the
        turn is refused and the caller ends it."""
        tpm = self._limits_of(tenant).tokens_per_minute
        if not tpm:
            return None
        now = self._clock()
        wait = self._bucket(self._tokens, tenant, tpm / 60, tpm, now).take(tokens, now)
        if not wait:
            return None
        return Refusal("tokens_per_minute", wait, f"a {tokens}-token prompt is over {tpm} tokens per minute "
                                                  "(prompt plus generated tokens)")

    def end_turn(self, tenant: str, generated_tokens: int) -> None:
        """A begun turn ended (answered, failed or refused): it stops counting as running; its generated tokens are
        charged, however far below zero that takes the bucket."""
        left = self.running.get(tenant, 0) - 1
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)
        tpm = self._limits_of(tenant).tokens_per_minute
        if tpm and generated_tokens:
            now = self._clock()
            self._bucket(self._tokens, tenant, tpm / 60, tpm, now).charge(generated_tokens, now)
