"""Which held KV handles a decode worker should free, and when (pure: the scheduler's KV manager and a simulator
drive it alike).

Between a session's turns its decode worker (D) keeps the conversation's KV blocks until the next turn pulls them or
D's ``decoder_kv_blocks_ttl`` ends (minutes). Clients that never end their sessions would fill D with KV nobody
reads again. So each D's held handles are freed:

- **idle**: a session idle longer than ``idle_limit_s`` (its record stays: the next turn recomputes, and says why);
- **pressure**: when D's KV usage passes ``high_water`` (or its held KV passes ``held_budget``), handles are freed
  until usage is back under ``low_water`` (and held KV under the budget less the same hysteresis);
- **room**: a turn about to be placed on a D without room for it gets that room first (it never waits for blocks
  that only the TTL would free).

What to free under pressure is chosen by a ranking. ``ValueRanking`` frees first the handles whose expected saving
per KV token and second is lowest: how soon the session is likely to come back (its idle time against its own mean
inter-turn gap, else its tenant's, and the tenant's share of turns that were followed by another) times the prefill
time a pull would save (from the cost model), divided by the KV it occupies. ``LruRanking`` (least recently used
first) is the baseline it is compared with (``kvshuttle bench-eviction`` compares them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvshuttle.control_plane.cost_model import PrefillCostModel

IDLE = "idle"
PRESSURE = "pressure"
ROOM = "room"
REASONS = (IDLE, PRESSURE, ROOM)
# A handle this close to its expiry is left to expire: P declines reads 5 s before it (kvshuttle.control_plane.session).
MIN_LEFT_S = 10.0


@dataclass(frozen=True)
class HeldKv:
    """One session's unspent KV handle on a decode worker, as its record describes it."""

    tenant: str
    session_id: str
    revision: int  # the record's revision (a free claims the handle at it)
    tokens: int  # tokens the handle covers
    block_size: int
    last_used: float  # when its last turn ended (epoch seconds)
    created: float  # when its first turn ended
    turns: int
    expires_at: float
    bytes_per_token: int = 0  # the worker's KV bytes per token (0: unknown)

    @property
    def key(self) -> tuple[str, str]:
        return self.tenant, self.session_id

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_size) if self.block_size > 0 else 0

    @property
    def kv_tokens(self) -> int:
        """KV cache tokens the handle occupies on D: whole blocks."""
        return self.blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.kv_tokens * self.bytes_per_token

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.last_used)

    def own_gap_s(self) -> float | None:
        """The session's mean inter-turn gap (None before its second turn)."""
        if self.turns < 2 or self.last_used <= self.created:
            return None
        return (self.last_used - self.created) / (self.turns - 1)


@dataclass(frozen=True)
class KvLimits:
    high_water: float = 0.8  # free under pressure once D's KV usage passes this fraction
    low_water: float = 0.6  # ... until it is back under this one
    held_budget: float = 0.7  # held KV may take at most this fraction of D's KV (0: no budget)
    idle_limit_s: float = 240.0  # free a session's KV after this long without a turn (0: never)
    room_headroom_tokens: int = 0  # extra tokens a turn's room is made with (beyond its prompt and answer)

    def __post_init__(self) -> None:
        if not 0 < self.low_water < self.high_water <= 1:
            raise ValueError(f"need 0 < low water ({self.low_water}) < high water ({self.high_water}) <= 1")
        if not 0 <= self.held_budget <= 1:
            raise ValueError(f"the held budget must be within 0..1, got {self.held_budget}")
        if self.idle_limit_s < 0 or self.room_headroom_tokens < 0:
            raise ValueError("the idle limit and the room headroom must be >= 0")

    @property
    def hysteresis(self) -> float:
        return self.high_water - self.low_water


@dataclass(frozen=True)
class Eviction:
    held: HeldKv
    reason: str  # IDLE, PRESSURE or ROOM


class Ranking(Protocol):
    name: str

    def order(self, held: Sequence[HeldKv], now: float) -> list[HeldKv]:
        """``held`` in the order to free them (first: the least worth keeping)."""
        ...


class LruRanking:
    """Least recently used first: the baseline."""

    name = "lru"

    def order(self, held: Sequence[HeldKv], now: float) -> list[HeldKv]:
        return sorted(held, key=lambda h: (h.last_used, h.key))


@dataclass
class TenantGaps:
    """What a tenant's sessions show about coming back: their mean inter-turn gap and the share of turns that were
    followed by another (``continue_prob``), over the tenant's current records, pulled toward priors."""

    gap_s: float
    continue_prob: float


@dataclass
class ReturnModel:
    """The chance that a session comes back before its handle expires.

    A session continues after a turn with probability ``c`` (its tenant's) and then after a gap drawn from an
    exponential with its mean gap ``g`` (its own, blended with its tenant's by how many gaps it has shown); otherwise
    it never does. Having been idle ``t`` seconds, the chance of a turn before the handle's expiry ``T`` (from its last
    turn) is ``c·(e^(-t/g) - e^(-T/g)) / (c·e^(-t/g) + 1 - c)``: it fades as ``t`` passes the usual gap.
    """

    prior_gap_s: float = 60.0
    prior_continue: float = 0.5
    prior_weight: float = 2.0  # pseudo-observations of the priors
    tenants: dict[str, TenantGaps] = field(default_factory=dict)

    def learn(self, held: Iterable[HeldKv]) -> None:
        """Refit every tenant's figures from the records given (the scheduler: those with unspent handles)."""
        sums: dict[str, list[float]] = {}
        for h in held:
            s = sums.setdefault(h.tenant, [0.0, 0.0, 0.0, 0.0])  # gap sum, gaps, continued turns, turns
            if h.turns >= 2 and h.last_used > h.created:
                s[0] += h.last_used - h.created
                s[1] += h.turns - 1
            s[2] += max(0, h.turns - 1)
            s[3] += max(1, h.turns)
        w = self.prior_weight
        self.tenants = {
            tenant: TenantGaps(gap_s=(s[0] + w * self.prior_gap_s) / (s[1] + w),
                               continue_prob=(s[2] + w * self.prior_continue) / (s[3] + w))
            for tenant, s in sums.items()}

    def gap_s(self, h: HeldKv) -> float:
        tenant = self.tenants.get(h.tenant)
        base = tenant.gap_s if tenant else self.prior_gap_s
        own = h.own_gap_s()
        if own is None:
            return base
        n = h.turns - 1  # gaps the session has shown
        return (n * own + base) / (n + 1)

    def _figures(self, h: HeldKv, now: float) -> tuple[float, float, float, float]:
        """(c, g, t, e^(-t/g)) of a handle."""
        tenant = self.tenants.get(h.tenant)
        c = tenant.continue_prob if tenant else self.prior_continue
        g = max(self.gap_s(h), 1e-3)
        t = h.idle_s(now)
        return c, g, t, math.exp(-t / g)

    def probability(self, h: HeldKv, now: float) -> float:
        c, g, t, stay = self._figures(h, now)
        life = max(t, h.expires_at - h.last_used)
        p = c * (stay - math.exp(-life / g)) / (c * stay + 1 - c) if c * stay + 1 - c > 0 else 0.0
        return min(1.0, max(0.0, p))

    def rate(self, h: HeldKv, now: float) -> float:
        """The session's chance per second of coming back now: P(it still continues | idle t) / its mean gap (0 once
        its handle has expired). KV held is capacity over time: a session that pays back in 20 s is worth about 12x
        one that pays back the same in 4 minutes."""
        if h.expires_at <= now:
            return 0.0
        c, g, _, stay = self._figures(h, now)
        alive = c * stay + 1 - c
        return c * stay / alive / g if alive > 0 else 0.0


class ValueRanking:
    """Lowest expected saving per KV token and second first: the session's return rate (ReturnModel.rate: the
    chance it still continues, over its mean gap) x the prefill time a pull saves / KV tokens held.

    ``saved_ms(tokens)``: how much faster the next turn's prefill is when it pulls ``tokens`` history tokens than
    when it recomputes them (the scheduler asks its cost model).
    """

    name = "value"

    def __init__(self, saved_ms: Callable[[int], float], model: ReturnModel | None = None):
        self.saved_ms = saved_ms
        self.model = model or ReturnModel()

    def value(self, h: HeldKv, now: float) -> float:
        """Expected prefill milliseconds saved per KV token held, per second held."""
        return self.model.rate(h, now) * max(0.0, self.saved_ms(h.tokens)) / max(1, h.kv_tokens)

    def order(self, held: Sequence[HeldKv], now: float) -> list[HeldKv]:
        return sorted(held, key=lambda h: (self.value(h, now), h.last_used, h.key))


RANKINGS = ("value", "lru")
# A history of this many tokens stands for "the next turn's new tokens" when the cost model prices a pull.
NEXT_TURN_TOKENS = 256


def pull_saving_ms(model: PrefillCostModel, tokens: int) -> float:
    """What pulling a ``tokens``-token history saves the next turn's prefill, by the cost model (fleet-wide fits)."""
    predicted = model.predict("", prompt_tokens=tokens + NEXT_TURN_TOKENS, reusable_tokens=tokens)
    return max(0.0, predicted.recompute_ms - (predicted.pull_ms or predicted.recompute_ms))


def make_ranking(name: str, model: PrefillCostModel) -> Ranking:
    if name == "lru":
        return LruRanking()
    if name == "value":
        return ValueRanking(lambda tokens: pull_saving_ms(model, tokens))
    raise ValueError(f"unknown eviction ranking {name!r}; choose one of {', '.join(RANKINGS)}")


def idle_evictions(held: Iterable[HeldKv], now: float, limits: KvLimits) -> list[Eviction]:
    """Handles idle past the limit (those about to expire anyway are left alone)."""
    if not limits.idle_limit_s:
        return []
    return [Eviction(h, IDLE) for h in held
            if h.idle_s(now) >= limits.idle_limit_s and h.expires_at - now >= MIN_LEFT_S]


def _take(ordered: Iterable[HeldKv], need_tokens: int, reason: str, now: float) -> list[Eviction]:
    out, freed = [], 0
    for h in ordered:
        if freed >= need_tokens:
            break
        if h.expires_at - now < MIN_LEFT_S:
            continue
        out.append(Eviction(h, reason))
        freed += h.kv_tokens
    return out


def pressure_evictions(held: Sequence[HeldKv], *, used_tokens: int, capacity_tokens: int, now: float,
                       limits: KvLimits, ranking: Ranking) -> list[Eviction]:
    """When D's usage passes the high-water mark (or its held KV the budget), the handles to free, in ranking order,
    until usage is under the low-water mark (and held KV under the budget less the hysteresis)."""
    if capacity_tokens <= 0 or not held:
        return []
    held_tokens = sum(h.kv_tokens for h in held)
    need = 0
    if used_tokens >= limits.high_water * capacity_tokens:
        need = used_tokens - round(limits.low_water * capacity_tokens)
    if limits.held_budget and held_tokens > limits.held_budget * capacity_tokens:
        target = max(0.0, limits.held_budget - limits.hysteresis) * capacity_tokens
        need = max(need, held_tokens - round(target))
    if need <= 0:
        return []
    return _take(ranking.order(held, now), need, PRESSURE, now)


def room_evictions(held: Sequence[HeldKv], *, need_tokens: int, free_tokens: int, now: float, limits: KvLimits,
                   ranking: Ranking, keep: tuple[str, str] | None = None) -> list[Eviction]:
    """A turn needing ``need_tokens`` KV tokens on a D with ``free_tokens`` free: the handles to free first (none
    when it fits). ``keep``: the turn's own session (its handle is about to be pulled, which frees it anyway)."""
    short = need_tokens + limits.room_headroom_tokens - free_tokens
    if short <= 0:
        return []
    return _take((h for h in ranking.order(held, now) if h.key != keep), short, ROOM, now)


@dataclass
class FreedLedger:
    """Tokens freed on one D that its load samples do not show yet, so a pressure round is not repeated before the
    engine has reported the room the last one made.

    A free counts as unseen until a sample taken after it shows the engine's usage down by at least half of what was
    freed since the usage it was freed from, or until ``settle_s`` have passed (an engine that reports nothing new,
    e.g. an idle one whose figures are only refreshed by its steps, is then believed again).
    """

    settle_s: float = 15.0
    frees: list[tuple[float, int, int]] = field(default_factory=list)  # (when, tokens, engine usage before)

    def note(self, when: float, tokens: int, used_before: int) -> None:
        self.frees.append((when, tokens, used_before))

    def unseen(self, sampled_at: float, used: int, now: float) -> int:
        """Tokens freed that a sample polled at ``sampled_at`` reporting ``used`` tokens does not show."""
        keep, freed = [], 0
        for when, tokens, before in self.frees:
            freed += tokens
            shown = sampled_at > when and used <= before - freed / 2
            if not shown and now - when < self.settle_s:
                keep.append((when, tokens, before))
        self.frees = keep
        return sum(tokens for _, tokens, _ in keep)
