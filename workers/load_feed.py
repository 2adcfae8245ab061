"""A worker's side of the load feed: its agent polls its own vLLM's ``GetLoads`` and publishes every sample.

Every ``interval_s`` (over loopback, bounded by ``timeout_s``) the agent asks its engine for its load and appends
the answer, or why there was none, to the feed (services/store/load_feed.py), so the planners need not poll every
worker themselves. A sample the feed refused is counted (``publish_failures``) and dropped: the next one follows
within an interval, and a planner polls a worker whose samples stop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvshuttle.control_plane.load import parse_get_loads
from kvshuttle.control_plane.load_feed import to_feed
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.services.store.load_feed import LoadFeedPublisher
from redis.exceptions import RedisError

log = logging.getLogger(__name__)


class LoadFeedAgent:
    def __init__(self, worker_id: str, engine: EngineClient, publisher: LoadFeedPublisher, *,
                 interval_s: float = 0.5, timeout_s: float = 1.0):
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be > 0")
        self.worker_id, self.engine, self.publisher = worker_id, engine, publisher
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.published = 0
        self.publish_failures = 0
        self.engine_failures = 0

    async def run(self) -> None:
        """Forever: one sample per interval (a slow poll or publish delays the next, never doubles it)."""
        next_at = time.monotonic()
        logged = float("-inf")
        while True:
            await self.sample_once()
            if self.publish_failures and time.monotonic() - logged > 30:
                logged = time.monotonic()
                log.warning("%d load samples could not be published so far", self.publish_failures)
            next_at = max(next_at + self.interval_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def sample_once(self) -> None:
        polled_at = time.time()
        load, error = None, ""
        try:
            load = parse_get_loads(await asyncio.wait_for(self.engine.get_loads(), self.timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is "no answer this time", published as such
            self.engine_failures += 1
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        try:
            await self.publisher.publish(to_feed(self.worker_id, polled_at, self.interval_s, load, error))
            self.published += 1
        except (RedisError, OSError, TimeoutError):
            self.publish_failures += 1

    async def close(self) -> None:
        await self.publisher.close()
        await self.engine.close()
