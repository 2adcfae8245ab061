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

**Prefill on a decode worker** (the strategies with ``serves_local``: ``conditional_disagg``'s bypass, the planner's
``Choice.LOCAL``): the turn skips P. D admits it as any turn (KV room for prompt and answer), reuses what its prefix
cache holds of the prompt (D's :class:`~.cluster.DecodePrefixCache`, or the session's handle D holds), and computes
the rest, ``T = compute_ms(new, cached)`` with the profile's curve, inside its decode batch: with chunked prefill of
``C`` tokens per step (``SimSettings.max_num_batched_tokens``, vLLM's ``max_num_batched_tokens``), in
``k = ceil(new / C)`` steps, each a decode step plus ``T / k``. The turn's first token comes with its last chunk
(``k · tpot + T`` after it starts); D prefills one turn at a time (FIFO, the chunk budget is D's). Every stream D
decodes meanwhile waits for those chunks: its decode steps last ``tpot + T / k`` instead of ``tpot`` while the prefill
runs, ``T`` in all for a stream that decodes through it (fewer steps, less: a fluid model of the step-by-step batch,
re-timed whenever a prefill starts or ends on D). A hand-off from P sends D only what its prefix cache lacks.

**Decode inter-token latency**: per decode worker, a histogram of its decode steps over all streams (each step's
length, weighted by how many streams it served); the report reads p50 and p99 off it. Without prefills on D, every
step is the profile's ``tpot_ms``.

**CPU tier** (the strategies with ``cpu_tier``): a prefill node's units evicted from its GPU cache move to its CPU
tier (``cpu_tier_gib``); a prompt that continues past the GPU hit into the tier restores those units at
``cpu_restore_gb_s`` (host to device) before P computes the rest; with ``peer_cpu_pull``, the run that follows
may be pulled from another node's CPU tier over the network (the profile's link), as llm-d's peer-to-peer NIXL pull.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshuttle.control_plane import kv_eviction as ev
from kvshuttle.control_plane.decision import Choice, HandleView
from kvshuttle.control_plane.policies import Outcome
from kvshuttle.control_plane.prefix import PrefixHasher, checkpoint_lengths
from kvshuttle.services.devtools.simulator.cluster import (
    CpuTier,
    DecodePrefixCache,
    DecodeWorker,
    PrefillWorker,
    UnitChain,
    token_ids,
)
from kvshuttle.services.devtools.simulator.hardware import Profile
from kvshuttle.services.devtools.simulator.strategies import LOCAL, Routed, Strategy, is_local
from kvshuttle.services.devtools.simulator.workload import OWN_SEGMENTS, SimSession

PULL_LOST = "pull_lost"
_ARRIVE, _P_DONE, _DECODE_DONE, _TICK, _KV_IN, _LOCAL_DONE, _STREAM_DONE = range(7)
GIB = 1 << 30


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
    # A prefill on a decode worker is chunked into steps of at most this many tokens (vLLM's max_num_batched_tokens:
    # 8192 for the OpenAI server on a GPU of >= 70 GiB that is not an A100, i.e. H100/H200; vllm/engine/arg_utils.py,
    # EngineArgs.get_batch_defaults).
    max_num_batched_tokens: int = 8192
    # A prefill node's CPU tier (cpu_tier strategies): GiB of host memory. llm-d's tiered-prefix-cache guide offloads
    # 100 GB per replica (Qwen3-32B, TP4, H100); llm-d quotes 100-150 GiB per rank.
    cpu_tier_gib: float = 100.0
    # Restoring a CPU-tier hit to the GPU, GB/s: vLLM's OffloadingConnector measured about 50 GB/s one way between
    # H100 and host over PCIe Gen5 with 2 MB blocks (blog.vllm.ai, "Inside vLLM's new KV offloading connector").
    cpu_restore_gb_s: float = 50.0
    # cpu_tier strategies: a prompt whose next units another node's CPU tier holds pulls them over the network
    # (llm-d's peer-to-peer CPU-tier pull over NIXL), at the profile's link rate.
    peer_cpu_pull: bool = False


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
    credit: int = 0  # of which D already holds (the session's handle a turn prefilled on D takes over)
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
    restored: int = 0  # tokens restored from P's CPU tier
    peer: int = 0  # tokens pulled from another node's CPU tier
    p_pending: int = 0  # what it added to its P's (or, prefilled on D, its D's) pending prefill tokens
    # the decode-batch path (strategies with serves_local)
    admitted: float = 0.0
    d_units: int = 0  # leading prompt units it uses from D's prefix cache
    d_cached: int = 0  # prompt tokens D held (prefilled on D: reused; from P: not sent)
    local_ms: float = 0.0  # prefilled on D: its compute
    chunks: int = 0
    streams: int = 0  # prefilled on D: the streams D was decoding when it started
    v_end: float = 0.0  # D's decode clock (ms of plain steps) when its last token is out
    worst_step: float = 0.0  # its longest decode step (ms; a prefill on its D stretched it)


class Columns:
    """Per-turn results, one array per column (a million turns in a few tens of MB)."""

    def __init__(self) -> None:
        self.arrival, self.ttft_ms, self.p_wait_ms, self.d_wait_ms = (array("d") for _ in range(4))
        self.prompt, self.history, self.pulled, self.computed, self.cached = (array("q") for _ in range(5))
        # which turn each row is (index into the simulation's sessions, turn number) and its prefill worker's index
        self.session, self.turn, self.prefill = array("q"), array("i"), array("i")  # prefill -1: prefilled on D
        self.restored, self.peer, self.d_cached = array("q"), array("q"), array("q")
        self.local = array("b")  # 1: prefilled on its decode worker
        self.codes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ttft_ms)


@dataclass(slots=True, eq=False)
class _Batch:
    """A decode worker's batch (the strategies with ``serves_local``): the streams it decodes, its decode clock (ms
    of plain steps, ``v`` at ``since``; it runs ``slow`` times slower while a prefill's chunks share its steps), the
    turns waiting to be prefilled on it, and its decode steps by length."""

    streams: set = field(default_factory=set)
    slow: float = 1.0
    since: float = 0.0
    v: float = 0.0
    queue: deque = field(default_factory=deque)
    prefilling: InFlight | None = None
    itl: dict[float, float] = field(default_factory=dict)


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
    bytes_restored: int = 0  # CPU tier -> GPU on prefill nodes (host to device, not the network)
    bytes_p_to_p: int = 0  # peer CPU-tier pulls between prefill nodes
    decode_prefill_s: float = 0.0  # decode workers' time spent prefilling turns (their chunks' compute), summed
    decode_workers: int = 0
    # decode worker -> {step length (ms, to 0.01): decode steps of that length, over all its streams}
    itl: dict[str, dict[float, float]] = field(default_factory=dict)
    stream_worst_ms: array = field(default_factory=lambda: array("d"))  # per answer of 2+ tokens: its longest gap


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
        self.result = Result(strategy.name, Columns(), len(sessions), prefill_workers=len(self.prefill),
                             decode_workers=len(self.decode))
        self.result.itl = {d.worker_id: {} for d in self.decode}
        self.ranking = ev.make_ranking("value", strategy.model) if strategy.manages_kv and strategy.model else None
        self.pulls_possible = strategy.keeps_kv
        self._session_index = {id(s): i for i, s in enumerate(self.sessions)}
        self._prefill_index = {p.worker_id: i for i, p in enumerate(self.prefill)}
        self._waiting: list[SimSession] = []  # closed loop: sessions not started yet, next last
        self._streams: dict[str, int] = {d.worker_id: 0 for d in self.decode}  # decode streams in flight per D
        self._computing: set[InFlight] = set()  # prefills in progress (a shared host: processor sharing)
        self._shared = settings.host_cores > 0
        self.serves_local = strategy.serves_local
        self._batch: dict[str, _Batch] = {d.worker_id: _Batch() for d in self.decode} if self.serves_local else {}
        if strategy.decode_prefix_cache and self.serves_local:
            for d in self.decode:
                d.prefix = DecodePrefixCache()
        if strategy.cpu_tier:
            units = int(settings.cpu_tier_gib * GIB / profile.kv_bytes_per_token) // settings.unit_tokens
            for p in self.prefill:
                p.cpu = CpuTier(p.worker_id, units, strategy.cpu_index)

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
        handlers = (self._arrive, self._prefill_done, self._decode_done, self._tick, self._kv_in, self._local_done,
                    self._stream_done)
        while self.events:
            at, _, kind, obj = heapq.heappop(self.events)
            if kind != _TICK:
                self.pending -= 1
            self.now = at
            handlers[kind](obj)
        for worker_id, batch in self._batch.items():
            self.result.itl[worker_id] = batch.itl
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
        routed = self.strategy.route(live.key, prompt, view, record.source if record else "", keys[: (n - 1) // unit],
                                     spec.model)
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
        if self.serves_local and is_local(routed):  # no prefill worker: D prefills it (when it admits it)
            held = d.held.get(record.held_key) if record is not None and record.source == d.worker_id else None
            if held is not None:  # the session's handle on D becomes this turn's KV: its room counts for it
                flight.credit = held.kv_tokens
            flight.p_pending = max(0, n - routed.cached_estimate)
            d.local_prefill_tokens += flight.p_pending
            self._admit_or_wait(d, flight)
            return
        p = routed.prefill
        flight.p_pending = max(0, n - routed.cached_estimate)
        p.pending_tokens += flight.p_pending
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
        covered = hit
        if p.cpu is not None:
            covered = self._from_cpu_tiers(p, flight, hit)
        flight.computed = n - max(reusable, covered)
        p.running_tokens = n
        prof = self.profile
        service = prof.compute_ms(flight.computed, n - flight.computed) * self._noise()
        if flight.pulled:
            service += prof.transfer_ms(flight.pulled) * self._noise()
        if flight.restored:
            service += self._restore_ms(flight.restored) * self._noise()
        if flight.peer:
            service += prof.transfer_ms(flight.peer) * self._noise()
        flight.p_start = self.now
        if self._shared:  # processor sharing: its end moves whenever the busy engines change
            flight.work_ms, flight.rate_since = service, self.now
            self._computing.add(flight)
            self._retime()
            return
        flight.p_end = self.now + service / 1000
        self.result.prefill_busy_s += service / 1000
        self._push(flight.p_end, _P_DONE, flight)

    def _restore_ms(self, tokens: int) -> float:
        return tokens * self.profile.kv_bytes_per_token / (self.settings.cpu_restore_gb_s * 1e9) * 1000

    def _from_cpu_tiers(self, p: PrefillWorker, flight: InFlight, hit: int) -> int:
        """Past P's GPU hit (``hit`` tokens), the prompt's units its CPU tier holds are restored (and units the GPU
        holds after them reused) up to the first unit neither holds; with ``peer_cpu_pull``, the run another node's
        CPU tier holds from there is pulled over the network. Returns the tokens P need not compute."""
        unit = self.settings.unit_tokens
        keys = flight.keys[: (flight.prompt - 1) // unit]
        assert p.cpu is not None
        i = hit // unit
        while i < len(keys):
            key = keys[i]
            if p.cpu.take(key):
                flight.restored += unit
            elif key in p.cache:
                p.cache.move_to_end(key)
                flight.cached += unit
            else:
                break
            i += 1
        if self.settings.peer_cpu_pull and i < len(keys):
            peers = sorted(w for w in p.cpu.index.get(keys[i], ()) if w != p.worker_id)
            tiers = {w: self.prefill[self._prefill_index[w]].cpu for w in peers}
            best, run = None, 0
            for w in peers:
                tier = tiers[w]
                j = i
                while tier is not None and j < len(keys) and keys[j] in tier:
                    j += 1
                if j - i > run:
                    best, run = tier, j - i
            if best is not None:
                for key in keys[i:i + run]:
                    best.units.move_to_end(key)  # read: most recent there
                flight.peer = run * unit
                i += run
        self.result.bytes_restored += flight.restored * self.profile.kv_bytes_per_token
        self.result.bytes_p_to_p += flight.peer * self.profile.kv_bytes_per_token
        return i * unit

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
        p.pending_tokens -= flight.p_pending
        p.running_tokens = 0
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
        if not d.waiting and d.free_tokens + flight.credit >= flight.need:
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
        if self.serves_local:
            self._admit_to_batch(d, flight)
            return
        d.reserved_tokens -= flight.need
        d.admit(flight.need)
        self._streams[d.worker_id] += 1
        if self._streams[d.worker_id] == 1 and self._shared:
            self._retime()
        prof = self.profile
        first = self.now + (prof.handoff_ms(flight.prompt) * self._noise() + prof.tpot_ms) * self._share() / 1000
        self._row(flight, first, self.now - flight.p_end, flight.p_start - flight.arrival)
        self.result.bytes_p_to_d += flight.prompt * prof.kv_bytes_per_token
        done = first + max(0, flight.output - 1) * prof.tpot_ms / 1000
        self._push(done, _DECODE_DONE, flight)

    def _row(self, flight: InFlight, first: float, d_wait_s: float, p_wait_s: float) -> None:
        """The turn's row, when its first token's time is known (``first``); ``d_wait_s``: its wait for D's KV room,
        ``p_wait_s``: for its prefill to start (in P's queue; prefilled on D: in D's, after admission)."""
        res = self.result
        cols = res.turns
        local = self.serves_local and is_local(flight.routed)
        cols.arrival.append(flight.arrival)
        cols.ttft_ms.append((first - flight.arrival) * 1000)
        cols.p_wait_ms.append(p_wait_s * 1000)
        cols.d_wait_ms.append(d_wait_s * 1000)
        cols.prompt.append(flight.prompt)
        cols.history.append(flight.boundary if flight.live.turn else 0)
        cols.pulled.append(flight.pulled)
        cols.computed.append(flight.computed)
        cols.cached.append(flight.cached)
        cols.session.append(self._session_index[id(flight.live.spec)])
        cols.turn.append(flight.live.turn)
        cols.prefill.append(-1 if local else self._prefill_index[flight.routed.prefill.worker_id])
        cols.restored.append(flight.restored)
        cols.peer.append(flight.peer)
        cols.d_cached.append(flight.d_cached)
        cols.local.append(1 if local else 0)
        cols.codes[flight.code] = cols.codes.get(flight.code, 0) + 1
        res.bytes_d_to_p += flight.pulled * self.profile.kv_bytes_per_token

    # -- the decode batch (strategies with serves_local) ---------------------------------------------------------

    def _trim(self, d: DecodeWorker) -> None:
        """D's prefix cache keeps what fits in its free KV (vLLM evicts cached blocks as running turns need them)."""
        if d.prefix is not None:
            d.prefix.trim((d.capacity_tokens - d.used_tokens) // self.settings.unit_tokens)

    def _admit_to_batch(self, d: DecodeWorker, flight: InFlight) -> None:
        """D admits the turn: a hand-off from P (only what D's prefix cache lacks), or a prefill on D."""
        n, unit, prof = flight.prompt, self.settings.unit_tokens, self.profile
        local = is_local(flight.routed)
        record = flight.live.record
        handle = 0
        if local and record is not None and record.source == d.worker_id and not record.freed \
                and record.expires_at > self.now and d.release(record.held_key) is not None:
            # the session's handle on D (the planner's LOCAL): its blocks become this turn's prefix
            self.holders.pop(record.held_key, None)
            handle = min(record.covered, n - 1) // prof.block_size * prof.block_size
        d.reserved_tokens -= flight.need
        d.admit(flight.need)
        self._streams[d.worker_id] += 1
        if self._streams[d.worker_id] == 1 and self._shared:
            self._retime()
        flight.admitted = self.now
        if d.prefix is not None:
            flight.d_units = d.prefix.acquire(flight.keys[: (n - 1) // unit])
            flight.d_cached = flight.d_units * unit
            self._trim(d)
        if not local:
            sent = n - flight.d_cached
            self.result.bytes_p_to_d += sent * prof.kv_bytes_per_token
            self._push(self.now + prof.handoff_ms(sent) * self._noise() * self._share() / 1000, _KV_IN, flight)
            return
        flight.d_cached = max(flight.d_cached, handle)
        flight.cached = 0
        flight.computed = n - flight.d_cached
        flight.local_ms = prof.local_compute_ms(flight.computed, flight.d_cached) * self._noise()
        flight.chunks = max(1, math.ceil(flight.computed / self.settings.max_num_batched_tokens))
        batch = self._batch[d.worker_id]
        batch.queue.append(flight)
        if batch.prefilling is None:
            self._start_local(d)

    def _advance(self, batch: _Batch) -> None:
        """Bring D's decode clock to now, counting the decode steps its streams took since (their inter-token
        latency)."""
        elapsed_ms = (self.now - batch.since) * 1000
        if elapsed_ms > 0:
            step = self.profile.tpot_ms * batch.slow
            if batch.streams:
                key = round(step, 2)
                batch.itl[key] = batch.itl.get(key, 0.0) + len(batch.streams) * elapsed_ms / step
            batch.v += elapsed_ms / batch.slow
        batch.since = self.now

    def _join(self, batch: _Batch, flight: InFlight, steps: int) -> None:
        """``flight`` decodes ``steps`` more tokens in D's batch (the clock brought to now)."""
        flight.v_end = batch.v + steps * self.profile.tpot_ms
        if batch.slow > 1 and steps > 1:  # it joins while a prefill stretches D's steps
            flight.worst_step = max(flight.worst_step, self.profile.tpot_ms * batch.slow)
        batch.streams.add(flight)
        self._schedule_done(batch, flight)

    def _schedule_done(self, batch: _Batch, flight: InFlight) -> None:
        flight.version += 1
        left_ms = max(0.0, flight.v_end - batch.v) * batch.slow
        self._push(self.now + left_ms / 1000, _STREAM_DONE, (flight, flight.version))

    def _set_slow(self, d: DecodeWorker, slow: float) -> None:
        """D's decode steps now last ``slow`` times a plain one: every stream's end is re-timed."""
        batch = self._batch[d.worker_id]
        self._advance(batch)
        if slow != batch.slow:
            batch.slow = slow
            step = self.profile.tpot_ms * slow
            for f in batch.streams:
                f.worst_step = max(f.worst_step, step)
                self._schedule_done(batch, f)

    def _start_local(self, d: DecodeWorker) -> None:
        batch = self._batch[d.worker_id]
        flight = batch.queue.popleft()
        batch.prefilling = flight
        flight.p_start = self.now
        flight.streams = len(batch.streams)
        tpot = self.profile.tpot_ms
        self._set_slow(d, (tpot + flight.local_ms / flight.chunks) / tpot)
        self.result.decode_prefill_s += flight.local_ms / 1000
        self._push(self.now + (flight.chunks * tpot + flight.local_ms) / 1000, _LOCAL_DONE, flight)

    def _local_done(self, flight: InFlight) -> None:
        """A prefill on D ended with its last chunk's step: the first token is out, the turn decodes in D's batch."""
        d = flight.routed.decode
        batch = self._batch[d.worker_id]
        self._advance(batch)
        batch.prefilling = None
        d.local_prefill_tokens -= flight.p_pending
        flight.p_end = self.now
        self._row(flight, self.now, flight.admitted - flight.arrival, flight.p_start - flight.admitted)
        r = flight.routed
        if LOCAL is not None and r.choice is LOCAL:  # the planner learns D's local fit from it
            self.strategy.observe(Outcome(
                r.prefill.worker_id if r.prefill is not None else d.worker_id, flight.prompt, 0, flight.computed,
                (flight.p_end - flight.p_start) * 1000, r.choice, pullable_tokens=r.pullable, policy=r.policy,
                cached_estimate=r.cached_estimate, decode_worker=d.worker_id, streams=flight.streams))
        if not batch.queue:
            self._set_slow(d, 1.0)
        self._join(batch, flight, flight.output - 1)
        if batch.queue:
            self._start_local(d)

    def _kv_in(self, flight: InFlight) -> None:
        """The prompt's KV from P reached D: the turn joins D's batch; its first token is its first step."""
        batch = self._batch[flight.routed.decode.worker_id]
        self._advance(batch)
        step = self.profile.tpot_ms * batch.slow
        # the first step shares a shared host's cores (SimSettings.host_cores) with the other busy engines
        self._row(flight, self.now + step * self._share() / 1000, flight.admitted - flight.p_end,
                  flight.p_start - flight.arrival)
        key = round(step, 2)
        batch.itl[key] = batch.itl.get(key, 0.0) - 1  # that first step is the time to first token's, not an ITL
        self._join(batch, flight, flight.output)

    def _stream_done(self, obj) -> None:
        flight, version = obj
        if version != flight.version:  # re-timed since
            return
        batch = self._batch[flight.routed.decode.worker_id]
        self._advance(batch)
        batch.streams.discard(flight)
        self._decode_done(flight)

    def _decode_done(self, flight: InFlight) -> None:
        live, r = flight.live, flight.routed
        d = r.decode
        d.finish(flight.need)
        if flight.output > 1:
            tpot = self.profile.tpot_ms
            self.result.stream_worst_ms.append(max(tpot, flight.worst_step))
            if not self.serves_local:  # every step of a stream is a plain decode step
                steps = self.result.itl[d.worker_id]
                steps[round(tpot, 2)] = steps.get(round(tpot, 2), 0.0) + flight.output - 1
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
        if d.prefix is not None:  # the turn's blocks stay in D's prefix cache
            d.prefix.release(flight.keys[: flight.d_units], live.chain.keys)
            self._trim(d)
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
        while d.waiting and d.free_tokens + d.waiting[0].credit >= d.waiting[0].need:
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

