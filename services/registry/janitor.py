"""Drops the session records of decode workers that are gone.

A decode worker's KV dies with it. Once its lease ends (it deregistered, or stopped renewing: crashed, partitioned),
its sessions' handles can never be pulled again; the janitor deletes those records so nothing plans with them and
their next turns start clean. It follows the registry's worker watch: each delete event, and each worker that the
index names but a snapshot (start-up, or a resync after etcd was away) no longer lists, is looked at again after
``grace_s``: a worker that has registered again by then with the same engine (the same vLLM process, e.g. its lease
was lost while etcd was unreachable) keeps its sessions, since its KV is still there; otherwise they are dropped.
Several registry replicas may run it at once: dropping is idempotent. (Correctness never depends on it: the
scheduler pulls only from a registered worker whose engine id matches the handle's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvshuttle.services.common import metrics
from kvshuttle.services.store.etcd_sessions import SessionStore
from kvshuttle.services.store.etcd_workers import WorkerStore
from kvshuttle.services.store.interface import StoreError

log = logging.getLogger(__name__)


class SessionJanitor:
    def __init__(self, workers: WorkerStore, sessions: SessionStore, grace_s: float = 10.0):
        """``workers`` and ``sessions``: the registry store's parts (``EtcdStore.workers``, ``EtcdStore.sessions``)."""
        self.workers = workers
        self.sessions = sessions
        self.grace_s = grace_s
        self.dropped = 0  # records dropped since start (tests, logs)
        self._task: asyncio.Task | None = None
        self._checks: dict[str, asyncio.Task] = {}  # worker id -> its pending look after the grace

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="session-janitor")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._checks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task, self._checks = None, {}

    async def _run(self) -> None:
        async with contextlib.aclosing(self.workers.watch(raise_first=False)) as events:
            async for event in events:
                try:
                    if event.kind == "delete":
                        for worker in event.workers:
                            self._check_later(worker.worker_id, worker.engine_id)
                    elif event.kind == "snapshot":
                        live = {w.worker_id for w in event.workers}
                        for worker_id in sorted(set(await self.sessions.indexed_workers()) - live):
                            self._check_later(worker_id, "")
                except StoreError as exc:  # etcd away: the next snapshot (after the watch resyncs) catches up
                    log.warning("could not drop the sessions of departed workers: %s", exc)

    def _check_later(self, worker_id: str, engine_id: str) -> None:
        if worker_id not in self._checks:
            task = asyncio.create_task(self._check(worker_id, engine_id), name=f"janitor-{worker_id}")
            self._checks[worker_id] = task
            task.add_done_callback(lambda _: self._checks.pop(worker_id, None))

    async def _check(self, worker_id: str, engine_id: str) -> None:
        """After the grace: drop the worker's sessions unless it is registered again with the same engine (any
        engine when ``engine_id`` is unknown: the scheduler then checks each handle's engine itself)."""
        await asyncio.sleep(self.grace_s)
        try:
            current = await self.workers.get(worker_id)
            if current is not None and (not engine_id or current.engine_id == engine_id):
                log.info("worker %s is registered again with its engine: its sessions stay", worker_id)
                return
            await self._drop(worker_id)
        except StoreError as exc:
            log.warning("could not drop the sessions of departed worker %s: %s", worker_id, exc)

    async def _drop(self, worker_id: str) -> None:
        n = await self.sessions.drop_on_worker(worker_id)
        if n:
            self.dropped += n
            metrics.SESSIONS_DROPPED.inc(n)
            log.info("worker %s is gone: dropped %d session record(s) whose KV it held", worker_id, n)
