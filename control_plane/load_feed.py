"""The load feed's wire form (``kvshuttle.v1.WorkerLoadSample``) to and from a :class:`WorkerLoad` (pure).

A worker's agent polls its own engine and publishes each sample; a planner reads them instead of polling every
worker. A sample is the engine's answer (``error`` empty) or why there was none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.v1 import kv_feed_pb2


class BadLoadSample(ValueError):
    """A feed entry that no publisher of this version writes."""


@dataclass(frozen=True)
class FeedSample:
    worker_id: str
    polled_at: float  # Unix seconds, the worker's clock
    interval_s: float
    load: WorkerLoad | None  # None: the engine did not answer (``error`` says why)
    error: str = ""


def to_feed(worker_id: str, polled_at: float, interval_s: float, load: WorkerLoad | None,
            error: str = "") -> kv_feed_pb2.WorkerLoadSample:
    out = kv_feed_pb2.WorkerLoadSample(worker_id=worker_id, polled_at=polled_at, interval_s=interval_s)
    if load is None:
        out.error = error or "no answer"
        return out
    out.running, out.waiting = load.running, load.waiting
    out.used_tokens, out.capacity_tokens = load.used_tokens, load.capacity_tokens
    out.waiting_uncached_tokens, out.cache_hit_rate = load.waiting_uncached_tokens, load.cache_hit_rate
    return out


def from_feed(msg: kv_feed_pb2.WorkerLoadSample) -> FeedSample:
    if not msg.worker_id:
        raise BadLoadSample("a load sample that names no worker")
    if not (math.isfinite(msg.polled_at) and msg.polled_at > 0 and math.isfinite(msg.interval_s)
            and msg.interval_s > 0):
        raise BadLoadSample(f"load sample of {msg.worker_id}: polled_at and interval_s must be positive")
    if msg.error:
        return FeedSample(msg.worker_id, msg.polled_at, msg.interval_s, None, msg.error)
    numbers = (msg.running, msg.waiting, msg.used_tokens, msg.capacity_tokens, msg.waiting_uncached_tokens)
    if min(numbers) < 0 or not (0.0 <= msg.cache_hit_rate <= 1.0):
        raise BadLoadSample(f"load sample of {msg.worker_id}: negative counts or a hit rate outside 0..1")
    return FeedSample(msg.worker_id, msg.polled_at, msg.interval_s, WorkerLoad(
        running=msg.running, waiting=msg.waiting, used_tokens=msg.used_tokens, capacity_tokens=msg.capacity_tokens,
        waiting_uncached_tokens=msg.waiting_uncached_tokens, cache_hit_rate=msg.cache_hit_rate))
