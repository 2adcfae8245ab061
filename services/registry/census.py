"""Counts the live workers (by role) and the session records in etcd every ``interval_s`` for the metrics
(``kvshuttle_live_workers``, ``kvshuttle_live_sessions``): two small reads per interval, never one per scrape, so
the gauges are up to ``interval_s`` old. While etcd is unreachable they keep their last values (the etcd error
counters say why). Every registry replica counts the same etcd: aggregate them with max(), not sum().
"""

from __future__ import annotations

import asyncio
import logging

from kvshuttle.services.common import metrics
from kvshuttle.services.store.etcd_sessions import SessionStore
from kvshuttle.services.store.etcd_workers import WorkerStore
from kvshuttle.services.store.interface import StoreError
from kvshuttle.v1 import common_pb2

log = logging.getLogger(__name__)
_ROLES = {common_pb2.WORKER_ROLE_PREFILL: "prefill", common_pb2.WORKER_ROLE_DECODE: "decode"}


class Census:
    def __init__(self, workers: WorkerStore, sessions: SessionStore, interval_s: float = 10.0):
        """``workers`` and ``sessions``: the registry store's parts (``EtcdStore.workers``, ``EtcdStore.sessions``)."""
        self.workers = workers
        self.sessions = sessions
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="census")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def count(self) -> None:
        """Count once now and set the gauges (StoreError when etcd cannot answer)."""
        workers = await self.workers.live()
        sessions = await self.sessions.count()
        for role, name in _ROLES.items():
            metrics.LIVE_WORKERS.labels(name).set(sum(1 for w in workers if w.role == role))
        metrics.LIVE_SESSIONS.set(sessions)

    async def _run(self) -> None:
        while True:
            try:
                await self.count()
            except StoreError as exc:
                log.debug("census: %s", exc)
            await asyncio.sleep(self.interval_s)
