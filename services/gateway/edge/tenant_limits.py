"""The per-tenant limits of the API keys file, enforced: requests per second at each front door (the HTTP guard, the
gRPC API), concurrent turns and tokens per minute in the turn runner (one place for all four APIs).

Over a limit: ``RateLimited``, a TurnError with HTTP 429 / gRPC RESOURCE_EXHAUSTED and a retry delay in whole
seconds, counted in ``kvshuttle_rate_limited_total{tenant, limit}``. The counting itself is
control_plane/rate_limit.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from kvshuttle.control_plane.rate_limit import Refusal, TenantLimiter
from kvshuttle.services.common import metrics
from kvshuttle.services.gateway.edge.auth import KeyRing
from kvshuttle.services.gateway.turns.errors import TurnError

# OpenAI's error ``type`` for each limit (its API says "requests" or "tokens"); Anthropic's is rate_limit_error.
OPENAI_TYPES = {"requests_per_second": "requests", "concurrent_turns": "requests", "tokens_per_minute": "tokens"}
ERROR_CODE = "rate_limit_exceeded"


class RateLimited(TurnError):
    """A tenant over one of its limits (``limit``: control_plane.rate_limit.LIMIT_KINDS)."""

    def __init__(self, refusal: Refusal):
        super().__init__(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"rate limit: {refusal.detail} for this API key's tenant; retry after "
                         f"{refusal.retry_after_header} s", retry_after_s=refusal.retry_after_header)
        self.limit = refusal.limit

    @property
    def openai_type(self) -> str:
        return OPENAI_TYPES.get(self.limit, "requests")


def _refused(tenant: str, refusal: Refusal) -> RateLimited:
    metrics.RATE_LIMITED.labels(tenant, refusal.limit).inc()
    return RateLimited(refusal)


class TurnQuota:
    """A running turn's hold on its tenant's limits; ``end`` (once; later calls do nothing) releases it."""

    def __init__(self, limiter: TenantLimiter, tenant: str):
        self._limiter, self.tenant, self._ended = limiter, tenant, False

    def charge_prompt(self, tokens: int) -> None:
        """RateLimited when the prompt is over the tenant's tokens per minute (the caller then ends the turn)."""
        refusal = self._limiter.charge_prompt(self.tenant, tokens)
        if refusal is not None:
            raise _refused(self.tenant, refusal)

    def end(self, generated_tokens: int) -> None:
        if not self._ended:
            self._ended = True
            self._limiter.end_turn(self.tenant, generated_tokens)


class TenantQuotas:
    """Every tenant's limits, read from ``keys`` at each check (a reloaded keys file applies at once)."""

    def __init__(self, keys: KeyRing, clock: Callable[[], float] = time.monotonic):
        self.limiter = TenantLimiter(keys.limits_of, clock)

    def check_request(self, tenant: str) -> RateLimited | None:
        """One request of ``tenant``: None when within its requests per second."""
        refusal = self.limiter.admit_request(tenant)
        return None if refusal is None else _refused(tenant, refusal)

    def begin_turn(self, tenant: str) -> TurnQuota:
        """A turn starts (RateLimited when the tenant runs its most turns already, or is over its tokens)."""
        refusal = self.limiter.begin_turn(tenant)
        if refusal is not None:
            raise _refused(tenant, refusal)
        return TurnQuota(self.limiter, tenant)
