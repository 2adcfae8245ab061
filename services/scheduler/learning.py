"""How a scheduler learns from reported turn outcomes: alone, or sharing every outcome with the other replicas.

The planner's learned state (cost-model fits, policy regret, prefix-cache trust) is a function of the sequence of
outcomes it observed. ``LocalLearning`` applies the outcomes reported to this process: with several replicas, each
learns its own world. ``SharedLearning`` makes every replica (standalone schedulers and planners embedded in
gateways alike) learn the same world:

- an outcome reported to any replica is buffered and written to etcd in batches (``learned/outcomes/{replica}/
  {seq}``, on a lease that ends a few minutes later);
- every replica reads every batch, its own included, and applies them in etcd revision order: the same outcomes in
  the same order give the same fits, exactly (the planner's learning is deterministic);
- the replica that leads ``learning`` (an etcd lease, as for the KV manager) writes a snapshot of the learned state
  every ``snapshot_interval_s``, tagged with the revision it reflects; a replica that starts later loads it and
  applies the batches written after it.

What stays per replica, deliberately: the turns each one assigned since the workers' last load poll (the polls are
the shared truth, every half second), the policies' exploration counters, and which prefill worker holds each
session's prefix between a plan and its outcome (the outcome, shared, then tells everyone).

While etcd is away, outcomes wait in a bounded buffer (``max_pending``); past it the oldest are dropped, counted in
GetStats and ``kvshuttle_learned_outcomes{result="dropped"}``. A replica that could not read batches before their
lease ended counts them as missed (GetStats ``learning.missed_batches``): its fits may then differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import Protocol

from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.decision import Choice
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import Outcome
from kvshuttle.services.common import metrics
from kvshuttle.services.store.interface import Campaigns, LeaseGrants, StoreError
from kvshuttle.v1 import scheduler_pb2

CHOICES = {scheduler_pb2.DECISION_PULL: Choice.PULL, scheduler_pb2.DECISION_RECOMPUTE: Choice.RECOMPUTE,
           scheduler_pb2.DECISION_LOCAL: Choice.LOCAL}

log = logging.getLogger(__name__)
SNAPSHOT_FORMAT = 1


class InvalidOutcome(ValueError):
    pass


def outcome_of(request: scheduler_pb2.ReportOutcomeRequest) -> tuple[Outcome, Hashable | None]:
    """The control-plane outcome of a report and its session key (None: no session); InvalidOutcome if it cannot be
    learned from (every replica would refuse it alike, so it is refused before it is shared)."""
    if not request.prefill_worker_id or request.prompt_tokens <= 0:
        raise InvalidOutcome("prefill_worker_id and prompt_tokens are required")
    if request.decision not in CHOICES:
        raise InvalidOutcome("decision must be PULL, RECOMPUTE or LOCAL")
    if min(request.pulled_tokens, request.computed_tokens, request.pullable_tokens,
           request.cached_tokens_estimate, request.decode_streams) < 0:
        raise InvalidOutcome("token counts and decode_streams must be non-negative")
    if request.decision == scheduler_pb2.DECISION_LOCAL and (not request.decode_worker_id or request.pulled_tokens):
        raise InvalidOutcome("a LOCAL outcome names its decode_worker_id and pulls nothing")
    if not math.isfinite(request.prefill_ms) or request.prefill_ms < 0:
        raise InvalidOutcome("prefill_ms must be a non-negative number")
    try:
        session_rules.validate_model(request.model)
    except session_rules.InvalidArgument as exc:
        raise InvalidOutcome(str(exc)) from None
    session = None
    if request.session_id:
        try:
            session = session_rules.session_ref(request.tenant, request.session_id)
        except session_rules.InvalidArgument as exc:
            raise InvalidOutcome(str(exc)) from None
    outcome = Outcome(
        request.prefill_worker_id, request.prompt_tokens, request.pulled_tokens, request.computed_tokens,
        request.prefill_ms, CHOICES[request.decision],
        source_worker=request.source_worker_id, pullable_tokens=request.pullable_tokens, policy=request.policy,
        cached_estimate=request.cached_tokens_estimate, decode_worker=request.decode_worker_id,
        streams=request.decode_streams, model=request.model)
    return outcome, session


def apply(planner: Planner, request: scheduler_pb2.ReportOutcomeRequest) -> bool:
    """Learn from one report; False (counted as rejected) when it is invalid."""
    try:
        outcome, session = outcome_of(request)
        planner.observe(outcome)
    except ValueError as exc:
        log.warning("outcome not learned: %s", exc)
        metrics.outcomes_learned("rejected")
        return False
    if session is not None and outcome.decision is not Choice.LOCAL:  # the next turn may be planned elsewhere: it
        # learns where this prefix lives too (a LOCAL turn left P's cache as it was)
        planner.cache_hints.note(session, outcome.prefill_worker, outcome.prompt_tokens)
    metrics.outcomes_learned("applied")
    return True


class Learning(Protocol):
    """How the servicer hands reported outcomes to the planner: ``LocalLearning`` or ``SharedLearning``."""

    mode: str  # "local" or "shared" (GetStats)

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def learn(self, request: scheduler_pb2.ReportOutcomeRequest, wait_s: float = 0.0) -> bool:
        """Take one valid report (checked with :func:`outcome_of`); whether it was learned within ``wait_s``."""
        ...

    def fill_stats(self, out: scheduler_pb2.LearningStats) -> None: ...


class OutcomeBatches(Protocol):
    """The shared outcome log (``EtcdStore.outcomes``)."""

    async def put_batch(self, replica: str, seq: int, batch: bytes, lease_id: int) -> int: ...

    async def batches(self, after_revision: int, page: int = 512) -> tuple[list[tuple[int, bytes]], int]: ...

    def watch(self, from_revision: int) -> AsyncIterator[tuple[int, bytes]]: ...


class SnapshotBlobs(Protocol):
    """The learned-state snapshots (``EtcdStore.snapshots``)."""

    async def put(self, manifest: dict, blob: bytes, chunk_bytes: int = 1 << 20) -> None: ...

    async def get(self) -> tuple[dict, bytes] | None: ...


class LearningStore(Protocol):
    """What ``SharedLearning`` needs of the store (``EtcdStore`` has it): its outcome log, learned snapshots, leases
    and leader campaigns, as ``store.outcomes``, ``store.snapshots``, ``store.leases`` and ``store.elections``."""

    @property
    def outcomes(self) -> OutcomeBatches: ...

    @property
    def snapshots(self) -> SnapshotBlobs: ...

    @property
    def leases(self) -> LeaseGrants: ...

    @property
    def elections(self) -> Campaigns: ...


class LocalLearning:
    """Learn from the outcomes reported to this process only."""

    mode = "local"

    def __init__(self, planner: Planner):
        self._planner = planner
        self.applied = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def learn(self, request: scheduler_pb2.ReportOutcomeRequest, wait_s: float = 0.0) -> bool:
        """Apply one valid report now; whether it was learned."""
        learned = apply(self._planner, request)
        self.applied += learned
        return learned

    def fill_stats(self, out: scheduler_pb2.LearningStats) -> None:
        out.mode, out.applied_outcomes = self.mode, self.applied


class SharedLearning:
    """Every replica's outcomes, applied by every replica in etcd's order (see the module docstring)."""

    mode = "shared"

    def __init__(self, store: LearningStore, planner: Planner, *, replica: str = "", flush_interval_s: float = 0.02,
                 max_batch: int = 512, max_pending: int = 100_000, batch_ttl_s: int = 120,
                 snapshot_interval_s: float = 30.0):
        if flush_interval_s <= 0 or max_batch < 1 or max_pending < 1 or batch_ttl_s < 10 or snapshot_interval_s <= 0:
            raise ValueError("flush_interval_s, snapshot_interval_s > 0; max_batch, max_pending >= 1; "
                             "batch_ttl_s >= 10")
        self._store = store
        self._planner = planner
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.batch_ttl_s = batch_ttl_s
        self.snapshot_interval_s = snapshot_interval_s
        # reports not yet written to etcd, each with the future its caller may wait on
        self._pending: deque[tuple[scheduler_pb2.ReportOutcomeRequest, asyncio.Future[bool]]] = deque()
        self._written: dict[int, list[asyncio.Future[bool]]] = {}  # this replica's batch number -> its waiters
        self._wake = asyncio.Event()
        self._seq = 0  # this replica's next batch number
        self._lease: tuple[int, float] | None = None  # (lease id, monotonic time granted)
        self._seen: dict[str, int] = {}  # replica -> last batch number applied (part of the snapshot)
        self._tasks: list[asyncio.Task] = []
        self.applied_revision = 0
        self.applied = 0
        self.dropped = 0
        self.missed = 0
        self.loaded_snapshot = 0
        self.written_snapshot = 0
        self.leading = False
        self.synced = asyncio.Event()  # set once the first catch-up is done (then the watch runs)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(), name="learning-follow"),
                       asyncio.create_task(self._flush_loop(), name="learning-flush"),
                       asyncio.create_task(self._snapshot_loop(), name="learning-snapshot")]

    async def stop(self) -> None:
        with contextlib.suppress(StoreError, TimeoutError):  # what was reported here is not lost on a clean stop
            async with asyncio.timeout(2.0):
                while self._pending:
                    await self._flush_once()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        _settle([done for _, done in self._pending], False)
        for waiting in self._written.values():
            _settle(waiting, False)

    # -- reporting -----------------------------------------------------------------------------------------------

    async def learn(self, request: scheduler_pb2.ReportOutcomeRequest, wait_s: float = 0.0) -> bool:
        """Queue a valid report (checked with :func:`outcome_of`) for the shared log, and wait up to ``wait_s`` until
        this replica has read it back and applied it (so what a caller reported is learned when it returns);
        False when that took longer (it stays queued: GetStats ``learning.pending_outcomes``)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue(request, done)
        if wait_s <= 0:
            return False
        try:
            return await asyncio.wait_for(asyncio.shield(done), wait_s)
        except TimeoutError:
            return False

    def _queue(self, request: scheduler_pb2.ReportOutcomeRequest, done: asyncio.Future[bool]) -> None:
        self._pending.append((request, done))
        if len(self._pending) > self.max_pending:
            _, lost = self._pending.popleft()
            _settle([lost], False)
            self.dropped += 1
            metrics.outcomes_learned("dropped")
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("shared learning: etcd is away and %d outcomes are waiting; dropped %d so far (no "
                            "replica learns them)", self.max_pending, self.dropped)
        if len(self._pending) >= self.max_batch:
            self._wake.set()

    async def _flush_loop(self) -> None:
        backoff = 0.1
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            try:
                while self._pending:
                    await self._flush_once()
                backoff = 0.1
            except StoreError as exc:
                log.warning("shared learning: could not write outcomes (%s); %d waiting, retrying in %.1fs", exc,
                            len(self._pending), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _flush_once(self) -> None:
        batch = [self._pending[i] for i in range(min(self.max_batch, len(self._pending)))]
        lease = await self._batch_lease()
        message = scheduler_pb2.OutcomeBatch(replica=self.replica, outcomes=[r for r, _ in batch], seq=self._seq)
        self._written[self._seq] = [done for _, done in batch]  # before the put: the watch may answer first
        try:
            await self._store.outcomes.put_batch(self.replica, self._seq, message.SerializeToString(), lease)
        except StoreError:
            self._written.pop(self._seq, None)
            raise
        self._seq += 1
        for _ in batch:  # only now: a failed put leaves them queued, in order, for the retry
            self._pending.popleft()

    async def _batch_lease(self) -> int:
        """A lease that ends ``batch_ttl_s`` after it was granted, renewed (a new one) at half of that: each batch
        lives between half and all of ``batch_ttl_s``, long enough for a replica starting from the latest
        snapshot to read it."""
        now = time.monotonic()
        if self._lease is None or now - self._lease[1] > self.batch_ttl_s / 2:
            lease_id, _ = await self._store.leases.grant(self.batch_ttl_s)
            self._lease = (lease_id, now)
        return self._lease[0]

    # -- following -----------------------------------------------------------------------------------------------

    async def _follow(self) -> None:
        backoff = 0.2
        while True:
            try:
                if not self.synced.is_set() and self.applied_revision == 0:
                    await self._load_snapshot()
                batches, at = await self._store.outcomes.batches(self.applied_revision)
                for revision, value in batches:
                    self._apply_batch(revision, value)
                self.applied_revision = max(self.applied_revision, at)
                self.synced.set()
                backoff = 0.2
                async for revision, value in self._store.outcomes.watch(self.applied_revision + 1):
                    self._apply_batch(revision, value)
            except StoreError as exc:
                log.warning("shared learning: %s; reading the log again in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _apply_batch(self, revision: int, value: bytes) -> None:
        if revision <= self.applied_revision:
            return
        self.applied_revision = revision
        try:
            batch = scheduler_pb2.OutcomeBatch.FromString(value)
        except Exception:  # noqa: BLE001 - a value written by something else: every replica skips it alike
            log.warning("shared learning: unreadable outcome batch at revision %d skipped", revision)
            return
        last = self._seen.get(batch.replica, -1)
        if batch.seq <= last:
            return  # written twice (a retried put)
        if batch.seq > last + 1:
            self.missed += batch.seq - last - 1
            log.warning("shared learning: %d batches of replica %s were gone before they were read (its fits may "
                        "differ from the other replicas')", batch.seq - last - 1, batch.replica)
        self._seen[batch.replica] = batch.seq
        results = [apply(self._planner, request) for request in batch.outcomes]
        self.applied += sum(results)
        if batch.replica == self.replica:
            for done, learned in zip(self._written.pop(batch.seq, ()), results, strict=False):
                _settle([done], learned)
            for older in [seq for seq in self._written if seq < batch.seq]:  # never read back (missed)
                _settle(self._written.pop(older), False)

    # -- snapshots ------------------------------------------------------------------------------------------------

    async def _load_snapshot(self) -> None:
        found = await self._store.snapshots.get()
        if found is None:
            return
        manifest, blob = found
        if manifest.get("format") != SNAPSHOT_FORMAT:
            log.warning("shared learning: snapshot format %r unknown; learning from the log only",
                        manifest.get("format"))
            return
        try:
            state = json.loads(zlib.decompress(blob))
            self._planner.load_learned_state(state)
            seen = {str(k): int(v) for k, v in manifest.get("seen", {}).items()}
        except (ValueError, zlib.error) as exc:
            log.warning("shared learning: snapshot unreadable (%s); learning from the log only", exc)
            return
        self._seen = seen
        self.applied_revision = self.loaded_snapshot = int(manifest["revision"])
        age = time.time() - float(manifest.get("written_at", time.time()))
        log.info("shared learning: started from the snapshot at revision %d (%.0fs old)", self.loaded_snapshot, age)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            try:
                await self.write_snapshot_if_leading()
            except StoreError as exc:
                log.warning("shared learning: snapshot not written (%s)", exc)

    async def write_snapshot_if_leading(self) -> bool:
        """Write a snapshot when this replica leads ``learning`` and has applied something since the last one."""
        ttl = max(10, math.ceil(3 * self.snapshot_interval_s))
        self.leading = await self._store.elections.campaign("learning", self.replica, ttl)
        if not self.leading or not self.synced.is_set() or self.applied_revision <= self.written_snapshot:
            return False
        revision, state = self.applied_revision, self._planner.learned_state()  # both at once: one consistent view
        manifest = {"format": SNAPSHOT_FORMAT, "revision": revision, "seen": dict(self._seen),
                    "written_at": time.time(), "replica": self.replica}
        blob = await asyncio.to_thread(lambda: zlib.compress(json.dumps(state).encode(), 6))
        await self._store.snapshots.put(manifest, blob)
        self.written_snapshot = revision
        return True

    def fill_stats(self, out: scheduler_pb2.LearningStats) -> None:
        out.mode, out.replica, out.applied_revision = self.mode, self.replica, self.applied_revision
        out.applied_outcomes, out.pending_outcomes, out.dropped_outcomes = self.applied, len(self._pending), \
            self.dropped
        out.loaded_snapshot_revision, out.written_snapshot_revision = self.loaded_snapshot, self.written_snapshot
        out.leading, out.missed_batches = self.leading, self.missed


def _settle(futures: list[asyncio.Future[bool]], value: bool) -> None:
    for future in futures:
        if not future.done():
            future.set_result(value)
