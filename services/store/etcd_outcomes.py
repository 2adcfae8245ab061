"""The shared-learning outcome log in etcd (``learned/outcomes/{replica}/{seq}``: batches of reported outcomes, on
leases that end a few minutes later; see services/scheduler/learning.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import grpc.aio
from etcd3aio import prefix_range_end
from kvshuttle.services.store.etcd_connection import EVENT_PUT, EtcdConnection, WatchLost
from kvshuttle.services.store.interface import StoreUnavailable


class OutcomeLog:
    def __init__(self, conn: EtcdConnection):
        self._conn = conn
        self._keys = conn.keys

    async def put_batch(self, replica: str, seq: int, batch: bytes, lease_id: int) -> int:
        """Append one replica's batch of reported outcomes; returns the revision it was written at."""
        resp = await self._conn.call("put outcomes", self._conn.kv.put, self._keys.outcome_batch(replica, seq), batch,
                                     lease=lease_id)
        return resp.header.revision

    async def batches(self, after_revision: int, page: int = 512) -> tuple[list[tuple[int, bytes]], int]:
        """The outcome batches still kept (their leases live) that were written after ``after_revision``, oldest
        first as (revision, value), and the revision the read saw (a watch continues from the next one)."""
        start, end = self._keys.outcome_batches, prefix_range_end(self._keys.outcome_batches)
        found: list[tuple[int, bytes]] = []
        at = 0
        while True:
            resp = await self._conn.call("read outcomes", self._conn.kv.get, start, end, revision=at, limit=page)
            at = at or resp.header.revision  # every page at the first page's revision: one consistent view
            found.extend((kv.mod_revision, kv.value) for kv in resp.kvs if kv.mod_revision > after_revision)
            if not resp.more or not resp.kvs:
                break
            start = resp.kvs[-1].key + b"\0"
        found.sort(key=lambda item: item[0])
        return found, at

    async def watch(self, from_revision: int) -> AsyncIterator[tuple[int, bytes]]:
        """Each outcome batch written from ``from_revision`` on, as (revision, value), in revision order. Raises
        StoreUnavailable when the stream breaks or etcd cancels it (compacted past ``from_revision``): the caller
        reads :meth:`batches` again and watches on from there."""
        try:
            async with contextlib.aclosing(self._conn.watch_events(self._keys.outcome_batches,
                                                                   from_revision)) as events:
                async for ev in events:
                    if ev.type == EVENT_PUT:  # deletes are leases ending: nothing to learn
                        yield ev.kv.mod_revision, ev.kv.value
        except WatchLost as exc:
            raise StoreUnavailable(f"outcome watch: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            raise StoreUnavailable(f"outcome watch: {exc.code().name} ({exc.details()})") from None
        raise StoreUnavailable("outcome watch ended")
