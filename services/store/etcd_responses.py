"""Stored responses' index entries in etcd (the gateway's Responses API, ``responses/{tenant}/{id}``).

An entry is small (ids, tenant, session, the link to the previous response, its place in its conversation, times):
the body lives in the history store. The responses of one conversation share one lease (the registry keeps it
alive as the conversation grows); an entry written before chains has a lease of its own.
"""

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

    async def put(self, response: registry_pb2.StoredResponse, lease_id: int,
                  ttl_s: int) -> registry_pb2.StoredResponse:
        """Store ``response`` under ``lease_id`` (whose TTL is ``ttl_s``: ``expires_at`` is set from it). An entry it
        replaces (same id) that had a lease of its own (written before chains) has that lease revoked."""
        stored = registry_pb2.StoredResponse()
        stored.CopyFrom(response)
        stored.expires_at.FromSeconds(int(time.time()) + ttl_s)
        key = self._keys.response(response.tenant, response.response_id)
        resp = await self._conn.call("put response", self._conn.kv.put, key, codec.response_value(stored),
                                     lease=lease_id, prev_kv=True)
        if resp.HasField("prev_kv") and resp.prev_kv.lease and resp.prev_kv.lease != lease_id:
            replaced = codec.parse_response(resp.prev_kv.value)
            if replaced is None or replaced.chain_length == 0:
                await self._leases.revoke_quietly(resp.prev_kv.lease)
        return stored

    async def get(self, tenant: str, response_id: str) -> tuple[registry_pb2.StoredResponse, int] | None:
        """The entry and the id of its lease, or None."""
        resp = await self._conn.call("get response", self._conn.kv.get, self._keys.response(tenant, response_id))
        if not resp.kvs:
            return None
        found = codec.parse_response(resp.kvs[0].value)
        return None if found is None else (found, resp.kvs[0].lease)

    async def delete(self, tenant: str, response_id: str) -> registry_pb2.StoredResponse | None:
        """Delete the entry; the deleted entry, or None when there was none. The lease of an entry written before
        chains is revoked; a conversation's shared lease is left to the rest of the conversation."""
        resp = await self._conn.call("delete response", self._conn.kv.delete, self._keys.response(tenant, response_id),
                                     prev_kv=True)
        if not resp.prev_kvs:
            return None
        kv = resp.prev_kvs[0]
        gone = codec.parse_response(kv.value) or registry_pb2.StoredResponse(response_id=response_id, tenant=tenant)
        if kv.lease and gone.chain_length == 0:
            await self._leases.revoke_quietly(kv.lease)
        return gone
