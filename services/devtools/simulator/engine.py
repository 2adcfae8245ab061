"""The discrete-event simulation of one deployment (a :class:`~.strategies.Strategy`) serving a workload.

A turn's life, with the times a real turn pays:

1. it arrives (the first turn at its session's start, a later one ``gap_s`` after the previous answer ended);
   the strategy routes it (the planner strategies run the real planner on the session's record: its prefix digests,
   checkpoints and handle, exactly as the registry would keep them);
2. it waits in its prefill worker's FIFO queue, then P computes what its prefix cache and the pull do not cover and
   loads what the pull brings (a pull's handle is claimed when planned: no freeing round takes it; it expired
   meanwhile: the turn recomputes, counted as ``pull_lost``);
3. D admits it when its KV cache has room for the prompt and the answer (kvshuttle first frees held handles for it,
   the ``room`` rule; the others wait for room: a stall), receives the prompt's KV from P, and samples the first
   token: the time to first token ends there;
4. D decodes the answer; then it holds the turn's KV as the session's handle (the strategies that keep KV) until a
   pull reads it, its TTL ends, or a freeing round frees it; the record is written (digests over prompt + answer).

Every ``tick_s`` expired handles go, and kvshuttle's freeing rounds run (idle, pressure) with the real ranking.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshuttle.control_plane import kv_eviction as ev
from kvshuttle.control_plane.decision import Choice, HandleView
from kvshuttle.control_plane.policies import Outcome
from kvshuttle.control_plane.prefix import PrefixHasher, checkpoint_lengths
from kvshuttle.services.devtools.simulator.cluster import DecodeWorker, PrefillWorker, UnitChain, token_ids
from kvshuttle.services.devtools.simulator.hardware import Profile
from kvshuttle.services.devtools.simulator.strategies import Routed, Strategy
from kvshuttle.services.devtools.simulator.workload import OWN_SEGMENTS, SimSession

PULL_LOST = "pull_lost"
_ARRIVE, _P_DONE, _DECODE_DONE, _TICK = range(4)


@dataclass(frozen=True)
class SimSettings:
    ttl_s: float = 480.0  # vLLM's decoder_kv_blocks_ttl
    tick_s: float = 5.0
    unit_tokens: int = 256  # prefix-cache accounting unit
    limits: ev.KvLimits = field(default_factory=ev.KvLimits)
    seed: int = 0
    # > 0: a closed loop of this many sessions at a time (a benchmark client's concurrency): the first ones start at
    # their ``start_s``, each later one (in order of ``start_s``) its first turn's ``gap_s`` after one ends.
    sessions_in_flight: int = 0
    # > 0: every worker runs on one host of this many cores (a CPU deployment, as `kvshuttle bench`'s local stack):
    # while k engines are busy (prefill workers computing, decode workers with a stream), prefills progress
    # max(1, k / host_cores) times slower (processor sharing: re-timed whenever k changes), and a turn's first
    # decode step takes that much longer. 0: each worker has its own hardware.
    host_cores: float = 0.0


@dataclass(slots=True)
class Record:
    """What the registry keeps for a session (the parts the planner reads)."""

    covered: int
    digest: bytes
    checkpoints: list[tuple[int, bytes]]
    handle_json: str
    source: str
    held_key: tuple[str, str]
    expires_at: float
    freed: str = ""


@dataclass(slots=True, eq=False)
class Live:
    spec: SimSession
    chain: UnitChain
    segments: list[tuple[int, int]]
    created: float
    turn: int = 0
    record: Record | None = None
    boundaries: list[int] = field(default_factory=list)  # checkpoint lengths of the record
    hasher: PrefixHasher | None = None  # the history's digest, extended turn by turn (strategies that pull)
    digests: dict[int, bytes] = field(default_factory=dict)  # checkpoint length -> digest

    @property
    def key(self) -> tuple[str, str]:
        return self.spec.tenant, self.spec.session_id


@dataclass(slots=True, eq=False)
class InFlight:
    live: Live
    arrival: float
    prompt: int
    boundary: int  # history tokens before this turn's new ones
    keys: list[int]  # the prompt's whole units
    routed: Routed
    output: int
    need: int = 0  # D's KV tokens for prompt + answer (whole blocks)
    p_start: float = 0.0
    p_end: float = 0.0
    # a shared host (SimSettings.host_cores): the prefill's work left at full speed (ms), since when at which slowdown,
    # and which of its completion events is current
    work_ms: float = 0.0
    rate_since: float = 0.0
    share: float = 1.0
    version: int = 0
    cached: int = 0
    pulled: int = 0
    computed: int = 0
    code: str = ""


class Columns:
    """Per-turn results, one array per column (a million turns in a few tens of MB)."""

    def __init__(self) -> None:
        self.arrival, self.ttft_ms, self.p_wait_ms, self.d_wait_ms = (array("d") for _ in range(4))
        self.prompt, self.history, self.pulled, self.computed, self.cached = (array("q") for _ in range(5))
        # which turn each row is (index into the simulation's sessions, turn number) and its prefill worker's index
        self.session, self.turn, self.prefill = array("q"), array("i"), array("i")
        self.codes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ttft_ms)


@dataclass
class Result:
    strategy: str
    turns: Columns
    sessions: int
    started: float = 0.0  # first arrival (simulated s)
    ended: float = 0.0  # last answer
    peak_live_sessions: int = 0
    held_fraction_sum: float = 0.0
    held_fraction_max: float = 0.0
    used_fraction_sum: float = 0.0
    ticks: int = 0
    prefill_busy_s: float = 0.0  # prefill workers' busy time, summed
    prefill_workers: int = 0
    bytes_p_to_d: int = 0
    bytes_d_to_p: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ev.REASONS, 0))
    expired: int = 0
    d_stalls: int = 0


class Simulation:
    def __init__(self, sessions: Sequence[SimSession], strategy: Strategy, profile: Profile,
                 prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker], settings: SimSettings):
        self.sessions, self.strategy, self.profile, self.settings = sessions, strategy, profile, settings
        self.prefill, self.decode = list(prefill), list(decode)
        self.decode_by_id = {d.worker_id: d for d in self.decode}
        self.rng = random.Random(settings.seed + 1)
        self.events: list = []
        self._seq = itertools.count()
        self._own = itertools.count(OWN_SEGMENTS)
        self.now = 0.0
        self.pending = 0  # events other than ticks
        self.live = 0
        self.holders: dict[tuple[str, str], Live] = {}  # a held handle's key -> its session
        self.result = Result(strategy.name, Columns(), len(sessions), prefill_workers=len(self.prefill))
        self.ranking = ev.make_ranking("value", strategy.model) if strategy.manages_kv and strategy.model else None
        self.pulls_possible = strategy.keeps_kv
        self._session_index = {id(s): i for i, s in enumerate(self.sessions)}
        self._prefill_index = {p.worker_id: i for i, p in enumerate(self.prefill)}
        self._waiting: list[SimSession] = []  # closed loop: sessions not started yet, next last
        self._streams: dict[str, int] = {d.worker_id: 0 for d in self.decode}  # decode streams in flight per D
        self._computing: set[InFlight] = set()  # prefills in progress (a shared host: processor sharing)
        self._shared = settings.host_cores > 0

    # -- the event loop ------------------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, obj=None) -> None:
        if kind != _TICK:
            self.pending += 1
        heapq.heappush(self.events, (at, next(self._seq), kind, obj))

    def run(self) -> Result:
        unit = self.settings.unit_tokens
        starting = list(self.sessions)
        if self.settings.sessions_in_flight > 0:
            ordered = sorted(self.sessions, key=lambda s: s.start_s)
            starting = ordered[:self.settings.sessions_in_flight]
            self._waiting = ordered[self.settings.sessions_in_flight:][::-1]
        for s in starting:
            self._push(s.start_s, _ARRIVE, Live(s, UnitChain(unit), [], created=s.start_s))
        if self.sessions:
            self.result.started = min(s.start_s for s in self.sessions)
            self._push(self.result.started + self.settings.tick_s, _TICK)
        handlers = (self._arrive, self._prefill_done, self._decode_done, self._tick)
        while self.events:
            at, _, kind, obj = heapq.heappop(self.events)
            if kind != _TICK:
                self.pending -= 1
            self.now = at
            handlers[kind](obj)
        return self.result

    def _noise(self) -> float:
        sigma = self.profile.noise
        return self.rng.lognormvariate(0.0, sigma) if sigma > 0 else 1.0

    # -- arrival and routing -------------------------------------------------------------------------------------

    def _arrive(self, live: Live) -> None:
        spec = live.spec
        turn = spec.turns[live.turn]
        if live.turn == 0:
            self.live += 1
            self.result.peak_live_sessions = max(self.result.peak_live_sessions, self.live)
            for seg, n in spec.first:
                live.segments.append((seg, n))
                live.chain.extend(seg, n)
        boundary = live.chain.tokens
        if live.hasher is None and self.pulls_possible:
            live.hasher = PrefixHasher()
            live.hasher.extend(token_ids(live.segments))
        if live.hasher is not None and live.turn:
            live.digests[boundary] = live.hasher.digest()
        if turn.new_tokens:
            seg = next(self._own)
            live.segments.append((seg, turn.new_tokens))
            live.chain.extend(seg, turn.new_tokens)
            if live.hasher is not None:
                live.hasher.extend(array("i", [seg]) * turn.new_tokens)
        n = live.chain.tokens
        record = live.record
        view = None
        prompt: Sequence[int] = range(n)  # the ids are read only when a pull is possible, or to hash the prompt
        if self.strategy.reads_kv_events:
            prompt = token_ids(live.segments)
        if record is not None and self.pulls_possible:
            view = HandleView(record.handle_json, record.covered, self.profile.block_size,
                              expires_in_s=record.expires_at - self.now, claimed=False, source_alive=True,
                              prefix_digest=record.digest, checkpoints=record.checkpoints, kv_freed=record.freed)
            if not record.freed and record.expires_at > self.now and isinstance(prompt, range):
                prompt = token_ids(live.segments)
        unit = self.settings.unit_tokens
        keys = live.chain.keys[: n // unit]
        routed = self.strategy.route(live.key, prompt, view, record.source if record else "", keys[: (n - 1) // unit])
        flight = InFlight(live, self.now, n, boundary, keys, routed, turn.output_tokens, code=routed.code)
        if routed.choice is Choice.PULL:
            source = self.decode_by_id[record.source]
            if source.pin(record.held_key) is None:  # freed between the record's read and the claim
                self._lose_pull(flight)
        bs = self.profile.block_size
        flight.need = -(-(n + turn.output_tokens) // bs) * bs
        d = routed.decode
        if self.ranking is not None:  # the scheduler makes room on D for the turn it places there
            self._make_room(d, flight.need, live.key)
        d.reserved_tokens += flight.need
        p = routed.prefill
        p.queue.append(flight)
        if not p.busy:
            self._start_prefill(p)

    def _lose_pull(self, flight: InFlight) -> None:
        r = flight.routed
        flight.routed = Routed(r.prefill, r.decode, Choice.RECOMPUTE, PULL_LOST, pullable=r.reusable,
                               cached_estimate=r.cached_estimate, policy=r.policy, block_hashes=r.block_hashes)
        flight.code = PULL_LOST

    # -- prefill -------------------------------------------------------------------------------------------------

    def _start_prefill(self, p: PrefillWorker) -> None:
        flight = p.queue.popleft()
        p.busy = True
        n, unit = flight.prompt, self.settings.unit_tokens
        record = flight.live.record
        if flight.routed.choice is Choice.PULL and record is not None and record.expires_at <= self.now:
            self.decode_by_id[record.source].unpin(record.held_key)  # vLLM freed it at its TTL
            self._lose_pull(flight)
        hit = p.cached_units(flight.keys[: (n - 1) // unit]) * unit
        reusable = flight.routed.reusable if flight.routed.choice is Choice.PULL else 0
        flight.cached = hit
        flight.pulled = max(0, reusable - hit)
        flight.computed = n - max(reusable, hit)
        prof = self.profile
        service = prof.compute_ms(flight.computed, n - flight.computed) * self._noise()
        if flight.pulled:
            service += prof.transfer_ms(flight.pulled) * self._noise()
        flight.p_start = self.now
        if self._shared:  # processor sharing: its end moves whenever the busy engines change
            flight.work_ms, flight.rate_since = service, self.now
            self._computing.add(flight)
            self._retime()
            return
        flight.p_end = self.now + service / 1000
        self.result.prefill_busy_s += service / 1000
        self._push(flight.p_end, _P_DONE, flight)

    def _retime(self) -> None:
        """The busy engines changed (a shared host): every prefill in progress runs at the new share from now on."""
        share = self._share()
        for f in self._computing:
            f.work_ms = max(0.0, f.work_ms - (self.now - f.rate_since) * 1000 / f.share)
            f.rate_since, f.share = self.now, share
            f.version += 1
            self._push(self.now + f.work_ms * share / 1000, _P_DONE, (f, f.version))

    def _share(self) -> float:
        """How many times longer work takes now on a shared host (``SimSettings.host_cores``): busy engines per
        core."""
        if not self._shared:
            return 1.0
        busy = len(self._computing) + sum(1 for n in self._streams.values() if n)
        return max(1.0, busy / self.settings.host_cores)

    def _prefill_done(self, obj) -> None:
        if isinstance(obj, tuple):  # a shared host: only the current completion of a re-timed prefill counts
            flight, version = obj
            if version != flight.version:
                return
            self._computing.discard(flight)
            flight.p_end = self.now
            self.result.prefill_busy_s += self.now - flight.p_start
            self._retime()
        else:
            flight = obj
        r = flight.routed
        p = r.prefill
        p.busy = False
        p.insert(flight.keys, r.block_hashes)
        record = flight.live.record
        pulled = r.choice is Choice.PULL
        if pulled:
            source = self.decode_by_id[record.source]
            source.unpin(record.held_key)
            self._wake(source)
        self.strategy.observe(Outcome(
            p.worker_id, flight.prompt, flight.pulled, flight.computed, (flight.p_end - flight.p_start) * 1000,
            r.choice, source_worker=record.source if pulled else "", pullable_tokens=r.pullable, policy=r.policy,
            cached_estimate=r.cached_estimate))
        if p.queue:
            self._start_prefill(p)
        self._admit_or_wait(r.decode, flight)

    # -- decode --------------------------------------------------------------------------------------------------

    def _admit_or_wait(self, d: DecodeWorker, flight: InFlight) -> None:
        if not d.waiting and d.free_tokens >= flight.need:
            self._admit(d, flight)
        else:
            self.result.d_stalls += 1
            d.waiting.append(flight)

    def _make_room(self, d: DecodeWorker, need: int, keep: tuple[str, str]) -> None:
        """kvshuttle's ``room`` rule, once per placed turn (the scheduler's make_room): free held handles on D
        until ``need`` tokens fit, the session's own handle excepted."""
        if d.free_tokens >= need:
            return
        held = [h for h in d.held.values() if self.holders.get(h.key) is None or self.holders[h.key].key != keep]
        for e in ev.room_evictions(held, need_tokens=need, free_tokens=d.free_tokens, now=self.now,
                                   limits=self.settings.limits, ranking=self.ranking):
            self._evict(d, e.held, ev.ROOM)

    def _admit(self, d: DecodeWorker, flight: InFlight) -> None:
        d.reserved_tokens -= flight.need
        d.admit(flight.need)
        self._streams[d.worker_id] += 1
        if self._streams[d.worker_id] == 1 and self._shared:
            self._retime()
        prof = self.profile
        first = self.now + (prof.handoff_ms(flight.prompt) * self._noise() + prof.tpot_ms) * self._share() / 1000
        res = self.result
        cols = res.turns
        cols.arrival.append(flight.arrival)
        cols.ttft_ms.append((first - flight.arrival) * 1000)
        cols.p_wait_ms.append((flight.p_start - flight.arrival) * 1000)
        cols.d_wait_ms.append((self.now - flight.p_end) * 1000)
        cols.prompt.append(flight.prompt)
        cols.history.append(flight.boundary if flight.live.turn else 0)
        cols.pulled.append(flight.pulled)
        cols.computed.append(flight.computed)
        cols.cached.append(flight.cached)
        cols.session.append(self._session_index[id(flight.live.spec)])
        cols.turn.append(flight.live.turn)
        cols.prefill.append(self._prefill_index[flight.routed.prefill.worker_id])
        cols.codes[flight.code] = cols.codes.get(flight.code, 0) + 1
        res.bytes_p_to_d += flight.prompt * prof.kv_bytes_per_token
        res.bytes_d_to_p += flight.pulled * prof.kv_bytes_per_token
        done = first + max(0, flight.output - 1) * prof.tpot_ms / 1000
        self._push(done, _DECODE_DONE, flight)

    def _decode_done(self, flight: InFlight) -> None:
        live, r = flight.live, flight.routed
        d = r.decode
        d.finish(flight.need)
        self._streams[d.worker_id] -= 1
        if not self._streams[d.worker_id] and self._shared:
            self._retime()
        seg = next(self._own)
        live.segments.append((seg, flight.output))
        live.chain.extend(seg, flight.output)
        covered_digest = b""
        if live.hasher is not None:  # the handle covers prompt + answer less its last token
            live.hasher.extend(array("i", [seg]) * (flight.output - 1))
            covered_digest = live.hasher.digest()
            live.hasher.extend(array("i", [seg]))
        old = live.record
        if old is not None and r.choice is Choice.RECOMPUTE and self.strategy.frees_unused and not old.freed:
            source = self.decode_by_id[old.source]
            if source.release(old.held_key) is not None:
                self.holders.pop(old.held_key, None)
                self._wake(source)
        live.record = self._record(live, flight, d, covered_digest) if self.strategy.keeps_kv else None
        live.turn += 1
        if live.turn < len(live.spec.turns):
            self._push(self.now + live.spec.turns[live.turn].gap_s, _ARRIVE, live)
        else:
            self.live -= 1
            if self._waiting:  # closed loop: the next session takes this one's place
                nxt = self._waiting.pop()
                start = self.now + (nxt.turns[0].gap_s if nxt.turns else 0.0)
                self._push(start, _ARRIVE, Live(nxt, UnitChain(self.settings.unit_tokens), [], created=start))
        self.result.ended = max(self.result.ended, self.now)
        self._wake(d)

    def _record(self, live: Live, flight: InFlight, d: DecodeWorker, digest: bytes) -> Record:
        """The record the gateway writes after the turn: D's handle over prompt + answer (less the last token)."""
        covered = flight.prompt + flight.output - 1
        bs = self.profile.block_size
        held_key = (live.spec.tenant, f"{live.spec.session_id}/{live.turn}")
        expires = self.now + self.settings.ttl_s
        d.hold(ev.HeldKv(live.spec.tenant, held_key[1], live.turn, covered, bs, last_used=self.now,
                         created=live.created, turns=live.turn + 1, expires_at=expires,
                         bytes_per_token=self.profile.kv_bytes_per_token))
        self.holders[held_key] = live
        # every prompt here extends the history, so the previous checkpoints stay valid (the gateway's rule)
        live.boundaries = checkpoint_lengths(live.boundaries, flight.boundary, covered)
        live.digests = {b: live.digests[b] for b in live.boundaries if b in live.digests}
        handle = json.dumps({"do_remote_decode": True, "remote_block_ids": [list(range(math.ceil(covered / bs)))],
                             "remote_num_tokens": covered, "remote_engine_id": d.worker_id,
                             "remote_host": d.worker_id, "remote_port": 1})
        return Record(covered, digest, list(live.digests.items()), handle, d.worker_id, held_key, expires)

    def _wake(self, d: DecodeWorker) -> None:
        while d.waiting and d.free_tokens >= d.waiting[0].need:
            self._admit(d, d.waiting.popleft())

    # -- freeing -------------------------------------------------------------------------------------------------

    def _evict(self, d: DecodeWorker, h: ev.HeldKv, reason: str) -> None:
        if d.release(h.key) is None:
            return
        self.result.evictions[reason] += 1
        live = self.holders.pop(h.key, None)
        if live is not None and live.record is not None and live.record.held_key == h.key:
            live.record.freed = reason

    def _tick(self, _obj) -> None:
        now, res = self.now, self.result
        limits = self.settings.limits
        if self.ranking is not None and isinstance(self.ranking, ev.ValueRanking):
            self.ranking.model.learn(h for d in self.decode for h in d.held.values())
        held = used = capacity = 0
        for d in self.decode:
            before = d.used_tokens
            for h in [h for h in d.held.values() if h.expires_at <= now]:
                d.release(h.key)
                self.holders.pop(h.key, None)
                res.expired += 1
            if self.ranking is not None and d.held:
                chosen = ev.idle_evictions(d.held.values(), now, limits)
                if d.used_tokens >= limits.high_water * d.capacity_tokens:
                    taken = {e.held.key for e in chosen}
                    rest = [h for h in d.held.values() if h.key not in taken]
                    chosen += ev.pressure_evictions(
                        rest, used_tokens=d.used_tokens - sum(e.held.kv_tokens for e in chosen),
                        capacity_tokens=d.capacity_tokens, now=now, limits=limits, ranking=self.ranking)
                for e in chosen:
                    self._evict(d, e.held, e.reason)
            if d.used_tokens < before:
                self._wake(d)
            held += d.held_tokens + d.pinned_tokens
            used += d.used_tokens
            capacity += d.capacity_tokens
        if capacity:
            res.held_fraction_sum += held / capacity
            res.held_fraction_max = max(res.held_fraction_max, held / capacity)
            res.used_fraction_sum += used / capacity
        res.ticks += 1
        if self.pending or any(d.waiting for d in self.decode):
            self._push(now + self.settings.tick_s, _TICK)

