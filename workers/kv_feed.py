"""A prefill worker's side of the KV feed: its agent is the one subscriber to its vLLM's KV events.

The agent reads the engine's events over loopback (the gRPC servicer's ``SubscribeKvEvents`` relay, which starts
each subscription with the engine's whole cache) and appends them to the feed (services/store/kv_feed.py), numbered
``seq`` 0, 1, 2... within this agent's ``epoch``. Batches that arrive within ``coalesce_s`` of each other go out as
one entry: a busy engine reports every scheduler step, and at a thousand workers an entry per step would be tens of
thousands of entries a second for every planner replica to read; the index learns of a block at most ``coalesce_s``
later.

It keeps its own view of the worker's cache (the same index the planners keep) and writes it as the worker's
snapshot every ``snapshot_interval_s`` while it changes (and at least every ``ttl_s / 3``, so it does not expire
while the worker lives), for planners that join late or miss entries.

Failures never stop the worker: a broken event stream is resubscribed (the relay's snapshot comes again, starting
with a clear); an entry the feed refused is counted (``published_failures``) and skipped (readers notice the break
in ``seq`` and resync from the next snapshot, which includes it).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvshuttle.control_plane.kv_index.events import EventBatch
from kvshuttle.control_plane.kv_index.feed_codec import snapshot, to_feed
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex
from kvshuttle.services.engine.client import EngineClient, EngineError
from kvshuttle.services.store.kv_feed import KvFeedPublisher
from redis.exceptions import RedisError

log = logging.getLogger(__name__)


class KvFeedAgent:
    def __init__(self, worker_id: str, engine: EngineClient, publisher: KvFeedPublisher, scheme: HashScheme, *,
                 coalesce_s: float = 0.05, snapshot_interval_s: float = 5.0, ttl_s: float = 60.0,
                 retry_s: float = 1.0):
        self.worker_id = worker_id
        self.engine = engine
        self.publisher = publisher
        self.scheme = scheme
        self.coalesce_s = coalesce_s
        self.snapshot_interval_s = snapshot_interval_s
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.epoch = time.time_ns()
        self.seq = 0  # the next entry's
        self.index = KvIndex(scheme)
        self._pending: list[EventBatch] = []
        self._arrived = asyncio.Event()
        self._last_id = "0-0"  # stream id of the last entry published
        self._last_ts = 0.0
        self._lock = asyncio.Lock()
        self.received = 0  # engine batches
        self.published = 0  # feed entries
        self.published_failures = 0
        self.snapshots = 0
        self.subscriptions = 0

    async def run(self) -> None:
        """Forever: follow the engine's events; entries and snapshots go out from two more tasks."""
        tasks = [asyncio.create_task(self._entries(), name="kv-feed-entries"),
                 asyncio.create_task(self._snapshots(), name="kv-feed-snapshots")]
        try:
            delay = self.retry_s
            while True:
                try:
                    self.subscriptions += 1
                    async for batch in self.engine.kv_events():
                        self.received += 1
                        self._pending.append(batch)
                        self._arrived.set()
                        delay = self.retry_s
                except EngineError as exc:
                    log.warning("KV event stream from the engine broke (%s); resubscribing", exc)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # this agent is stopping
                    # grpc.aio raises CancelledError when the server cancels the stream: resubscribe
                    log.warning("KV event stream cancelled by the engine's server; resubscribing")
                except Exception:  # noqa: BLE001 - never stop following the engine's events
                    log.exception("KV event stream failed; resubscribing")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _entries(self) -> None:
        while True:
            try:
                await self._entries_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed entry must not stop the next ones
                log.exception("publishing KV events failed; continuing")
                await asyncio.sleep(self.retry_s)

    async def _entries_once(self) -> None:
        while True:
            await self._arrived.wait()
            if self.coalesce_s > 0:
                await asyncio.sleep(self.coalesce_s)
            self._arrived.clear()
            batches, self._pending = self._pending, []
            if batches:
                await self._publish(EventBatch(ts=batches[-1].ts,
                                               events=tuple(e for b in batches for e in b.events)))

    async def _publish(self, batch: EventBatch) -> None:
        async with self._lock:
            seq = self.seq
            self.seq += 1
            self.index.apply(self.worker_id, seq, batch)
            self._last_ts = batch.ts
            try:
                self._last_id = await self.publisher.publish(to_feed(self.worker_id, self.epoch, seq, batch))
                self.published += 1
            except (RedisError, OSError, TimeoutError) as exc:
                self.published_failures += 1
                log.warning("could not publish KV events to the feed (%s: %s); readers resync from the next "
                            "snapshot", type(exc).__name__, exc)

    async def _snapshots(self) -> None:
        written_seq, written_at = -1, float("-inf")
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            now = time.monotonic()
            if self.seq == 0 or (self.seq - 1 == written_seq and now - written_at < self.ttl_s / 3):
                continue
            async with self._lock:
                seq = self.seq - 1
                snap = snapshot(self.worker_id, self.epoch, seq, self._last_ts, self.index.held(self.worker_id),
                                self.scheme.block_size)
                stream_id = self._last_id
            try:
                await self.publisher.write_snapshot(snap, stream_id, self.ttl_s)
                written_seq, written_at = seq, now
                self.snapshots += 1
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("could not write the KV snapshot (%s: %s)", type(exc).__name__, exc)

    async def close(self) -> None:
        try:
            await self.publisher.delete_snapshot(self.worker_id)
        except (RedisError, OSError, TimeoutError):
            pass
        await self.publisher.close()
        await self.engine.close()
