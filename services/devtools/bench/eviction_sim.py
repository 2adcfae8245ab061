"""`kvshuttle bench-eviction`: decode-KV eviction rankings compared in a trace-driven simulation (no vLLM).

A seeded workload of multi-turn sessions is replayed against one decode worker (D) with a fixed KV capacity, once per
ranking (``value``, ``lru``) and once with unbounded capacity (the most pulls possible). The choices are made by the
real pure code the scheduler's KV manager runs (``kvshuttle.control_plane.kv_eviction``: ``KvLimits``, ``idle_evictions``,
``pressure_evictions``, ``room_evictions``, ``ValueRanking`` with its ``ReturnModel``, ``LruRanking``); only the
workload, the clock and the prefill cost are simulated.

Workload: ``--sessions`` sessions arrive as a Poisson process over ``--duration-s`` (simulated seconds), each of a
tenant drawn uniformly and of a kind drawn from that tenant's mix (``--tenant-mixes``):

- ``chatty``: many turns with short gaps (exponential, mean ``--chatty-gap-s``);
- ``returning``: a few turns with long gaps (exponential, mean ``--returning-gap-s``, mostly within the TTL);
- ``abandoning``: 1 to ``--abandoning-turns-max`` turns (chatty gaps), then never again.

Each turn adds new tokens to the session's history (the first one a larger prompt), capped at
``--max-history-tokens``. Each of ``--runs`` workloads (seeds ``--seed``, ``--seed`` + 1, ...) is replayed
identically for every policy; the figures are summed over the runs (one run's value/LRU ratio is noisy).

At each turn: if the session's handle is still held on D the turn pulls it ("pull kept") and saves
``recompute_ms(h) - pull_ms(h)`` of TTFT for its ``h`` history tokens; otherwise a turn that had a predecessor
recomputes ("pull lost": to an eviction, or to the handle's expiry). Then the turn's new handle (its whole history)
is held on D, with room made for it first by ``room_evictions``. After every turn, and every ``--tick-s``, expired
handles go, then idle evictions (when ``--idle-limit-s`` is set) and ``pressure_evictions`` run, the value ranking's
return model first refit (``learn``) from all held handles. D's used KV is the whole-block tokens of its held
handles (running requests are not modelled).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from typing import Any

from kvshuttle.control_plane import kv_eviction as ev
from kvshuttle.services.common.config import load, require, setting
from kvshuttle.services.devtools.bench.stats import write_json

KINDS = ("chatty", "returning", "abandoning")
UNBOUNDED = "unbounded"
GIB = 1 << 30


@dataclasses.dataclass
class EvictionSimConfig:
    """Decode-KV eviction rankings (value vs LRU) compared on one simulated decode worker, at equal capacity."""

    ENV_PREFIX = "KVSHUTTLE_EVICTION_SIM_"
    sessions: int = setting(400, "Sessions in the workload (arriving as a Poisson process over the duration)")
    duration_s: float = setting(3600.0, "Simulated seconds (turns after this are not played)")
    capacity_tokens: int = setting(200_000, "The decode worker's KV cache capacity (tokens)")
    block_size: int = setting(128, "KV block size (tokens): a handle holds whole blocks")
    ttl_s: float = setting(480.0, "A held handle's life after its turn (the decode worker's decoder_kv_blocks_ttl)")
    idle_limit_s: float = setting(0.0, "Free a session's handle after this long without a turn (0: off, so only "
                                       "the ranking under pressure is compared)")
    high_water: float = setting(0.8, "Free under pressure once D's KV usage passes this fraction of its capacity")
    low_water: float = setting(0.6, "... until it is back under this fraction")
    held_budget: float = setting(0.0, "Held KV may take at most this fraction of D's KV (0: no budget)")
    tick_s: float = setting(5.0, "Also run the eviction round every this many simulated seconds")
    seed: int = setting(0, "Workload seed (run k uses seed + k)")
    runs: int = setting(4, "Replay this many workloads (seeds seed .. seed+runs-1) and add their results up: one "
                           "run's value/LRU ratio is noisy")
    bytes_per_token: int = setting(131072, "KV bytes per token (to report GiB; 131072: about a 20-30B model, bf16)")
    tenant_mixes: str = setting("0.6/0.3/0.1,0.2/0.6/0.2,0.1/0.1/0.8,0.4/0.3/0.3",
                                "Per tenant (comma-separated), its chatty/returning/abandoning session fractions")
    chatty_gap_s: float = setting(20.0, "Mean gap between a chatty session's turns (exponential)")
    chatty_turns_min: int = setting(4, "Fewest turns of a chatty session")
    chatty_turns_max: int = setting(16, "Most turns of a chatty session")
    returning_gap_s: float = setting(240.0, "Mean gap between a returning session's turns (exponential)")
    returning_turns_min: int = setting(3, "Fewest turns of a returning session")
    returning_turns_max: int = setting(6, "Most turns of a returning session")
    abandoning_turns_max: int = setting(2, "An abandoning session has 1 to this many turns (short gaps between)")
    first_turn_tokens_min: int = setting(500, "Smallest first prompt (tokens: system prompt and first message)")
    first_turn_tokens_max: int = setting(4000, "Largest first prompt (tokens)")
    turn_tokens_min: int = setting(300, "Fewest tokens a later turn adds to the history (message and answer)")
    turn_tokens_max: int = setting(1500, "Most tokens a later turn adds to the history")
    max_history_tokens: int = setting(12000, "A session's history is capped at this many tokens")
    recompute_ms_per_token: float = setting(0.1, "Prefill cost model: recompute_ms = a*n + b*(n/1000)^2; this is a")
    recompute_ms_per_ktoken2: float = setting(2.5, "... and this is b (ms per thousand tokens squared: attention)")
    pull_ms_fixed: float = setting(5.0, "Pull cost model: pull_ms = c + d*n; this is c (ms)")
    pull_ms_per_token: float = setting(0.005, "... and this is d (ms per token)")
    out: str = setting("var/bench/eviction_sim.json", "Where the JSON report goes ('': not written)")

    def validate(self) -> None:
        require(self.sessions >= 1 and self.runs >= 1, "--sessions and --runs must be >= 1")
        require(self.duration_s > 0 and self.ttl_s > 0 and self.tick_s > 0,
                "--duration-s, --ttl-s and --tick-s must be > 0")
        require(self.capacity_tokens > 0 and self.block_size > 0, "--capacity-tokens and --block-size must be > 0")
        require(self.idle_limit_s >= 0 and self.bytes_per_token >= 0,
                "--idle-limit-s and --bytes-per-token must be >= 0")
        try:
            self.limits()
        except ValueError as exc:
            require(False, f"--high-water/--low-water/--held-budget: {exc}")
        mixes = []
        try:
            mixes = self.mixes()
        except ValueError:
            require(False, f"--tenant-mixes: expected chatty/returning/abandoning fractions per tenant, "
                           f"comma-separated, got {self.tenant_mixes!r}")
        require(bool(mixes) and all(len(m) == 3 and min(m) >= 0 and sum(m) > 0 for m in mixes),
                f"--tenant-mixes: each tenant needs 3 fractions >= 0 (chatty/returning/abandoning), not all 0; "
                f"got {self.tenant_mixes!r}")
        require(self.chatty_gap_s > 0 and self.returning_gap_s > 0, "--chatty-gap-s and --returning-gap-s must be > 0")
        require(1 <= self.chatty_turns_min <= self.chatty_turns_max, "need 1 <= --chatty-turns-min <= max")
        require(1 <= self.returning_turns_min <= self.returning_turns_max, "need 1 <= --returning-turns-min <= max")
        require(self.abandoning_turns_max >= 1, "--abandoning-turns-max must be >= 1")
        require(1 <= self.first_turn_tokens_min <= self.first_turn_tokens_max,
                "need 1 <= --first-turn-tokens-min <= --first-turn-tokens-max")
        require(1 <= self.turn_tokens_min <= self.turn_tokens_max, "need 1 <= --turn-tokens-min <= --turn-tokens-max")
        require(self.max_history_tokens >= self.first_turn_tokens_min,
                "--max-history-tokens must be >= --first-turn-tokens-min")
        require(min(self.recompute_ms_per_token, self.recompute_ms_per_ktoken2, self.pull_ms_fixed,
                    self.pull_ms_per_token) >= 0, "the cost model's coefficients must be >= 0")

    def limits(self) -> ev.KvLimits:
        return ev.KvLimits(high_water=self.high_water, low_water=self.low_water, held_budget=self.held_budget,
                           idle_limit_s=self.idle_limit_s)

    def mixes(self) -> list[tuple[float, ...]]:
        return [tuple(float(x) for x in part.split("/")) for part in self.tenant_mixes.split(",") if part.strip()]

    # -- the prefill cost model (one for the value ranking's saved_ms and for scoring) ----------------------------

    def recompute_ms(self, tokens: int) -> float:
        return self.recompute_ms_per_token * tokens + self.recompute_ms_per_ktoken2 * (tokens / 1000) ** 2

    def pull_ms(self, tokens: int) -> float:
        return self.pull_ms_fixed + self.pull_ms_per_token * tokens

    def saved_ms(self, tokens: int) -> float:
        """TTFT a pull of a ``tokens``-token history saves against recomputing it."""
        return max(0.0, self.recompute_ms(tokens) - self.pull_ms(tokens))


# -- the workload -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Turn:
    at: float  # simulated seconds
    history_tokens: int  # the session's history after this turn (what its handle covers)


@dataclasses.dataclass(frozen=True)
class Session:
    tenant: str
    session_id: str
    kind: str
    turns: tuple[Turn, ...]


def workload(cfg: EvictionSimConfig, seed: int | None = None) -> list[Session]:
    """The sessions (deterministic for the seed, ``cfg.seed`` by default); turns after the duration are left out."""
    rng = random.Random(cfg.seed if seed is None else seed)
    mixes = cfg.mixes()
    arrivals = sorted(rng.uniform(0, cfg.duration_s) for _ in range(cfg.sessions))  # a Poisson process, given N
    sessions = []
    for i, start in enumerate(arrivals):
        t_index = rng.randrange(len(mixes))
        kind = rng.choices(KINDS, weights=mixes[t_index])[0]
        if kind == "chatty":
            n, gap = rng.randint(cfg.chatty_turns_min, cfg.chatty_turns_max), cfg.chatty_gap_s
        elif kind == "returning":
            n, gap = rng.randint(cfg.returning_turns_min, cfg.returning_turns_max), cfg.returning_gap_s
        else:
            n, gap = rng.randint(1, cfg.abandoning_turns_max), cfg.chatty_gap_s
        at = start
        history = min(cfg.max_history_tokens, rng.randint(cfg.first_turn_tokens_min, cfg.first_turn_tokens_max))
        turns = []
        for k in range(n):
            if k:
                at += rng.expovariate(1 / gap)
                history = min(cfg.max_history_tokens, history + rng.randint(cfg.turn_tokens_min, cfg.turn_tokens_max))
            if at > cfg.duration_s:
                break
            turns.append(Turn(round(at, 3), history))
        sessions.append(Session(f"tenant-{t_index}", f"s{i:05d}", kind, tuple(turns)))
    return sessions


def workload_summary(sessions: Sequence[Session]) -> dict[str, Any]:
    """Sessions and turns by kind, sessions by tenant and kind (over every run's sessions)."""
    by_kind: dict[str, dict[str, int]] = {k: {"sessions": 0, "turns": 0} for k in KINDS}
    by_tenant: dict[str, dict[str, int]] = {}
    for s in sessions:
        by_kind[s.kind]["sessions"] += 1
        by_kind[s.kind]["turns"] += len(s.turns)
        row = by_tenant.setdefault(s.tenant, dict.fromkeys(KINDS, 0))
        row[s.kind] += 1
    return {"sessions": len(sessions), "turns": sum(len(s.turns) for s in sessions), "by_kind": by_kind,
            "by_tenant": dict(sorted(by_tenant.items()))}


# -- the simulation -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SimResult:
    policy: str
    turns: int = 0
    could_pull: int = 0  # turns whose previous turn's handle had not expired (pullable with room enough)
    pulls_kept: int = 0
    pulls_lost_evicted: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(ev.REASONS, 0))
    pulls_lost_expired: int = 0  # the gap outlived the TTL (no ranking can keep these)
    ttft_saved_ms: float = 0.0
    kept_by_kind: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    could_by_kind: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    evictions: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(ev.REASONS, 0))
    evicted_tokens: int = 0
    over_capacity: int = 0  # turns whose handle did not fit even after room evictions
    token_seconds: float = 0.0  # integral of held KV tokens over time
    peak_tokens: int = 0
    elapsed_s: float = 0.0  # CPU time of the run(s)
    runs: int = 1

    def add(self, other: SimResult) -> None:
        """Add another run's figures to these (the peak is the larger one)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "policy":
                continue
            if f.name == "peak_tokens":
                self.peak_tokens = max(mine, theirs)
            elif isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f.name, mine + theirs)

    def report(self, cfg: EvictionSimConfig) -> dict[str, Any]:
        gib_hours = self.token_seconds * cfg.bytes_per_token / GIB / 3600
        lost = sum(self.pulls_lost_evicted.values())
        return {
            "policy": self.policy, "turns": self.turns, "could_pull": self.could_pull, "pulls_kept": self.pulls_kept,
            "pulls_lost_to_evictions": lost, "pulls_lost_by_reason": dict(self.pulls_lost_evicted),
            "pulls_lost_to_expiry": self.pulls_lost_expired,
            "kept_share": round(self.pulls_kept / self.could_pull, 4) if self.could_pull else None,
            "ttft_saved_s": round(self.ttft_saved_ms / 1000, 3),
            "kept_by_kind": dict(self.kept_by_kind), "could_pull_by_kind": dict(self.could_by_kind),
            "mean_held_gib": round(self.token_seconds / (cfg.duration_s * self.runs) * cfg.bytes_per_token / GIB, 3),
            "peak_held_gib": round(self.peak_tokens * cfg.bytes_per_token / GIB, 3),
            "held_gib_hours": round(gib_hours, 4),
            "pulls_kept_per_gib_hour": round(self.pulls_kept / gib_hours, 3) if gib_hours else None,
            "ttft_saved_s_per_gib_hour": round(self.ttft_saved_ms / 1000 / gib_hours, 3) if gib_hours else None,
            "evictions": dict(self.evictions), "evictions_total": sum(self.evictions.values()),
            "evicted_gib": round(self.evicted_tokens * cfg.bytes_per_token / GIB, 3),
            "over_capacity": self.over_capacity, "runs": self.runs, "cpu_s": round(self.elapsed_s, 3),
        }


def make_ranking(name: str, cfg: EvictionSimConfig) -> ev.Ranking:
    if name == "value":
        return ev.ValueRanking(cfg.saved_ms, ev.ReturnModel())
    if name == "lru":
        return ev.LruRanking()
    raise ValueError(f"unknown ranking {name!r}")


class DecodeSim:
    """One decode worker's held handles under one ranking (``ranking`` None: unbounded capacity, nothing freed but
    by expiry)."""

    def __init__(self, cfg: EvictionSimConfig, ranking: ev.Ranking | None):
        self.cfg, self.ranking = cfg, ranking
        self.limits = cfg.limits()
        self.held: dict[tuple[str, str], ev.HeldKv] = {}
        self.used = 0  # whole-block tokens of the held handles
        self.evicted: dict[tuple[str, str], str] = {}  # session -> why its last handle was freed
        self.result = SimResult(ranking.name if ranking else UNBOUNDED)
        self.last_t = 0.0

    # -- held handles ----------------------------------------------------------------------------------------------

    def _add(self, h: ev.HeldKv) -> None:
        self.held[h.key] = h
        self.used += h.kv_tokens
        self.result.peak_tokens = max(self.result.peak_tokens, self.used)

    def _drop(self, key: tuple[str, str]) -> ev.HeldKv | None:
        h = self.held.pop(key, None)
        if h is not None:
            self.used -= h.kv_tokens
        return h

    def _evict(self, evictions: Sequence[ev.Eviction]) -> None:
        for e in evictions:
            if self._drop(e.held.key) is None:
                continue
            self.evicted[e.held.key] = e.reason
            self.result.evictions[e.reason] += 1
            self.result.evicted_tokens += e.held.kv_tokens

    def _advance(self, now: float) -> None:
        """Account held KV up to ``now`` and let expired handles go (at their expiry, not later)."""
        expired = sorted((h.expires_at, h.key) for h in self.held.values() if h.expires_at <= now)
        for at, key in expired:
            self.result.token_seconds += self.used * max(0.0, at - self.last_t)
            self.last_t = max(self.last_t, at)
            self._drop(key)
        self.result.token_seconds += self.used * max(0.0, now - self.last_t)
        self.last_t = max(self.last_t, now)

    def _learn(self) -> None:
        if isinstance(self.ranking, ev.ValueRanking):
            self.ranking.model.learn(self.held.values())

    # -- events ----------------------------------------------------------------------------------------------------

    def turn(self, session: Session, index: int, now: float) -> None:
        cfg, r = self.cfg, self.result
        self._advance(now)
        key = (session.tenant, session.session_id)
        r.turns += 1
        if index > 0:
            prev = session.turns[index - 1]
            if now < prev.at + cfg.ttl_s:
                r.could_pull += 1
                r.could_by_kind[session.kind] += 1
                old = self._drop(key)  # the pull reads it (and D frees it): the new handle replaces it
                if old is not None:
                    r.pulls_kept += 1
                    r.kept_by_kind[session.kind] += 1
                    r.ttft_saved_ms += cfg.saved_ms(old.tokens)
                else:
                    r.pulls_lost_evicted[self.evicted.get(key, ev.PRESSURE)] += 1
            else:
                r.pulls_lost_expired += 1
                self._drop(key)
        self.evicted.pop(key, None)
        t = session.turns[index]
        new = ev.HeldKv(tenant=session.tenant, session_id=session.session_id, revision=index + 1,
                        tokens=t.history_tokens, block_size=cfg.block_size, last_used=now,
                        created=session.turns[0].at, turns=index + 1, expires_at=now + cfg.ttl_s,
                        bytes_per_token=cfg.bytes_per_token)
        if self.ranking is not None:
            free = cfg.capacity_tokens - self.used
            if new.kv_tokens > free:
                self._learn()
                self._evict(ev.room_evictions(list(self.held.values()), need_tokens=new.kv_tokens, free_tokens=free,
                                              now=now, limits=self.limits, ranking=self.ranking, keep=key))
            if self.used + new.kv_tokens > cfg.capacity_tokens:
                r.over_capacity += 1
        self._add(new)
        self.round(now, advanced=True)

    def round(self, now: float, *, advanced: bool = False) -> None:
        """One eviction round: idle handles, then pressure (what the scheduler's KV manager does every interval)."""
        if not advanced:
            self._advance(now)
        if self.ranking is None:
            return
        self._learn()
        held = list(self.held.values())
        idle = ev.idle_evictions(held, now, self.limits)
        if idle:
            self._evict(idle)
            held = list(self.held.values())
        self._evict(ev.pressure_evictions(held, used_tokens=self.used, capacity_tokens=self.cfg.capacity_tokens,
                                          now=now, limits=self.limits, ranking=self.ranking))


def simulate(cfg: EvictionSimConfig, sessions: Sequence[Session], ranking: ev.Ranking | None) -> SimResult:
    started = time.process_time()
    sim = DecodeSim(cfg, ranking)
    events: list[tuple[float, int, int, int]] = []  # (at, 0: turn / 1: tick, session index, turn index)
    for si, s in enumerate(sessions):
        events += [(t.at, 0, si, ti) for ti, t in enumerate(s.turns)]
    ticks = int(cfg.duration_s // cfg.tick_s)
    events += [(k * cfg.tick_s, 1, 0, 0) for k in range(1, ticks + 1)]
    events.sort()
    for at, kind, si, ti in events:
        if kind == 0:
            sim.turn(sessions[si], ti, at)
        else:
            sim.round(at)
    sim._advance(cfg.duration_s)
    sim.result.elapsed_s = time.process_time() - started
    return sim.result


POLICIES = (*ev.RANKINGS, UNBOUNDED)


def run(cfg: EvictionSimConfig) -> dict[str, Any]:
    """Every policy over ``cfg.runs`` workloads: the summed results, value/LRU ratios and each run's figures."""
    totals: dict[str, SimResult] = {}
    per_run, all_sessions = [], []
    for k in range(cfg.runs):
        sessions = workload(cfg, cfg.seed + k)
        all_sessions += sessions
        row: dict[str, Any] = {"seed": cfg.seed + k}
        for name in POLICIES:
            res = simulate(cfg, sessions, make_ranking(name, cfg) if name != UNBOUNDED else None)
            row[name] = {"pulls_kept": res.pulls_kept, "ttft_saved_s": round(res.ttft_saved_ms / 1000, 3)}
            if name in totals:
                totals[name].add(res)
            else:
                totals[name] = res
        per_run.append(row)
    results = {name: res.report(cfg) for name, res in totals.items()}
    value, lru = results["value"], results["lru"]

    def ratio(key: str) -> float | None:
        return round(value[key] / lru[key], 4) if lru[key] else None

    return {
        "method": method_text(cfg),
        "config": dataclasses.asdict(cfg),
        "workload": workload_summary(all_sessions),
        "capacity_gib": round(cfg.capacity_tokens * cfg.bytes_per_token / GIB, 3),
        "results": results,
        "value_over_lru": {"pulls_kept": ratio("pulls_kept"), "ttft_saved_s": ratio("ttft_saved_s"),
                           "pulls_kept_per_gib_hour": ratio("pulls_kept_per_gib_hour"),
                           "ttft_saved_s_per_gib_hour": ratio("ttft_saved_s_per_gib_hour"),
                           "runs_value_saved_more_ttft": sum(r["value"]["ttft_saved_s"] > r["lru"]["ttft_saved_s"]
                                                             for r in per_run),
                           "runs": cfg.runs},
        "per_run": per_run,
    }


def method_text(cfg: EvictionSimConfig) -> str:
    idle = f"{cfg.idle_limit_s:g} s" if cfg.idle_limit_s else "off"
    budget = f"{cfg.held_budget:.0%}" if cfg.held_budget else "off"
    return (
        f"Trace-driven simulation of one decode worker (D) with {cfg.capacity_tokens} KV tokens "
        f"({cfg.capacity_tokens * cfg.bytes_per_token / GIB:.1f} GiB at {cfg.bytes_per_token} B/token), blocks of "
        f"{cfg.block_size}, handles held {cfg.ttl_s:g} s after their turn. {cfg.sessions} sessions arrive as a "
        f"Poisson process over {cfg.duration_s:g} simulated s, of tenants with different chatty/returning/abandoning "
        f"mixes ({cfg.tenant_mixes}); gaps are exponential (chatty mean {cfg.chatty_gap_s:g} s, returning mean "
        f"{cfg.returning_gap_s:g} s); each of {cfg.runs} seeded workloads (seeds {cfg.seed}.."
        f"{cfg.seed + cfg.runs - 1}) is replayed for every policy and the figures are summed over them. The eviction "
        f"choices are the real kvshuttle.control_plane.kv_eviction code (pressure above {cfg.high_water:.0%} down to "
        f"{cfg.low_water:.0%}, room for each turn's handle, idle limit {idle}, held budget {budget}), run after every "
        f"turn and every {cfg.tick_s:g} s; the value ranking's return model is refit from all held handles before "
        f"each round. Turns are instantaneous and D's usage counts only held handles (no running requests). Prefill "
        f"cost is a parametric model, NOT a measurement: recompute_ms(n) = {cfg.recompute_ms_per_token:g}*n + "
        f"{cfg.recompute_ms_per_ktoken2:g}*(n/1000)^2 and pull_ms(n) = {cfg.pull_ms_fixed:g} + "
        f"{cfg.pull_ms_per_token:g}*n for an n-token history; the same model gives the value ranking's saved_ms and "
        f"scores TTFT saved (recompute_ms - pull_ms per pull kept). 'could pull': turns whose previous handle had not "
        f"expired; 'unbounded': infinite capacity, the most pulls possible."
    )


def format_report(rep: dict[str, Any]) -> str:
    res = rep["results"]
    cols = ["value", "lru", UNBOUNDED]
    rows = [
        ("turns", "turns", "{}"),
        ("turns that could pull", "could_pull", "{}"),
        ("pulls kept", "pulls_kept", "{}"),
        ("  share of could-pull", "kept_share", "{:.1%}"),
        ("pulls lost to evictions", "pulls_lost_to_evictions", "{}"),
        ("pulls lost to expiry", "pulls_lost_to_expiry", "{}"),
        ("TTFT saved (s)", "ttft_saved_s", "{:.1f}"),
        ("mean held (GiB)", "mean_held_gib", "{:.2f}"),
        ("peak held (GiB)", "peak_held_gib", "{:.2f}"),
        ("pulls kept / GiB-hour", "pulls_kept_per_gib_hour", "{:.2f}"),
        ("TTFT saved s / GiB-hour", "ttft_saved_s_per_gib_hour", "{:.2f}"),
        ("evictions", "evictions_total", "{}"),
        ("over capacity", "over_capacity", "{}"),
    ]

    def cell(fmt: str, v: Any) -> str:
        return "-" if v is None else fmt.format(v)

    width = max(len(r[0]) for r in rows)
    cfg = rep["config"]
    runs = cfg["runs"]
    lines = [f"decode-KV eviction: {rep['workload']['sessions']} sessions, {rep['workload']['turns']} turns over "
             f"{runs} run(s) of {cfg['duration_s']:g} s; D capacity {cfg['capacity_tokens']} tokens "
             f"({rep['capacity_gib']} GiB)",
             f"  {'':<{width}} " + " ".join(f"{c:>10}" for c in cols)]
    for label, key, fmt in rows:
        lines.append(f"  {label:<{width}} " + " ".join(f"{cell(fmt, res[c][key]):>10}" for c in cols))
    lines.append("  kept by kind (value | lru | unbounded of could-pull): " + "; ".join(
        f"{k} {res['value']['kept_by_kind'][k]} | {res['lru']['kept_by_kind'][k]} | "
        f"{res[UNBOUNDED]['kept_by_kind'][k]} of {res[UNBOUNDED]['could_pull_by_kind'][k]}" for k in KINDS))
    ratio = rep["value_over_lru"]
    lines.append(f"  value / lru: pulls kept x{cell('{:.3f}', ratio['pulls_kept'])}, TTFT saved "
                 f"x{cell('{:.3f}', ratio['ttft_saved_s'])}; value saved more TTFT than lru in "
                 f"{ratio['runs_value_saved_more_ttft']} of {runs} run(s): "
                 + ", ".join(f"seed {r['seed']} {r['value']['ttft_saved_s']:.1f} vs {r['lru']['ttft_saved_s']:.1f} s"
                             for r in rep["per_run"]))
    lines.append("")
    lines.append("method: " + rep["method"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    cfg = load(EvictionSimConfig, argv, prog="kvshuttle bench-eviction")
    started = time.monotonic()
    rep = run(cfg)
    rep["elapsed_s"] = round(time.monotonic() - started, 3)
    print(format_report(rep), flush=True)
    if cfg.out:
        print(f"wrote {write_json(cfg.out, rep)} ({rep['elapsed_s']} s)", flush=True)
