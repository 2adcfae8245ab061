"""Live load of every registered worker: the scheduler polls each vLLM engine's ``GetLoads`` off the request path.

A background task follows the :class:`WorkerView`: it opens one gRPC channel per worker when the worker appears,
polls it every ``interval_s`` (all workers at once, each poll bounded by ``timeout_s``, a slow worker never delays
the others and never gets two polls in flight), and closes the channel when the worker leaves the view or changes
its address. :meth:`LoadMonitor.loads` is a cheap, synchronous read for the planning path.

A worker's queue is the larger of its last two samples' (``control_plane.load.smoothed``): a busy engine can show an
empty queue for one sample, between one request and the next.

Between two samples the scheduler counts what it sent to each worker itself (:meth:`note_assigned`): a turn counts as
``pending`` until a sample arrives whose poll was sent at least ``pending_grace_s`` after the turn was noted. vLLM's
numbers are its scheduler's stats after the last engine step, so a request shows up only once the caller has sent it
and the engine has stepped with it: a sample taken right after the note would clear a turn it does not count yet
(a turn noted while a poll is in flight always stays pending until a later one).

**The load feed** (``feed_url``: the KV feed's Redis): each worker's agent polls its own engine and publishes the
samples to one stream (workers/load_feed.py), and the monitor reads that stream (services/store/load_feed.py)
instead of polling. It polls only the workers whose samples have not arrived for ``FEED_STALE_INTERVALS`` of their
interval (not publishing, their agent or its Redis path gone, or the feed down), so a dead worker is still found
unreachable. A feed sample's poll time is the worker's clock, mapped onto this host's: the ``pending`` rule above
assumes the two agree to well within ``pending_grace_s``.

Failures are normal while a worker starts (registered before its first answer, or restarting): they are logged at
debug level until the worker has answered once, then as a warning when it turns unreachable (at most once per
``LOG_EVERY_S``). The task never raises; a poll never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

from kvshuttle.control_plane.load import WorkerLoad, parse_get_loads, smoothed
from kvshuttle.control_plane.load_feed import FeedSample
from kvshuttle.services.common.worker_view import WorkerView
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.services.store.load_feed import LoadFeedReader
from kvshuttle.v1 import common_pb2
from opentelemetry.instrumentation.utils import suppress_instrumentation

log = logging.getLogger(__name__)
LOG_EVERY_S = 30.0
# A worker that has never answered is only warned about after this long (vLLM takes a while to start).
STARTUP_GRACE_S = 120.0
# Pending notes of a worker that is not in the view are kept this long (the view may lag behind a registration).
PENDING_ORPHAN_S = 10.0
# Notes no sample has cleared in this long are dropped (a worker that stopped answering keeps no unbounded list).
PENDING_MAX_AGE_S = 30.0
# A worker's feed samples count as stopped (it is polled instead) after this many of its intervals without one...
FEED_STALE_INTERVALS = 4
# ... and never sooner than this.
FEED_STALE_MIN_S = 2.0


@dataclasses.dataclass
class _Worker:
    address: str
    client: EngineClient
    added_at: float
    sample: WorkerLoad | None = None
    previous: WorkerLoad | None = None  # the sample before (control_plane.load.smoothed)
    sampled_at: float = 0.0  # monotonic time the sample's poll was sent
    polls: int = 0  # completed polls, failed or not
    failures: int = 0  # consecutive failed polls
    in_flight: asyncio.Task | None = None
    last_logged: float = float("-inf")
    last_error: str = ""
    source: str = ""  # where the last sample came from: "feed" or "poll"
    fed_at: float = float("-inf")  # monotonic time the last feed sample arrived
    feed_interval_s: float = 0.0


class LoadMonitor:
    """``loads()`` / ``healthy()`` / ``note_assigned()`` over a background poller; ``start()`` / ``await stop()``.

    ``client_factory(address, timeout_s)`` makes the per-worker client (an :class:`EngineClient` by default; it must
    offer ``async get_loads() -> dict`` and ``async close()``).
    """

    def __init__(self, workers: WorkerView, interval_s: float = 0.5, timeout_s: float = 1.0,
                 unreachable_after: int = 2, *, pending_grace_s: float = 0.25,
                 client_factory: Callable[[str, float], EngineClient] | None = None,
                 clock: Callable[[], float] = time.monotonic, feed_url: str = "", feed_key_prefix: str = "/kvshuttle/",
                 wall_clock: Callable[[], float] = time.time):
        if interval_s <= 0 or timeout_s <= 0 or unreachable_after < 1 or pending_grace_s < 0:
            raise ValueError("interval_s and timeout_s must be > 0, unreachable_after >= 1, pending_grace_s >= 0")
        self._view = workers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unreachable_after = unreachable_after
        self.pending_grace_s = pending_grace_s
        self._client_factory = client_factory or (lambda address, timeout: EngineClient(address, timeout_s=timeout))
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        # worker id -> (monotonic time noted, prompt tokens) of turns assigned since its last sample.
        self._pending: dict[str, deque[tuple[float, int]]] = {}
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()
        self._wall_clock = wall_clock
        self.feed = LoadFeedReader(feed_url, feed_key_prefix, self.on_feed_sample) if feed_url else None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load-monitor")
        if self.feed is not None:
            self.feed.start()

    async def stop(self) -> None:
        if self.feed is not None:
            await self.feed.stop()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for worker_id in list(self._workers):
            await self._drop(worker_id)
        await asyncio.gather(*self._closing, return_exceptions=True)

    # -- reads (synchronous, for the planning path) --------------------------------------------------------------

    def loads(self) -> dict[str, WorkerLoad]:
        """The latest sample per worker with ``age_s``, ``pending`` and ``reachable`` filled in now.

        A worker that has not answered yet is listed only when it is already unreachable (``reachable=False``,
        zero numbers) or has pending turns (zero numbers); otherwise it is absent (the selector treats it as
        unknown: idle and reachable).
        """
        now = self._clock()
        out: dict[str, WorkerLoad] = {}
        for worker_id, w in self._workers.items():
            pending = self._pending.get(worker_id, ())
            n, tokens = len(pending), sum(t for _, t in pending)
            reachable = w.failures < self.unreachable_after
            if w.sample is None:
                if reachable and not n:
                    continue
                base, age = WorkerLoad(), now - w.added_at
            else:
                base, age = smoothed(w.sample, w.previous), now - w.sampled_at
            out[worker_id] = dataclasses.replace(base, pending=n, pending_tokens=tokens, age_s=max(0.0, age),
                                                 reachable=reachable)
        for worker_id, pending in self._pending.items():  # noted before the monitor saw the worker
            if worker_id not in out and pending:
                out[worker_id] = WorkerLoad(pending=len(pending), pending_tokens=sum(t for _, t in pending))
        return out

    def healthy(self, worker_id: str) -> bool | None:
        """None before the first completed poll of the worker (or for an unknown worker); True while its polls
        answer (fewer than ``unreachable_after`` failures in a row since an answer); False otherwise."""
        w = self._workers.get(worker_id)
        if w is None or w.polls == 0:
            return None
        return w.sample is not None and w.failures < self.unreachable_after

    def source(self, worker_id: str) -> str:
        """Where ``worker_id``'s last sample came from ("feed", "poll"; "" before the first)."""
        w = self._workers.get(worker_id)
        return w.source if w is not None else ""

    def fill_feed_stats(self, out) -> None:
        """GetStats' ``load_feed`` (a ``scheduler_pb2.LoadFeedStats``); nothing without a feed."""
        if self.feed is None:
            return
        now = self._clock()
        out.following, out.samples, out.bad_entries = self.feed.connected, self.feed.samples, self.feed.bad_entries
        fed = sum(1 for w in self._workers.values() if self._fed(w, now))
        out.fed_workers, out.polled_workers = fed, len(self._workers) - fed

    def note_assigned(self, worker_id: str, tokens: int) -> None:
        """The scheduler has just sent a turn of ``tokens`` prompt tokens to this worker."""
        self._pending.setdefault(worker_id, deque()).append((self._clock(), max(0, int(tokens))))

    def note_finished(self, worker_id: str) -> None:
        """One turn sent to this worker is done (its prefill was reported): it no longer counts as pending. Short
        prefills finish within one engine step and never show in GetLoads, so this is what clears them promptly."""
        pending = self._pending.get(worker_id)
        if pending:
            pending.popleft()

    # -- polling -------------------------------------------------------------------------------------------------

    async def poll_now(self) -> None:
        """Follow the view and poll every worker once, waiting for the answers (tests, start-up)."""
        with suppress_instrumentation():
            self._sync()
            tasks = [self._launch(worker_id) for worker_id in list(self._workers)]
        await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)

    async def _run(self) -> None:
        # The polls are not part of any trace: without this every poll would export a client span.
        with suppress_instrumentation():
            next_at = self._clock()
            while True:
                try:
                    self._sync()
                    now = self._clock()
                    for worker_id, w in list(self._workers.items()):
                        if not self._fed(w, now):
                            self._launch(worker_id)
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let the monitor die: the planning path would fall back to stale numbers
                    log.exception("load monitor iteration failed")
                next_at += self.interval_s
                now = self._clock()
                if next_at < now:  # fell behind (a stalled loop): don't burst to catch up
                    next_at = now
                await asyncio.sleep(next_at - now)

    def _current_view(self) -> dict[str, str]:
        workers: dict[str, str] = {}
        for role in common_pb2.WorkerRole.values():
            for w in self._view.by_role(role):
                workers[w.worker_id] = w.grpc_address
        return workers

    def _sync(self) -> None:
        view = self._current_view()
        now = self._clock()
        for worker_id, w in list(self._workers.items()):
            if view.get(worker_id) != w.address:
                self._schedule_drop(worker_id)
        for worker_id, address in view.items():
            if worker_id not in self._workers and address:
                self._workers[worker_id] = _Worker(address, self._client_factory(address, self.timeout_s), now)
        for worker_id, notes in list(self._pending.items()):
            while notes and now - notes[0][0] > PENDING_MAX_AGE_S:
                notes.popleft()
            if not notes or (worker_id not in view and now - notes[-1][0] > PENDING_ORPHAN_S):
                del self._pending[worker_id]

    def _schedule_drop(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id)
        if w.in_flight is not None:
            w.in_flight.cancel()
        task = asyncio.create_task(self._close(w), name=f"load-monitor-close-{worker_id}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _drop(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            if w.in_flight is not None:
                w.in_flight.cancel()
            await self._close(w)

    @staticmethod
    async def _close(w: _Worker) -> None:
        if w.in_flight is not None:
            await asyncio.gather(w.in_flight, return_exceptions=True)
        try:
            await w.client.close()
        except Exception as exc:  # noqa: BLE001 - a channel that fails to close is gone anyway
            log.debug("closing the load channel to %s: %s", w.address, exc)

    def _launch(self, worker_id: str) -> asyncio.Task | None:
        w = self._workers[worker_id]
        if w.in_flight is not None and not w.in_flight.done():
            return None  # still waiting on the last poll (bounded by the timeout)
        w.in_flight = asyncio.create_task(self._poll(worker_id, w), name=f"load-poll-{worker_id}")
        return w.in_flight

    def _fed(self, w: _Worker, now: float) -> bool:
        """Whether ``w``'s load comes from the feed now (its samples arrive: it need not be polled)."""
        return (self.feed is not None and self.feed.connected
                and now - w.fed_at <= max(FEED_STALE_MIN_S, FEED_STALE_INTERVALS * w.feed_interval_s))

    async def _poll(self, worker_id: str, w: _Worker) -> None:
        sent = self._clock()
        try:
            raw = await asyncio.wait_for(w.client.get_loads(), self.timeout_s)
            sample = parse_get_loads(raw)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is "no answer this time"
            w.polls += 1
            self._failed(worker_id, w, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        w.polls += 1
        if self._workers.get(worker_id) is not w:
            return  # left the view while the poll was in flight
        self._sampled(worker_id, w, sample, sent, "poll")

    def on_feed_sample(self, sample: FeedSample) -> None:
        """A sample from the load feed (the worker's agent polled its engine at ``sample.polled_at``)."""
        w = self._workers.get(sample.worker_id)
        if w is None:
            return  # not in the view (yet): its next sample follows within its interval
        now = self._clock()
        sent = min(now, now - (self._wall_clock() - sample.polled_at))  # the worker's poll time, on this clock
        if sent < w.sampled_at:
            return  # older than what this replica has (a poll of its own overtook it)
        w.fed_at, w.feed_interval_s = now, sample.interval_s
        w.polls += 1
        if sample.load is None:
            self._failed(sample.worker_id, w, f"(its agent's poll) {sample.error}")
        else:
            self._sampled(sample.worker_id, w, sample.load, sent, "feed")

    def _sampled(self, worker_id: str, w: _Worker, sample: WorkerLoad, sent: float, source: str) -> None:
        if w.failures >= self.unreachable_after and w.sample is not None and w.last_logged > w.sampled_at:
            log.info("worker %s answers load polls again (after %d failures)", worker_id, w.failures)
        w.previous = w.sample if w.failures == 0 else None
        w.sample, w.sampled_at, w.failures, w.source = sample, sent, 0, source
        notes = self._pending.get(worker_id)
        while notes and notes[0][0] + self.pending_grace_s <= sent:
            notes.popleft()

    def _failed(self, worker_id: str, w: _Worker, error: str) -> None:
        w.failures += 1
        w.last_error = error
        now = self._clock()
        if w.sample is None:  # never answered: starting up (normal), or not a vLLM worker at all
            level = logging.WARNING if now - w.added_at > STARTUP_GRACE_S else logging.DEBUG
        else:
            level = logging.DEBUG if w.failures < self.unreachable_after else logging.WARNING
        if level == logging.WARNING and now - w.last_logged < LOG_EVERY_S:
            level = logging.DEBUG
        if level == logging.WARNING:
            w.last_logged = now
        log.log(level, "load poll of worker %s at %s failed (%d in a row): %s", worker_id, w.address, w.failures,
                w.last_error)
