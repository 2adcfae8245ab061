"""The history store in Redis: for clusters, where several registry replicas share it.

One hash per lineage, ``{prefix}history/{tenant}/{session_id}/{generation}``: field = the segment's start (decimal),
value = its ids (int32 little-endian). An append sets its field and the hash's TTL in one MULTI/EXEC, so the lineage
expires as a whole. Stored responses' bodies: one hash per conversation, ``{prefix}responses/{tenant}/{chain_id}``
(field = response id) and one of their links, ``{prefix}response-links/{tenant}/{chain_id}``, likewise. Each operation is bounded by ``timeout_s`` (the client's own retries included); failures raise
``HistoryUnavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import redis.asyncio as aioredis
from kvshuttle.services.store.history import HistoryGone, HistoryUnavailable, assemble
from kvshuttle.services.store.keys import DEFAULT_PREFIX, normalized_prefix
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

T = TypeVar("T")

# Copies the first ARGV[1] ids of lineage KEYS[1] into lineage KEYS[2], inside Redis (no ids cross the network), as
# history.truncated reads them: segments in offset order from 0, stale ones (starting inside the ids taken) skipped,
# the last one cut. Returns 1, or 0 (nothing written) when they do not cover the length.
_COPY_PREFIX = """
local need = tonumber(ARGV[1]) * 4
local fields = redis.call('HGETALL', KEYS[1])
local starts, by_start = {}, {}
for i = 1, #fields, 2 do
  local start = tonumber(fields[i])
  table.insert(starts, start)
  by_start[start] = fields[i + 1]
end
table.sort(starts)
local pos, out = 0, {}
for _, start in ipairs(starts) do
  if pos >= need then break end
  local begin = start * 4
  if begin > pos then return 0 end
  if begin == pos then
    local ids = by_start[start]
    if #ids > need - pos then ids = string.sub(ids, 1, need - pos) end
    table.insert(out, tostring(start))
    table.insert(out, ids)
    pos = pos + #ids
  end
end
if pos < need then return 0 end
for i = 1, #out, 2 do redis.call('HSET', KEYS[2], out[i], out[i + 1]) end
return 1
"""


class RedisHistoryStore:
    """:class:`~kvshuttle.services.store.history.HistoryStore` in the Redis at ``url`` (``redis://host:port/db``).
    ``connect()`` does no I/O: the pool connects on the first operation."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, *, timeout_s: float = 5.0):
        self.url = url
        self.prefix = normalized_prefix(prefix)
        self.timeout_s = timeout_s
        self._client: aioredis.Redis | None = None

    def key(self, tenant: str, session_id: str, generation: int) -> str:
        return f"{self.prefix}history/{tenant}/{session_id}/{generation}"

    def handles_key(self, tenant: str, session_id: str, generation: int) -> str:
        """The lineage's KV handles: a hash of digest -> handle, with the lineage's TTL."""
        return f"{self.prefix}handles/{tenant}/{session_id}/{generation}"

    def responses_key(self, tenant: str, chain_id: str) -> str:
        """A conversation's stored responses' bodies: a hash of response id -> body, expiring as a whole."""
        return f"{self.prefix}responses/{tenant}/{chain_id}"

    def response_links_key(self, tenant: str, chain_id: str) -> str:
        """A conversation's links: a hash of response id -> the id it continues ('' for the first), with the bodies'
        TTL."""
        return f"{self.prefix}response-links/{tenant}/{chain_id}"

    async def connect(self) -> None:
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self.url, decode_responses=False, socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> RedisHistoryStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("RedisHistoryStore is not connected")
        return self._client

    async def _call(self, op: str, aw: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await aw
        except TimeoutError:
            raise HistoryUnavailable(f"redis history {op}: no answer in {self.timeout_s:g}s") from None
        except RedisError as exc:  # ConnectionError, TimeoutError, and errors like OOM or READONLY
            raise HistoryUnavailable(f"redis history {op}: {type(exc).__name__}: {exc}") from exc

    # -- the interface ---------------------------------------------------------------------------------------

    async def append(self, tenant: str, session_id: str, generation: int, start: int, ids: bytes,
                     ttl_s: int, handle: tuple[bytes, bytes] | None = None, copy_from: int = 0) -> None:
        key = self.key(tenant, session_id, generation)
        if copy_from and start:
            copied = await self._call("copy", self.client.eval(
                _COPY_PREFIX, 2, self.key(tenant, session_id, copy_from), key, start))
            if not copied:
                raise HistoryGone(f"lineage {copy_from} no longer holds the {start} ids to continue")
        await self._call("append", self._append(key, self.handles_key(tenant, session_id, generation), start, ids,
                                                ttl_s, handle))

    async def _append(self, key: str, handles: str, start: int, ids: bytes, ttl_s: int,
                      handle: tuple[bytes, bytes] | None) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, str(start), ids)
            pipe.expire(key, ttl_s)
            if handle is not None:
                pipe.hset(handles, handle[0].hex(), handle[1])
            pipe.expire(handles, ttl_s)  # no-op when the lineage keeps no handle
            await pipe.execute()

    async def read_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> bytes | None:
        return await self._call("read handle", self.client.hget(self.handles_key(tenant, session_id, generation),
                                                                digest.hex()))

    async def drop_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> None:
        await self._call("drop handle", self.client.hdel(self.handles_key(tenant, session_id, generation),
                                                         digest.hex()))

    async def read(self, tenant: str, session_id: str, generation: int, length: int) -> bytes | None:
        fields = await self._call("read", self.client.hgetall(self.key(tenant, session_id, generation)))
        return assemble(((int(start), ids) for start, ids in fields.items()), length)

    async def drop(self, tenant: str, session_id: str, generation: int) -> None:
        await self._call("drop", self.client.delete(self.key(tenant, session_id, generation),
                                                    self.handles_key(tenant, session_id, generation)))

    # -- stored responses' bodies -----------------------------------------------------------------------------

    async def put_response_body(self, tenant: str, chain_id: str, response_id: str, body: bytes,
                                ttl_s: int, previous: str = "") -> None:
        await self._call("put response body", self._put_body(
            self.responses_key(tenant, chain_id), self.response_links_key(tenant, chain_id), response_id, body,
            ttl_s, previous))

    async def _put_body(self, key: str, links: str, response_id: str, body: bytes, ttl_s: int,
                        previous: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, response_id, body)
            pipe.hset(links, response_id, previous)
            pipe.expire(key, ttl_s)
            pipe.expire(links, ttl_s)
            await pipe.execute()

    async def read_response_links(self, tenant: str, chain_id: str) -> dict[str, str]:
        fields = await self._call("read response links",
                                  self.client.hgetall(self.response_links_key(tenant, chain_id)))
        return {rid.decode(): previous.decode() for rid, previous in fields.items()}

    async def read_response_bodies(self, tenant: str, chain_id: str,
                                   response_ids: Sequence[str]) -> dict[str, bytes]:
        ids = list(response_ids)
        if not ids:
            return {}
        values = await self._call("read response bodies",
                                  self.client.hmget(self.responses_key(tenant, chain_id), ids))
        return {rid: body for rid, body in zip(ids, values, strict=True) if body is not None}

    async def drop_response_body(self, tenant: str, chain_id: str, response_id: str) -> None:
        await self._call("drop response body", self._drop_body(tenant, chain_id, response_id))

    async def _drop_body(self, tenant: str, chain_id: str, response_id: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(self.responses_key(tenant, chain_id), response_id)
            pipe.hdel(self.response_links_key(tenant, chain_id), response_id)
            await pipe.execute()
