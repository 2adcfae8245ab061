"""The registered workers in etcd (``workers/{id}``, each on its worker's lease), and the watch on them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
from etcd3aio import prefix_range_end
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_connection import EVENT_PUT, EtcdConnection, WatchLost
from kvshuttle.services.store.interface import StoreUnavailable
from kvshuttle.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEvent:
    """``kind`` is ``snapshot`` (all live workers), ``put`` or ``delete`` (the removed record, or just its id)."""

    kind: str
    workers: tuple[common_pb2.Worker, ...]


class WorkerStore:
    def __init__(self, conn: EtcdConnection):
        self._conn = conn
        self._keys = conn.keys

    def key(self, worker_id: str) -> str:
        return self._keys.worker(worker_id)

    async def put(self, worker: common_pb2.Worker) -> None:
        """Store ``worker`` attached to ``worker.lease_id``. StoreError when that lease does not exist."""
        await self._conn.call("put worker", self._conn.kv.put, self._keys.worker(worker.worker_id),
                              codec.worker_value(worker), lease=worker.lease_id)

    async def get(self, worker_id: str) -> common_pb2.Worker | None:
        resp = await self._conn.call("get worker", self._conn.kv.get, self._keys.worker(worker_id))
        return codec.parse_worker(resp.kvs[0].value) if resp.kvs else None

    async def live(self) -> list[common_pb2.Worker]:
        """The live workers, by id."""
        return (await self.live_at())[0]

    async def live_at(self) -> tuple[list[common_pb2.Worker], int]:
        """The live workers (by id) and the revision the read saw."""
        resp = await self._conn.call("list workers", self._conn.kv.get, self._keys.workers,
                                     prefix_range_end(self._keys.workers))
        workers = [w for w in (codec.parse_worker(kv.value) for kv in resp.kvs) if w is not None]
        return sorted(workers, key=lambda w: w.worker_id), resp.header.revision

    async def delete(self, worker_id: str) -> bool:
        resp = await self._conn.call("delete worker", self._conn.kv.delete, self._keys.worker(worker_id))
        return resp.deleted > 0

    async def watch(self, *, raise_first: bool = True) -> AsyncIterator[WorkerEvent]:
        """A snapshot of the live workers, then each change; after any stream error, backoff and a new snapshot.

        With ``raise_first`` the first snapshot's StoreUnavailable reaches the caller (so an RPC can fail fast);
        afterwards the iterator keeps retrying until it is closed.
        """
        backoff = 0.2
        first = True
        while True:
            try:
                workers, revision = await self.live_at()
            except StoreUnavailable as exc:
                if first and raise_first:
                    raise
                log.warning("worker watch: snapshot failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            first = False
            yield WorkerEvent("snapshot", tuple(workers))
            try:
                async with contextlib.aclosing(self._watch_from(revision + 1)) as stream:
                    async for event in stream:
                        backoff = 0.2
                        yield event
                log.warning("worker watch: stream ended; resyncing")
            except (grpc.aio.AioRpcError, WatchLost) as exc:
                detail = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("worker watch: %s; resyncing in %.1fs", detail, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _watch_from(self, revision: int) -> AsyncIterator[WorkerEvent]:
        async with contextlib.aclosing(self._conn.watch_events(self._keys.workers, revision, prev_kv=True)) as events:
            async for ev in events:
                if ev.type == EVENT_PUT:
                    worker = codec.parse_worker(ev.kv.value)
                    if worker is not None:
                        yield WorkerEvent("put", (worker,))
                else:
                    worker = codec.parse_worker(ev.prev_kv.value) if ev.HasField("prev_kv") else None
                    if worker is None:
                        worker = common_pb2.Worker(worker_id=self._keys.worker_id_of(ev.kv.key.decode()))
                    yield WorkerEvent("delete", (worker,))
