"""Stored responses in etcd (the gateway's Responses API, ``responses/{tenant}/{id}``), each on its own lease."""

from __future__ import annotations

import time

from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_connection import EtcdConnection
from kvshuttle.services.store.etcd_leases import Leases
from kvshuttle.v1 import registry_pb2


class ResponseStore:
    def __init__(self, conn: EtcdConnection, leases: Leases):
        self._conn = conn
        self._keys = conn.keys
        self._leases = leases

    async def put(self, response: registry_pb2.StoredResponse, ttl_s: int) -> registry_pb2.StoredResponse:
        """Store ``response`` under a new lease of ``ttl_s`` (replacing one with the same id, whose lease is revoked).
        Returns it with ``expires_at`` set."""
        lease_id, granted = await self._leases.grant(ttl_s)
        stored = registry_pb2.StoredResponse()
        stored.CopyFrom(response)
        stored.expires_at.FromSeconds(int(time.time()) + granted)
        key = self._keys.response(response.tenant, response.response_id)
        try:
            resp = await self._conn.call("put response", self._conn.kv.put, key, codec.response_value(stored),
                                         lease=lease_id, prev_kv=True)
        except BaseException:
            await self._leases.revoke_quietly(lease_id)
            raise
        if resp.HasField("prev_kv") and resp.prev_kv.lease and resp.prev_kv.lease != lease_id:
            await self._leases.revoke_quietly(resp.prev_kv.lease)
        return stored

    async def get(self, tenant: str, response_id: str) -> registry_pb2.StoredResponse | None:
        resp = await self._conn.call("get response", self._conn.kv.get, self._keys.response(tenant, response_id))
        return codec.parse_response(resp.kvs[0].value) if resp.kvs else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete it and revoke its lease; False when there was none."""
        resp = await self._conn.call("delete response", self._conn.kv.delete, self._keys.response(tenant, response_id),
                                     prev_kv=True)
        for lease in {kv.lease for kv in resp.prev_kvs} - {0}:
            await self._leases.revoke_quietly(lease)
        return bool(resp.prev_kvs)
