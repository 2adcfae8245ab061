"""The KV feed in Redis: every prefill worker's prefix-cache changes in one stream, read by every planner replica.

One subscriber per worker: the worker's agent reads its own vLLM's KV events over loopback and appends them here
(:class:`KvFeedPublisher`); each planner replica (a scheduler, or a gateway planning in-process) reads the one
stream with one blocking ``XREAD`` loop (:class:`KvFeedReader`). Redis does the fan-out: no planner holds a
connection per worker, and no worker a stream per planner.

Keys (under the store's key prefix):

- ``{prefix}kv-feed``: the stream; each entry's field ``b`` is one serialized ``kvshuttle.v1.KvFeedBatch``. Capped
  (approximately) at ``max_len`` entries: a reader that falls further behind loses entries, notices the break by the
  worker's ``seq``, and resyncs from the snapshot.
- ``{prefix}kv-snapshot/{worker id}``: a hash with ``b`` (a ``KvFeedBatch`` holding the worker's whole view as of
  its entry ``seq``) and ``id`` (the stream id of that entry, ``0-0`` before the first): written by the agent every
  few seconds while its view changes, expiring with ``ttl_s`` (refreshed) so a departed worker's goes away.

A reader starts from the snapshots: it applies each, then reads the stream from the oldest snapshot's stream id, so
that it knows every worker's cache exactly from its first plan (entries a snapshot already covers are duplicates).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from kvshuttle.control_plane.kv_index.feed import FeedFollower
from kvshuttle.control_plane.kv_index.feed_codec import BadFeedEntry, from_feed
from kvshuttle.services.store.keys import normalized_prefix
from kvshuttle.v1 import kv_feed_pb2
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

STREAM = "kv-feed"
SNAPSHOT = "kv-snapshot/"


class KvFeedPublisher:
    """A worker agent's side: ``publish`` entries and ``write_snapshot``; every call bounded by ``timeout_s``.
    Failures raise RedisError (the agent counts them and carries on: a reader resyncs from the next snapshot)."""

    def __init__(self, url: str, key_prefix: str, *, max_len: int = 100_000, timeout_s: float = 2.0,
                 exact_trim: bool = False):
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = normalized_prefix(key_prefix)
        self.stream = self.prefix + STREAM
        self.max_len = max_len
        self.timeout_s = timeout_s
        self.exact_trim = exact_trim  # Redis trims whole nodes (~100 entries) unless exact: cheaper

    async def publish(self, entry: kv_feed_pb2.KvFeedBatch) -> str:
        """Append one entry; its stream id."""
        sid = await asyncio.wait_for(
            self._redis.xadd(self.stream, {"b": entry.SerializeToString()}, maxlen=self.max_len,
                              approximate=not self.exact_trim),
            self.timeout_s)
        return sid.decode() if isinstance(sid, bytes) else str(sid)

    async def write_snapshot(self, snapshot: kv_feed_pb2.KvFeedBatch, stream_id: str, ttl_s: float) -> None:
        key = self.prefix + SNAPSHOT + snapshot.worker_id
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"b": snapshot.SerializeToString(), "id": stream_id})
        pipe.pexpire(key, int(ttl_s * 1000))
        await asyncio.wait_for(pipe.execute(), self.timeout_s)

    async def delete_snapshot(self, worker_id: str) -> None:
        await asyncio.wait_for(self._redis.delete(self.prefix + SNAPSHOT + worker_id), self.timeout_s)

    async def close(self) -> None:
        await self._redis.aclose()


class StreamFollower:
    """A planner's blocking ``XREAD`` loop on one stream, in a background task: ``start`` / ``await stop``.
    Subclasses set ``_redis``, ``block_ms`` and ``TASK_NAME``, and write ``_run`` (looping while not ``_stopping``)."""

    TASK_NAME = "feed-reader"
    _redis: aioredis.Redis
    block_ms: int
    _task: asyncio.Task | None = None
    _stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.TASK_NAME)

    async def _run(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop after the read in progress (a cancelled blocking XREAD can leave redis-py waiting on the
        connection); cancelled if it takes longer than the read's block time and a margin."""
        self._stopping = True
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=self.block_ms / 1000 + 2.0)
            if not done:
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=2.0)
        await self._redis.aclose()


class KvFeedReader(StreamFollower):
    TASK_NAME = "kv-feed-reader"

    """A planner's side: follows the stream into ``follower`` (its index) from a background task; ``start`` /
    ``await stop``. Workers awaiting a snapshot are re-read every ``snapshot_retry_s``. Never raises: Redis failures are
    retried with backoff (the index keeps its last state meanwhile; ``connected`` says whether the last read
    worked)."""

    def __init__(self, url: str, key_prefix: str, follower: FeedFollower, *, block_ms: int = 1000,
                 count: int = 1000, snapshot_retry_s: float = 1.0):
        self._redis = aioredis.from_url(url, socket_timeout=block_ms / 1000 + 5, socket_connect_timeout=5)
        self.prefix = normalized_prefix(key_prefix)
        self.stream = self.prefix + STREAM
        self.follower = follower
        self.block_ms, self.count = block_ms, count
        self.snapshot_retry_s = snapshot_retry_s
        self.last_id = ""
        self.connected = False
        self.entries = 0  # entries read
        self.bad_entries = 0
        self.ready = asyncio.Event()  # set once the snapshots were read and the stream is being followed
        self._snapshot_tried: dict[str, float] = {}

    async def _run(self) -> None:
        delay = 0.2
        while not self._stopping:
            try:
                if not self.last_id:
                    self.last_id = await self._from_snapshots()
                    self.ready.set()
                await self._read_once()
                await self._resync_waiting()
                self.connected, delay = True, 0.2
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as exc:
                if self.connected or delay == 0.2:
                    log.warning("KV feed read failed (%s: %s); retrying", type(exc).__name__, exc)
                self.connected = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _from_snapshots(self) -> str:
        """Apply every worker's snapshot; the stream id to read from (the oldest snapshot's, or the stream's end)."""
        end = await self._stream_end()
        oldest = None
        async for key in self._redis.scan_iter(match=self.prefix + SNAPSHOT + "*", count=500):
            worker = key.decode()[len(self.prefix + SNAPSHOT):]
            sid = await self._apply_snapshot(worker)
            if sid is not None and (oldest is None or _id_key(sid) < _id_key(oldest)):
                oldest = sid
        return oldest or end

    async def _stream_end(self) -> str:
        info = await self._redis.xrevrange(self.stream, count=1)
        return info[0][0].decode() if info else "0-0"

    async def _apply_snapshot(self, worker: str) -> str | None:
        """Read and offer ``worker``'s snapshot to the follower; its stream id when it was applied."""
        raw = await self._redis.hgetall(self.prefix + SNAPSHOT + worker)
        if not raw or b"b" not in raw:
            return None
        try:
            entry = kv_feed_pb2.KvFeedBatch.FromString(raw[b"b"])
            batch = from_feed(entry)
        except (BadFeedEntry, DecodeError, ValueError) as exc:
            self.bad_entries += 1
            log.warning("bad KV snapshot of %s: %s", worker, exc)
            return None
        if entry.worker_id != worker:
            return None
        applied = self.follower.on_snapshot(worker, entry.epoch, entry.seq, batch)
        return raw.get(b"id", b"0-0").decode() if applied else None

    async def _read_once(self) -> None:
        got = await self._redis.xread({self.stream: self.last_id}, count=self.count, block=self.block_ms)
        for _stream, entries in got or ():
            for sid, fields in entries:
                self.last_id = sid.decode()
                self.entries += 1
                self._apply(fields.get(b"b", b""))

    def _apply(self, payload: bytes) -> None:
        try:
            entry = kv_feed_pb2.KvFeedBatch.FromString(payload)
            if not entry.worker_id:
                raise BadFeedEntry("an entry that names no worker")
            batch = from_feed(entry)
        except (BadFeedEntry, DecodeError, ValueError) as exc:
            self.bad_entries += 1
            log.warning("bad KV feed entry: %s", exc)
            return
        self.follower.on_entry(entry.worker_id, entry.epoch, entry.seq, batch)

    async def _resync_waiting(self) -> None:
        now = time.monotonic()
        for worker in self.follower.waiting():
            if now - self._snapshot_tried.get(worker, float("-inf")) >= self.snapshot_retry_s:
                self._snapshot_tried[worker] = now
                await self._apply_snapshot(worker)


def _id_key(sid: str) -> tuple[int, int]:
    ms, _, n = sid.partition("-")
    return int(ms), int(n or 0)
