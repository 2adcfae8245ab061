"""The scheduler's decode-KV manager: what each decode worker holds between turns, and freeing it before it hurts.

Every ``interval_s`` it reads, per decode worker, the summaries of the session records whose unspent handle lives
there (one etcd read: the worker-sessions index less the claims, ``ClaimStore.claims.held_on_worker``), sets them
next to the engine's own KV usage (``LoadMonitor``: vLLM ``GetLoads``), and frees what
``kvshuttle.control_plane.kv_eviction`` chooses: sessions idle past the limit, and under pressure the handles least
worth keeping. ``make_room`` does the same at once for a turn about to land on a decode worker without room for it.

Freeing one handle: read its record (the handle and the first block's token ids), claim it at that revision with the
reason (``free_reason``: no turn can pull it any more, and the next turn of the session recomputes saying why), then
have a live prefill worker read the handle's first block (``EngineClient.read_to_free``): the decode worker frees all
of the handle's blocks after any read. A handle that a turn has claimed is never freed (the claim is refused).

With several scheduler replicas, one leads the rounds (an etcd key on its lease, ``ClaimStore.elections.campaign``): the
others read the same view for their stats and make room for the turns they plan, which claims keep from freeing
one handle twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvshuttle.control_plane import cache_salt, kv_params
from kvshuttle.control_plane import kv_eviction as ev
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.services.common import metrics
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.engine.client import EngineClient, EngineError
from kvshuttle.services.scheduler.claims import ClaimsError, EtcdClaims
from kvshuttle.services.scheduler.load_monitor import LoadMonitor
from kvshuttle.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)
LEADER = "kv-manager"  # the etcd leader key's name: the scheduler replica that runs the freeing rounds


@dataclass
class DecodeKv:
    """One decode worker's held KV as last read, and what was freed there."""

    held: list[ev.HeldKv] = field(default_factory=list)
    read_at: float = 0.0  # epoch seconds of the read
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ev.REASONS, 0))
    evicted_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ev.REASONS, 0))
    failures: int = 0
    pulls_lost: dict[str, int] = field(default_factory=dict)
    ledger: ev.FreedLedger = field(default_factory=ev.FreedLedger)
    bytes_per_token: int = 0
    warned_at: float = float("-inf")  # monotonic time of the last view-mismatch warning

    @property
    def held_tokens(self) -> int:
        return sum(h.kv_tokens for h in self.held)


class KvManager:
    def __init__(self, claims: EtcdClaims, workers: WorkerView, loads: LoadMonitor | None, model: PrefillCostModel,
                 limits: ev.KvLimits, ranking: str = "value", *, interval_s: float = 1.0,
                 free_timeout_s: float = 10.0, room_timeout_s: float = 3.0, concurrency: int = 4,
                 clock: Callable[[], float] = time.time):
        self.claims, self.workers, self.loads, self.limits = claims, workers, loads, limits
        self.ranking = ev.make_ranking(ranking, model)
        self.interval_s, self.free_timeout_s, self.room_timeout_s = interval_s, free_timeout_s, room_timeout_s
        self.clock = clock
        self.decode: dict[str, DecodeKv] = {}
        self._engines: dict[str, EngineClient] = {}
        self._freeing: set[tuple[str, str]] = set()  # sessions being freed now (never twice at once)
        self._slots = asyncio.Semaphore(concurrency)
        self._task: asyncio.Task | None = None
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.leading = False  # whether this replica frees held KV in the rounds (make_room: every replica)

    def describe(self) -> str:
        lim = self.limits
        return (f"free under pressure above {lim.high_water:.0%} KV usage down to {lim.low_water:.0%} (held budget "
                f"{lim.held_budget:.0%}), by {self.ranking.name}; idle limit "
                + (f"{lim.idle_limit_s:g} s" if lim.idle_limit_s else "off"))

    # -- life ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-manager")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in self._engines.values():
            await client.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad round stop the manager
                log.exception("decode KV round failed")
            await asyncio.sleep(self.interval_s)

    # -- the view --------------------------------------------------------------------------------------------

    def _decode_workers(self) -> list[common_pb2.Worker]:
        return self.workers.by_role(common_pb2.WORKER_ROLE_DECODE)

    async def refresh(self, worker: common_pb2.Worker) -> DecodeKv:
        """Read what ``worker`` holds (raises ClaimsError when etcd cannot be read)."""
        state = self.decode.setdefault(worker.worker_id, DecodeKv())
        state.bytes_per_token = worker.kv_bytes_per_token
        records = await self.claims.held_on(worker.worker_id)
        state.held = [_held(r, worker.kv_bytes_per_token) for r in records]
        state.read_at = self.clock()
        return state

    def usage(self, worker_id: str) -> tuple[int, int] | None:
        """(used tokens, capacity) of the worker's KV cache as its engine last reported them, less what was freed
        since that report and counting the turns sent to it since; None when unknown or unreachable."""
        if self.loads is None:
            return None
        load = self.loads.loads().get(worker_id)
        if load is None or not load.reachable or load.capacity_tokens <= 0:
            return None
        state = self.decode.get(worker_id)
        now = time.monotonic()
        unseen = state.ledger.unseen(now - load.age_s, load.used_tokens, now) if state else 0
        return max(0, load.used_tokens + load.pending_tokens - unseen), load.capacity_tokens

    async def run_once(self) -> None:
        """One round over every decode worker: read what it holds; free what the limits say when this replica
        leads (several scheduler replicas read alike, one frees: they would otherwise free the same room twice)."""
        try:
            self.leading = await self.claims.campaign(LEADER, self.holder, max(5, math.ceil(3 * self.interval_s)))
        except ClaimsError as exc:
            log.warning("decode KV: could not campaign for leadership (%s)", exc)
            self.leading = False
        workers = self._decode_workers()
        for gone in set(self.decode) - {w.worker_id for w in workers}:
            del self.decode[gone]
        reads = await asyncio.gather(*(self.refresh(w) for w in workers), return_exceptions=True)
        if isinstance(self.ranking, ev.ValueRanking):
            self.ranking.model.learn(h for s in self.decode.values() for h in s.held)
        now = self.clock()
        rounds = []
        for worker, read in zip(workers, reads, strict=True):
            if isinstance(read, BaseException):
                log.warning("could not read what decode worker %s holds: %s", worker.worker_id, read)
                continue
            if not self.leading:
                continue
            usage = self.usage(worker.worker_id)
            self._check_view(worker.worker_id, read, usage)
            chosen = ev.idle_evictions(read.held, now, self.limits)
            if usage is not None:
                taken = {e.held.key for e in chosen}
                rest = [h for h in read.held if h.key not in taken]
                used = usage[0] - sum(e.held.kv_tokens for e in chosen)
                chosen += ev.pressure_evictions(rest, used_tokens=used, capacity_tokens=usage[1], now=now,
                                                limits=self.limits, ranking=self.ranking)
            if chosen:
                rounds.append(self._free_all(worker, chosen))
        await asyncio.gather(*rounds)

    def _check_view(self, worker_id: str, state: DecodeKv, usage: tuple[int, int] | None) -> None:
        """The records' view against the engine's: held KV the engine does not have in use means records of KV it
        no longer holds (it restarted, or freed blocks behind the scheduler's back); logged, at most once a minute."""
        if usage is None:
            return
        used, capacity = usage
        if state.held_tokens > used + capacity // 10 and time.monotonic() - state.warned_at > 60:
            state.warned_at = time.monotonic()
            log.warning("decode worker %s: its records hold %d KV tokens but its engine uses %d of %d: some records "
                        "describe KV it no longer has (their pulls will fail and recompute)", worker_id,
                        state.held_tokens, used, capacity)

    async def make_room(self, worker: common_pb2.Worker, need_tokens: int, keep: tuple[str, str] | None) -> int:
        """Free enough of ``worker``'s held handles for a turn needing ``need_tokens`` KV tokens there (none when it
        fits), within ``room_timeout_s``. Returns how many were freed."""
        usage = self.usage(worker.worker_id)
        if usage is None:
            return 0
        used, capacity = usage
        if capacity - used >= need_tokens + self.limits.room_headroom_tokens:
            return 0
        try:
            async with asyncio.timeout(self.room_timeout_s):
                state = await self.refresh(worker)
                chosen = ev.room_evictions(state.held, need_tokens=need_tokens, free_tokens=capacity - used,
                                           now=self.clock(), limits=self.limits, ranking=self.ranking, keep=keep)
                return await self._free_all(worker, chosen) if chosen else 0
        except (TimeoutError, ClaimsError) as exc:
            log.warning("could not make room for a turn on %s: %s", worker.worker_id, exc or "timed out")
            return 0

    def fill_stats(self, out: scheduler_pb2.GetStatsResponse) -> None:
        """GetStats' decode_kv rows: per decode worker, what it holds and what was freed there."""
        now = self.clock()
        for worker_id in sorted(self.decode):
            state = self.decode[worker_id]
            row = out.decode_kv.add(
                worker_id=worker_id, held_sessions=len(state.held), held_tokens=state.held_tokens,
                held_blocks=sum(h.blocks for h in state.held), held_bytes=sum(h.bytes for h in state.held),
                oldest_idle_s=max((h.idle_s(now) for h in state.held), default=0.0),
                evicted_tokens=sum(state.evicted_by_reason.values()), eviction_failures=state.failures)
            row.evictions.update(state.evictions)
            row.pulls_lost.update(state.pulls_lost)
            usage = self.usage(worker_id)
            if usage is not None:
                row.used_tokens, row.capacity_tokens = usage

    def metrics_rows(self) -> tuple[metrics.DecodeKvRow, ...]:
        """Per decode worker (by id), what it holds and what was freed there, for the scheduler's /metrics."""
        return tuple(metrics.DecodeKvRow(
            worker_id=worker_id, held_sessions=len(state.held), held_tokens=state.held_tokens,
            held_bytes=sum(h.bytes for h in state.held), usage=self.usage(worker_id),
            evictions=dict(state.evictions), evicted_tokens=dict(state.evicted_by_reason), failures=state.failures)
            for worker_id, state in sorted(self.decode.items()))

    def note_pull_lost(self, worker_id: str, reason: str) -> None:
        state = self.decode.setdefault(worker_id, DecodeKv())
        state.pulls_lost[reason] = state.pulls_lost.get(reason, 0) + 1

    # -- freeing ---------------------------------------------------------------------------------------------

    async def _free_all(self, worker: common_pb2.Worker, chosen: list[ev.Eviction]) -> int:
        load = self.loads.loads().get(worker.worker_id) if self.loads is not None else None
        before = load.used_tokens if load is not None else 0
        results = await asyncio.gather(*(self._free(worker, e) for e in chosen))
        freed = sum(results)
        state = self.decode.setdefault(worker.worker_id, DecodeKv())
        tokens = sum(e.held.kv_tokens for e, ok in zip(chosen, results, strict=True) if ok)
        if tokens:
            state.ledger.note(time.monotonic(), tokens, before)
        if freed:
            log.info("decode worker %s: freed %d of %d held KV handle(s) (%s)", worker.worker_id, freed, len(chosen),
                     ", ".join(sorted({e.reason for e in chosen})))
        return freed

    async def _free(self, worker: common_pb2.Worker, eviction: ev.Eviction) -> bool:
        held = eviction.held
        if held.key in self._freeing:
            return False
        self._freeing.add(held.key)
        state = self.decode.setdefault(worker.worker_id, DecodeKv())
        try:
            async with self._slots:
                freed = await asyncio.wait_for(self._free_one(worker, eviction), self.free_timeout_s)
        except (TimeoutError, ClaimsError, EngineError, kv_params.HandleError) as exc:
            log.warning("freeing a held KV handle on %s failed: %s", worker.worker_id, exc or "timed out")
            freed = None
        finally:
            self._freeing.discard(held.key)
        if freed is None:
            state.failures += 1
            return False
        if freed:
            state.evictions[eviction.reason] = state.evictions.get(eviction.reason, 0) + 1
            state.evicted_by_reason[eviction.reason] = state.evicted_by_reason.get(eviction.reason, 0) + held.kv_tokens
            state.held = [h for h in state.held if h.key != held.key]
        return freed

    async def _free_one(self, worker: common_pb2.Worker, eviction: ev.Eviction) -> bool | None:
        """True: freed; False: nothing to free any more (changed, claimed, expiring); None: the read failed (the
        handle is claimed but its blocks stay until the worker's TTL)."""
        held = eviction.held
        found = await self.claims.get_session(held.tenant, held.session_id)
        if found is None:
            return False
        record, _ = found
        if (record.revision != held.revision or record.decode_worker_id != worker.worker_id
                or not session_rules.freeable(record, len(record.head_token_ids), self.clock())):
            return False  # a new turn, a claim, a move, or too close to its expiry: leave it
        params, prompt = kv_params.free_read(kv_params.parse_handle(record.kv_transfer_params_json),
                                             record.head_token_ids, record.block_size)
        prefill = self._prefill_worker(worker.model)
        if prefill is None:
            raise EngineError(None, f"no live prefill worker of model {worker.model!r} to read the handle")
        claim = await self.claims.claim(held.tenant, held.session_id, record.revision, known=record,
                                        free_reason=eviction.reason)
        if not claim.claimed:
            return False
        engine = self._engine(prefill)
        request_id = f"kv-free-{eviction.reason}-{uuid.uuid4().hex[:12]}"
        # A salt no turn has: the block P caches on the way is never any tenant's hit (control_plane.cache_salt).
        if not await engine.read_to_free(request_id, prompt, params, timeout_s=self.free_timeout_s,
                                         cache_salt=cache_salt.FREE_READ):
            return None
        return True

    def _prefill_worker(self, model: str) -> common_pb2.Worker | None:
        """The live prefill worker of the decode worker's base ``model`` (only its KV has D's shapes: another
        model's P must never read it) with the fewest requests queued (the read is one block and one token)."""
        loads = self.loads.loads() if self.loads is not None else {}
        live = [w for w in self.workers.by_role(common_pb2.WORKER_ROLE_PREFILL, model or None)
                if loads.get(w.worker_id) is None or loads[w.worker_id].reachable]
        if not live:
            return None
        return min(live, key=lambda w: (loads[w.worker_id].queued if w.worker_id in loads else 0, w.worker_id))

    def _engine(self, worker: common_pb2.Worker) -> EngineClient:
        client = self._engines.get(worker.grpc_address)
        if client is None:
            client = self._engines[worker.grpc_address] = EngineClient(worker.grpc_address,
                                                                       timeout_s=self.free_timeout_s)
        return client


def _held(record: common_pb2.Session, bytes_per_token: int) -> ev.HeldKv:
    updated = session_rules.to_seconds(record.updated_at)
    created = session_rules.to_seconds(record.created_at) if record.HasField("created_at") else updated
    return ev.HeldKv(record.tenant, record.session_id, record.revision, record.covered_tokens, record.block_size,
                     last_used=updated, created=created, turns=max(1, record.turn),
                     expires_at=session_rules.to_seconds(record.expires_at), bytes_per_token=bytes_per_token)
