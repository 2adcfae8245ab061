"""Leases in etcd, and the leaders campaigned for on them (``leaders/{name}``: one holder at a time)."""

from __future__ import annotations

import asyncio
import logging

from etcd3aio import EtcdTransientError
from etcd3aio.kv import KVService
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_connection import EtcdConnection, absent
from kvshuttle.services.store.interface import StoreError, StoreUnavailable

log = logging.getLogger(__name__)


class Leases:
    """Grant, keep alive and revoke etcd leases (workers', records' and responses' keys live on them)."""

    def __init__(self, conn: EtcdConnection):
        self._conn = conn

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; returns (lease id, TTL granted by etcd, which may round small TTLs up)."""
        resp = await self._conn.call("lease grant", self._conn.lease.grant, ttl_s)
        if resp.error:
            raise StoreError(f"etcd lease grant: {resp.error}")
        return resp.ID, resp.TTL

    async def keep_alive_once(self, lease_id: int) -> int | None:
        """Refresh ``lease_id`` once; its TTL, or None when the lease no longer exists."""
        return await self._conn.call("lease keep-alive", self._keep_alive_attempt, lease_id)

    async def _keep_alive_attempt(self, lease_id: int, *, timeout: float, max_attempts: int) -> int | None:
        call = self._conn.lease.keep_alive(lease_id)
        try:
            async with asyncio.timeout(timeout):
                async for resp in call:
                    return resp.TTL if resp.TTL > 0 else None
        finally:
            call.cancel()
        raise EtcdTransientError("keep-alive stream ended without an answer")

    async def revoke(self, lease_id: int) -> bool:
        """Revoke ``lease_id`` (deleting its keys); False when it did not exist."""
        try:
            await self._conn.call("lease revoke", self._conn.lease.revoke, lease_id)
        except StoreUnavailable:
            raise
        except StoreError as exc:
            if "NOT_FOUND" in str(exc):
                return False
            raise
        return True

    async def revoke_quietly(self, lease_id: int) -> None:
        """:meth:`revoke`, best effort (a failure is logged)."""
        try:
            await self.revoke(lease_id)
        except StoreError as exc:
            log.debug("could not revoke lease %x: %s", lease_id, exc)


class LeaderElections:
    """Which replica leads each name (the KV manager, shared learning's snapshots), on this process's leases."""

    def __init__(self, conn: EtcdConnection, leases: Leases):
        self._conn = conn
        self._leases = leases
        self._held: dict[str, int] = {}  # campaign name -> this process's lease for it

    async def campaign(self, name: str, holder: str, ttl_s: int) -> bool:
        """Whether ``holder`` leads ``name`` (key ``leaders/{name}``, on a lease of ``ttl_s`` that each call keeps
        alive): it takes the key when nobody holds it, and loses it when its lease ends (a call missed for ``ttl_s``,
        or etcd away). One leader at a time among the replicas that campaign for the same name."""
        key = self._conn.keys.leader(name)
        lease = self._held.get(name)
        if lease is not None and await self._leases.keep_alive_once(lease) is None:
            self._held.pop(name, None)
            lease = None
        if lease is None:
            lease, _ = await self._leases.grant(ttl_s)
            self._held[name] = lease
        resp = await self._conn.call("campaign", self._conn.kv.txn, [absent(key)],
                                     [KVService.txn_op_put(key, codec.leader_value(holder), lease=lease)],
                                     [KVService.txn_op_get(key)])
        if resp.succeeded:
            return True
        kvs = resp.responses[0].response_range.kvs
        return bool(kvs) and kvs[0].value == codec.leader_value(holder) and kvs[0].lease == lease
