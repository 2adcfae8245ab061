"""A live, in-memory view of the registered workers, kept current by the registry's WatchWorkers stream."""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
from kvshuttle.control_plane import models
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)
Event = registry_pb2.WatchWorkersResponse


class WorkerView:
    """Workers by id. ``ready`` is set after the first snapshot; the watch reconnects with backoff."""

    def __init__(self, registry: registry_pb2_grpc.SessionRegistryStub):
        self._registry = registry
        self._workers: dict[str, common_pb2.Worker] = {}
        self._by_role: dict[tuple[int, str | None], list[common_pb2.Worker]] = {}  # built on use, cleared on change
        self.ready = asyncio.Event()
        self.version = 0  # counts the view's changes (what is built from it can be kept until it changes)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="worker-watch")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def all(self) -> list[common_pb2.Worker]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> common_pb2.Worker | None:
        return self._workers.get(worker_id)

    def by_role(self, role: int, model: str | None = None) -> list[common_pb2.Worker]:
        """The workers of ``role`` (``model``: serving that model only; None: any). Built once per change of the
        view, so a plan's cost does not grow with the workers of other roles and models; the list is shared: do not
        change it."""
        key = (role, model)
        found = self._by_role.get(key)
        if found is None:
            found = self._by_role[key] = [w for w in self._workers.values()
                                          if w.role == role and (model is None or models.serves(w, model))]
        return found

    async def wait_ready(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Replace the view with the registry's current list (when the watch may lag, e.g. just after start)."""
        resp = await self._registry.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=timeout_s)
        self.apply(Event(type=Event.EVENT_TYPE_SNAPSHOT, workers=resp.workers))

    def apply(self, event: Event) -> None:
        self._by_role = {}
        self.version += 1
        if event.type == Event.EVENT_TYPE_SNAPSHOT:
            self._workers = {w.worker_id: w for w in event.workers}
            self.ready.set()
        elif event.type == Event.EVENT_TYPE_PUT:
            for w in event.workers:
                self._workers[w.worker_id] = w
        elif event.type == Event.EVENT_TYPE_DELETE:
            for w in event.workers:
                self._workers.pop(w.worker_id, None)

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                async for event in self._registry.WatchWorkers(registry_pb2.WatchWorkersRequest()):
                    self.apply(event)
                    delay = 0.2
                log.warning("worker watch ended; reconnecting")
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("worker watch failed (%s: %s); retrying in %.1fs", exc.code().name, exc.details(), delay)
            await asyncio.sleep(delay * (1 + random.random() * 0.2))
            delay = min(delay * 2, 5.0)
