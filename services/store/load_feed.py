"""The load feed in Redis: every worker's engine load samples in one stream, read by every planner replica.

One poller per worker: the worker's agent polls its own vLLM's ``GetLoads`` over loopback and appends each sample
here (:class:`LoadFeedPublisher`); each planner replica (a scheduler, or a gateway planning in-process) reads the
one stream with one blocking ``XREAD`` loop (:class:`LoadFeedReader`) instead of polling every worker: at 1,000
workers and 50 replicas, 2,000 samples a second into Redis and out to each replica, not 100,000 polls a second.

Key (under the store's key prefix): ``{prefix}load-feed``, a stream whose entries' field ``b`` is one serialized
``kvshuttle.v1.WorkerLoadSample``, capped (approximately) at ``max_len`` entries. A reader starts at the stream's end:
every worker's next sample comes within its interval; there is nothing to catch up on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from kvshuttle.control_plane.load_feed import BadLoadSample, FeedSample, from_feed
from kvshuttle.services.store.keys import normalized_prefix
from kvshuttle.services.store.kv_feed import StreamFollower
from kvshuttle.v1 import kv_feed_pb2
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

STREAM = "load-feed"


class LoadFeedPublisher:
    """A worker agent's side: ``publish`` samples, each call bounded by ``timeout_s``; failures raise (RedisError,
    OSError, TimeoutError): the agent counts them and carries on (planners poll a worker whose samples stop)."""

    def __init__(self, url: str, key_prefix: str, *, max_len: int = 20_000, timeout_s: float = 2.0):
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.stream = normalized_prefix(key_prefix) + STREAM
        self.max_len, self.timeout_s = max_len, timeout_s

    async def publish(self, sample: kv_feed_pb2.WorkerLoadSample) -> None:
        await asyncio.wait_for(self._redis.xadd(self.stream, {"b": sample.SerializeToString()}, maxlen=self.max_len,
                                                approximate=True), self.timeout_s)

    async def close(self) -> None:
        await self._redis.aclose()


class LoadFeedReader(StreamFollower):
    """A planner's side: follows the stream from a background task, handing each sample to ``on_sample``;
    ``start`` / ``await stop`` (:class:`StreamFollower`). Never raises: Redis failures are retried with backoff
    (``connected`` says whether the last read worked; the caller polls the workers meanwhile)."""

    TASK_NAME = "load-feed-reader"

    def __init__(self, url: str, key_prefix: str, on_sample: Callable[[FeedSample], None], *, block_ms: int = 1000,
                 count: int = 2000):
        self._redis = aioredis.from_url(url, socket_timeout=block_ms / 1000 + 5, socket_connect_timeout=5)
        self.stream = normalized_prefix(key_prefix) + STREAM
        self.on_sample = on_sample
        self.block_ms, self.count = block_ms, count
        self.last_id = ""
        self.connected = False
        self.samples = 0
        self.bad_entries = 0

    async def _run(self) -> None:
        delay = 0.2
        while not self._stopping:
            try:
                if not self.last_id:
                    info = await self._redis.xrevrange(self.stream, count=1)
                    self.last_id = info[0][0].decode() if info else "0-0"
                got = await self._redis.xread({self.stream: self.last_id}, count=self.count, block=self.block_ms)
                self.connected, delay = True, 0.2
                for _stream, entries in got or ():
                    for sid, fields in entries:
                        self.last_id = sid.decode()
                        self._apply(fields.get(b"b", b""))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as exc:
                if self.connected or delay == 0.2:
                    log.warning("load feed read failed (%s: %s); polling the workers meanwhile",
                                type(exc).__name__, exc)
                self.connected = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _apply(self, payload: bytes) -> None:
        try:
            sample = from_feed(kv_feed_pb2.WorkerLoadSample.FromString(payload))
        except (BadLoadSample, DecodeError, ValueError) as exc:
            self.bad_entries += 1
            log.warning("bad load feed entry: %s", exc)
            return
        self.samples += 1
        try:
            self.on_sample(sample)
        except Exception:  # noqa: BLE001 - one sample must not stop the feed
            log.exception("applying a load sample of %s failed", sample.worker_id)
