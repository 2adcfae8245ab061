"""The registry's etcd store: the only module that talks to etcd (through etcd3aio), so the client can be swapped.

Key layout under ``prefix`` (default ``/kvshuttle/``)::

    workers/{worker_id}             Worker proto, attached to the worker's lease (Worker.lease_id)
    sessions/{tenant}/{session_id}  Session proto, attached to its own lease (TTL = seconds until expiry + grace)

Session.revision in returned records is the key's mod_revision; ``claim_session`` compares it in one transaction.
Errors surface as ``StoreUnavailable`` (etcd unreachable, no leader, timeout) or ``StoreError``.

Pinned to etcd3aio 0.3.0: the watch stream and txn compares use its generated stubs (``etcd3aio._protobuf``) because
the library's own watch hides reconnects (we re-send a snapshot after each) and has no mod_revision compare helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError, prefix_range_end
from etcd3aio._protobuf import Compare, WatchCreateRequest, WatchRequest, WatchStub
from etcd3aio.connections import ConnectionManager
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from google.protobuf.message import DecodeError
from kvshuttle.v1 import common_pb2

from control_plane.lru import BoundedLru
from control_plane.session import claim_refusal, claimed_record

log = logging.getLogger(__name__)

# Reconnect quickly to a member that comes back (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# etcd fails a watch instead of hanging when its member has no leader (clientv3.WithRequireLeader).
_REQUIRE_LEADER = (("hasleader", "true"),)
_EVENT_PUT = 0


class StoreError(Exception):
    """etcd answered with an error that is not about reachability."""


class StoreUnavailable(StoreError):
    """etcd is unreachable, has no leader, or did not answer in time."""


@dataclass(frozen=True)
class WorkerEvent:
    """``kind`` is ``snapshot`` (all live workers), ``put`` or ``delete`` (the removed record, or just its id)."""

    kind: str
    workers: tuple[common_pb2.Worker, ...]


@dataclass(frozen=True)
class ClaimResult:
    claimed: bool
    reason: str
    # Claimed: the record with its handle (revision = the claim's). Refused: the current record without handle.
    session: common_pb2.Session | None


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list -> ``["h1:p1", "h2:p2"]`` (an ``http://`` scheme is dropped)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip().removeprefix("http://") for e in items if e.strip()]
    if not out:
        raise ValueError("no etcd endpoints given")
    return out


class RegistryStore:
    """Workers, sessions and leases in etcd. ``connect()`` first (no I/O: channels connect lazily)."""

    def __init__(self, endpoints: str | Sequence[str], prefix: str = "/kvshuttle/", *, timeout_s: float = 5.0,
                 attempt_timeout_s: float = 2.0, recent_sessions_bytes: int = 64 << 20):
        self.endpoints = parse_endpoints(endpoints)
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.timeout_s = timeout_s
        self.attempt_timeout_s = min(attempt_timeout_s, timeout_s)
        self._channel: grpc.aio.Channel | None = None
        self._kv: KVService | None = None
        self._lease: LeaseService | None = None
        self._watch: WatchStub | None = None
        self._recent = _RecentSessions(recent_sessions_bytes)

    # -- connection ------------------------------------------------------------------------------------------

    async def connect(self) -> None:
        manager = ConnectionManager(self.endpoints)
        manager.grpc_options.extend(_CHANNEL_OPTIONS)
        self._channel = manager.get_channel()
        self._kv = KVService(self._channel, max_attempts=1)
        self._lease = LeaseService(self._channel, max_attempts=1)
        self._watch = WatchStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> RegistryStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, op: str, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` (an etcd3aio call) with a short per-attempt deadline, retrying transient
        failures until ``timeout_s``; map failures to StoreUnavailable / StoreError.

        Short attempts matter when the leader dies: a member holds a proposal until etcd's own request timeout
        (~6 s) while the survivors elect a new leader in ~1 s, and a fresh attempt then succeeds at once.
        """
        delay = 0.05
        last = "timed out"
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    try:
                        return await fn(*args, timeout=self.attempt_timeout_s, max_attempts=1, **kwargs)
                    except (EtcdConnectionError, EtcdTransientError, TimeoutError) as exc:
                        last = str(exc) or "attempt timed out"
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                            raise StoreError(f"etcd {op}: {exc.code().name} ({exc.details()})") from None
                        last = f"{exc.code().name} ({exc.details()})"
                    except EtcdError as exc:
                        raise StoreError(f"etcd {op}: {exc}") from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
        except TimeoutError:
            raise StoreUnavailable(f"etcd {op} failed for {self.timeout_s:g}s: {last}") from None

    @property
    def kv(self) -> KVService:
        if self._kv is None:
            raise RuntimeError("RegistryStore is not connected")
        return self._kv

    @property
    def lease(self) -> LeaseService:
        if self._lease is None:
            raise RuntimeError("RegistryStore is not connected")
        return self._lease

    async def ping(self) -> None:
        """Raises StoreUnavailable unless etcd answers a linearizable read."""
        await self._call("ping", self.kv.get, self.prefix + "ping")

    # -- leases ----------------------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; returns (lease id, TTL granted by etcd, which may round small TTLs up)."""
        resp = await self._call("lease grant", self.lease.grant, ttl_s)
        if resp.error:
            raise StoreError(f"etcd lease grant: {resp.error}")
        return resp.ID, resp.TTL

    async def keep_alive_once(self, lease_id: int) -> int | None:
        """Refresh ``lease_id`` once; its TTL, or None when the lease no longer exists."""
        return await self._call("lease keep-alive", self._keep_alive_attempt, lease_id)

    async def _keep_alive_attempt(self, lease_id: int, *, timeout: float, max_attempts: int) -> int | None:
        call = self.lease.keep_alive(lease_id)
        try:
            async with asyncio.timeout(timeout):
                async for resp in call:
                    return resp.TTL if resp.TTL > 0 else None
        finally:
            call.cancel()
        raise EtcdTransientError("keep-alive stream ended without an answer")

    async def revoke_lease(self, lease_id: int) -> bool:
        """Revoke ``lease_id`` (deleting its keys); False when it did not exist."""
        try:
            await self._call("lease revoke", self.lease.revoke, lease_id)
        except StoreUnavailable:
            raise
        except StoreError as exc:
            if "NOT_FOUND" in str(exc):
                return False
            raise
        return True

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self.revoke_lease(lease_id)
        except StoreError as exc:
            log.debug("could not revoke lease %x: %s", lease_id, exc)

    # -- workers ---------------------------------------------------------------------------------------------

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}workers/{worker_id}"

    @property
    def _workers_prefix(self) -> str:
        return f"{self.prefix}workers/"

    async def put_worker(self, worker: common_pb2.Worker) -> None:
        """Store ``worker`` attached to ``worker.lease_id``. StoreError when that lease does not exist."""
        await self._call("put worker", self.kv.put, self.worker_key(worker.worker_id), worker.SerializeToString(),
                         lease=worker.lease_id)

    async def get_worker(self, worker_id: str) -> common_pb2.Worker | None:
        resp = await self._call("get worker", self.kv.get, self.worker_key(worker_id))
        return _parse_worker(resp.kvs[0].value) if resp.kvs else None

    async def list_workers(self) -> list[common_pb2.Worker]:
        return (await self._list_workers_at())[0]

    async def _list_workers_at(self) -> tuple[list[common_pb2.Worker], int]:
        resp = await self._call("list workers", self.kv.get, self._workers_prefix,
                                prefix_range_end(self._workers_prefix))
        workers = [w for w in (_parse_worker(kv.value) for kv in resp.kvs) if w is not None]
        return sorted(workers, key=lambda w: w.worker_id), resp.header.revision

    async def delete_worker(self, worker_id: str) -> bool:
        resp = await self._call("delete worker", self.kv.delete, self.worker_key(worker_id))
        return resp.deleted > 0

    async def watch_workers(self, *, raise_first: bool = True) -> AsyncIterator[WorkerEvent]:
        """A snapshot of the live workers, then each change; after any stream error, backoff and a new snapshot.

        With ``raise_first`` the first snapshot's StoreUnavailable reaches the caller (so an RPC can fail fast);
        afterwards the iterator keeps retrying until it is closed.
        """
        backoff = 0.2
        first = True
        while True:
            try:
                workers, revision = await self._list_workers_at()
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
                async with contextlib.aclosing(self._watch_workers_from(revision + 1)) as stream:
                    async for event in stream:
                        backoff = 0.2
                        yield event
                log.warning("worker watch: stream ended; resyncing")
            except (grpc.aio.AioRpcError, _WatchLost) as exc:
                detail = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("worker watch: %s; resyncing in %.1fs", detail, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _watch_workers_from(self, revision: int) -> AsyncIterator[WorkerEvent]:
        if self._watch is None:
            raise RuntimeError("RegistryStore is not connected")
        create = WatchCreateRequest(key=self._workers_prefix.encode(),
                                    range_end=prefix_range_end(self._workers_prefix),
                                    start_revision=revision, prev_kv=True)

        async def requests() -> AsyncIterator[WatchRequest]:
            yield WatchRequest(create_request=create)
            await asyncio.Event().wait()  # keep the request side open

        call = self._watch.Watch(requests(), metadata=_REQUIRE_LEADER)
        try:
            async for resp in call:
                if resp.canceled or resp.compact_revision:
                    raise _WatchLost(f"watch canceled by etcd ({resp.cancel_reason or 'compacted'})")
                for ev in resp.events:
                    if ev.type == _EVENT_PUT:
                        worker = _parse_worker(ev.kv.value)
                        if worker is not None:
                            yield WorkerEvent("put", (worker,))
                    else:
                        worker = _parse_worker(ev.prev_kv.value) if ev.HasField("prev_kv") else None
                        if worker is None:
                            worker = common_pb2.Worker(worker_id=ev.kv.key.decode()[len(self._workers_prefix):])
                        yield WorkerEvent("delete", (worker,))
        finally:
            call.cancel()

    # -- sessions --------------------------------------------------------------------------------------------

    def session_key(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}sessions/{tenant}/{session_id}"

    async def _get_session_kv(self, tenant: str, session_id: str) -> tuple[common_pb2.Session | None, int]:
        resp = await self._call("get session", self.kv.get, self.session_key(tenant, session_id))
        if not resp.kvs:
            return None, 0
        kv = resp.kvs[0]
        session = _parse_session(kv.value, kv.mod_revision)
        if session is not None:
            self._recent.put(self.session_key(tenant, session_id), session, kv.lease, len(kv.value))
        return session, kv.lease

    async def get_session(self, tenant: str, session_id: str) -> common_pb2.Session | None:
        """The record with ``revision`` = its mod_revision, or None."""
        return (await self._get_session_kv(tenant, session_id))[0]

    async def put_session(self, session: common_pb2.Session, lease_id: int, *,
                          expect_revision: int) -> common_pb2.Session | None:
        """Write ``session`` under ``lease_id`` if the key's mod_revision is still ``expect_revision`` (0: absent).

        Returns the stored record (with its new revision), or None when the record changed meanwhile. The lease of
        the replaced record is revoked (best effort) since nothing else hangs on it.
        """
        key = self.session_key(session.tenant, session.session_id)
        record = _without_revision(session)
        value = record.SerializeToString()
        resp = await self._call("put session", self.kv.txn,
                                [_mod_revision_is(key, expect_revision)],
                                [KVService.txn_op_put(key, value, lease=lease_id, prev_kv=True)],
                                [KVService.txn_op_get(key)])
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if kvs and kvs[0].value == value and kvs[0].lease == lease_id:  # a retried attempt had committed
                record.revision = kvs[0].mod_revision
                return record
            return None
        old_lease = resp.responses[0].response_put.prev_kv.lease
        if old_lease and old_lease != lease_id:
            await self._revoke_quietly(old_lease)
        record.revision = resp.header.revision
        self._recent.put(key, record, lease_id, len(value))
        return record

    async def delete_session(self, tenant: str, session_id: str) -> bool:
        """Delete the record and revoke its lease; False when there was none."""
        self._recent.discard(self.session_key(tenant, session_id))
        resp = await self._call("delete session", self.kv.delete, self.session_key(tenant, session_id),
                                prev_kv=True)
        for kv in resp.prev_kvs:
            if kv.lease:
                await self._revoke_quietly(kv.lease)
        return resp.deleted > 0

    async def claim_session(self, tenant: str, session_id: str, revision: int, *, now: float) -> ClaimResult:
        """Take the handle of the record at ``revision``: one transaction comparing the key's mod_revision.

        On success the stored record becomes claimed (handle cleared, same lease); the result carries the record
        with its handle. Refusals (missing, already claimed, changed, no handle, expired) carry a reason.
        """
        key = self.session_key(tenant, session_id)
        # The record at ``revision`` is immutable: when this process wrote or read it lately, skip the read. The
        # transaction below compares the revision, so a record changed since is still caught.
        current, lease_id = self._recent.get(key, revision) or await self._get_session_kv(tenant, session_id)
        reason = claim_refusal(current, revision, now)
        if reason is not None:
            return ClaimResult(False, reason, _handle_cleared(current))
        try:
            resp = await self._call("claim session", self.kv.txn,
                                    [_mod_revision_is(key, revision)],
                                    [KVService.txn_op_put(key, claimed_record(current, now).SerializeToString(),
                                                          lease=lease_id)],
                                    [KVService.txn_op_get(key)])
        except StoreUnavailable:
            raise
        except StoreError as exc:
            if "lease not found" in str(exc):  # the lease ended between our read and the transaction
                return ClaimResult(False, "expired (lease ended)", None)
            raise
        if not resp.succeeded:
            # Also when an earlier attempt of ours committed but its answer was lost (etcd failover): then the
            # handle goes unused and the next turn recomputes, which is safe; two pulls of one handle are not.
            kvs = resp.responses[0].response_range.kvs
            now_record = _parse_session(kvs[0].value, kvs[0].mod_revision) if kvs else None
            reason = claim_refusal(now_record, revision, now) or f"changed: revision {revision} is gone"
            return ClaimResult(False, reason, _handle_cleared(now_record))
        self._recent.discard(key)
        won = common_pb2.Session()
        won.CopyFrom(current)
        won.claimed = True
        won.revision = resp.header.revision
        return ClaimResult(True, "", won)


class _WatchLost(Exception):
    pass


class _RecentSessions:
    """Session records this process wrote or read lately, at one revision each; bounded in bytes (LRU).

    Only ever used for a record at a given revision (immutable in etcd), never to answer "what is current".
    """

    def __init__(self, max_bytes: int):
        self._lru: BoundedLru[tuple[common_pb2.Session, int]] = BoundedLru(max_bytes)

    def put(self, key: str, session: common_pb2.Session, lease_id: int, size: int) -> None:
        copy = common_pb2.Session()
        copy.CopyFrom(session)  # callers may change theirs
        self._lru.put(key, (copy, lease_id), size)

    def get(self, key: str, revision: int) -> tuple[common_pb2.Session, int] | None:
        item = self._lru.get(key)
        return item if item is not None and item[0].revision == revision else None

    def discard(self, key: str) -> None:
        self._lru.discard(key)


def _mod_revision_is(key: str, revision: int) -> Compare:
    # etcd compares an absent key as mod_revision 0.
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=key.encode(), mod_revision=revision)


def _parse_worker(value: bytes) -> common_pb2.Worker | None:
    try:
        return common_pb2.Worker.FromString(value)
    except DecodeError:
        log.warning("skipping a worker record that does not parse (%d bytes)", len(value))
        return None


def _parse_session(value: bytes, mod_revision: int) -> common_pb2.Session | None:
    try:
        session = common_pb2.Session.FromString(value)
    except DecodeError:
        log.warning("ignoring a session record that does not parse (%d bytes)", len(value))
        return None
    session.revision = mod_revision
    return session


def _without_revision(session: common_pb2.Session) -> common_pb2.Session:
    out = common_pb2.Session()
    out.CopyFrom(session)
    out.revision = 0
    return out


def _handle_cleared(session: common_pb2.Session | None) -> common_pb2.Session | None:
    if session is None:
        return None
    out = common_pb2.Session()
    out.CopyFrom(session)
    out.kv_transfer_params_json = ""
    return out
