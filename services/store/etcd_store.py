"""The etcd store of kvshuttle: the only module that talks to etcd (through etcd3aio), so the client can be swapped.

Used by the registry (workers, sessions, leases) and by the scheduler when it reads and claims in etcd itself
(through :class:`~kvshuttle.services.store.interface.ClaimStore`). The schema has one owner each: the key layout is
:mod:`kvshuttle.services.store.keys`, the values :mod:`kvshuttle.services.store.codec`; this module holds the
connection, the retries and the transactions.

Session.revision and Session.lease_id in returned records are the key's mod_revision and lease. ``claim_session``
creates the claim key in one transaction comparing them; ``put_session`` deletes it with the record it replaces.
Errors surface as ``StoreUnavailable`` (etcd unreachable, no leader, timeout) or ``StoreError``. Each operation is
reported to ``on_op`` (name, seconds, error kind): the services pass their metrics' ``etcd_op``.

Pinned to etcd3aio 0.3.0: the watch stream and txn compares use its generated stubs (``etcd3aio._protobuf``) because
the library's own watch hides reconnects (we re-send a snapshot after each) and has no mod_revision compare helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError, prefix_range_end
from etcd3aio._protobuf import Compare, WatchCreateRequest, WatchRequest, WatchStub
from etcd3aio.connections import ConnectionManager
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from kvshuttle.control_plane.lru import BoundedLru
from kvshuttle.control_plane.session import CHANGED, claim_refusal, handle_digest
from kvshuttle.services.common.tls import EtcdSecurity
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_channel import EtcdAuthError, etcd_channel, grpc_target, resolved_endpoints
from kvshuttle.services.store.interface import (
    ClaimResult,
    HandleReader,
    OpObserver,
    StoreError,
    StoreUnavailable,
    no_op,
)
from kvshuttle.services.store.keys import Keys, first_segment, session_ref
from kvshuttle.v1 import common_pb2, registry_pb2

__all__ = ["ClaimResult", "EtcdStore", "StoreError", "StoreUnavailable", "WorkerEvent", "parse_endpoints"]

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


@dataclass(frozen=True)
class WorkerEvent:
    """``kind`` is ``snapshot`` (all live workers), ``put`` or ``delete`` (the removed record, or just its id)."""

    kind: str
    workers: tuple[common_pb2.Worker, ...]


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list -> ``["h1:p1", "h2:p2"]`` (an ``http://`` scheme is dropped)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip().removeprefix("http://") for e in items if e.strip()]
    if not out:
        raise ValueError("no etcd endpoints given")
    return out



def claim_txn(keys: Keys, tenant: str, session_id: str, revision: int, lease_id: int, decode_worker_id: str,
              free_reason: str = "") -> tuple[list, list, list]:
    """(compare, success, failure) of the claim of ``session_id``'s record at ``revision`` (on ``lease_id``,
    its handle on ``decode_worker_id``): the record unchanged and unclaimed, then the claim key and the worker's claim
    note on the record's lease and the record read back; else the record and its claim read."""
    key = keys.session(tenant, session_id)
    claim_key = keys.claim_of(key)
    return ([_mod_revision_is(key, revision), _lease_is(key, lease_id), _absent(claim_key)],
            [KVService.txn_op_put(claim_key, codec.claim_value(revision, free_reason), lease=lease_id),
             KVService.txn_op_get(key),
             *([KVService.txn_op_put(keys.worker_claim(decode_worker_id, tenant, session_id),
                                     codec.worker_claim_value(revision), lease=lease_id)]
               if decode_worker_id else [])],
            [KVService.txn_op_get(key, range_end=keys.session_range_end(key))])

class EtcdStore:
    """Workers, sessions and leases in etcd. ``connect()`` first (no I/O: channels connect lazily)."""

    def __init__(self, endpoints: str | Sequence[str], prefix: str = "/kvshuttle/", *, timeout_s: float = 5.0,
                 attempt_timeout_s: float = 2.0, recent_sessions_bytes: int = 64 << 20,
                 security: EtcdSecurity | None = None, on_op: OpObserver = no_op,
                 handles: HandleReader | None = None):
        """``security``: TLS towards etcd and/or its user/password auth (None: plaintext, no auth). ``on_op`` is told
        of each operation: its name, its seconds (retries included) and "" / "unavailable" / "error". ``handles``:
        where the records' out-of-record KV handles are read (None: such a record reads as having no handle)."""
        self.handles = handles
        self.endpoints = parse_endpoints(endpoints)
        self.security = security
        self.keys = Keys.under(prefix)
        self.prefix = self.keys.prefix
        self.on_op = on_op
        self.timeout_s = timeout_s
        self.attempt_timeout_s = min(attempt_timeout_s, timeout_s)
        self._channel: grpc.aio.Channel | None = None
        self._kv: KVService | None = None
        self._lease: LeaseService | None = None
        self._watch: WatchStub | None = None
        self._recent = _RecentSessions(recent_sessions_bytes)
        self._leases: dict[str, int] = {}  # campaign name -> this process's lease for it
        # Set when an operation failed for its whole timeout; cleared by any answer from etcd (see _call).
        self.unreachable_since: float | None = None

    # -- connection ------------------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the channel; with etcd auth, authenticate now so wrong credentials fail here (StoreError)."""
        manager = ConnectionManager(self.endpoints)
        manager.grpc_options.extend(_CHANNEL_OPTIONS)
        try:  # etcd3aio's own target takes IP addresses only; a chart's etcd is a Service name
            target = grpc_target(await resolved_endpoints(self.endpoints))
        except OSError as exc:
            raise StoreUnavailable(f"cannot resolve the etcd endpoints {', '.join(self.endpoints)}: {exc}") from None
        self._channel, auth = etcd_channel(target, manager.grpc_options, self.security,
                                           self.endpoints[0].rsplit(":", 1)[0])
        if auth is not None:
            try:
                await auth.authenticate()
            except EtcdAuthError as exc:
                await self.close()
                raise StoreError(str(exc)) from None
            except grpc.aio.AioRpcError as exc:  # etcd not up yet: the first call authenticates
                log.warning("etcd authentication deferred: %s (%s)", exc.code().name, exc.details())
        self._kv = KVService(self._channel, max_attempts=1)
        self._lease = LeaseService(self._channel, max_attempts=1)
        self._watch = WatchStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, op: str, fn, *args, **kwargs):
        """:meth:`_attempts`, timed and reported to ``on_op`` (the metrics: kvshuttle_etcd_*, by ``op``)."""
        started, error = time.perf_counter(), ""
        try:
            return await self._attempts(op, fn, *args, **kwargs)
        except StoreError as exc:
            error = "unavailable" if isinstance(exc, StoreUnavailable) else "error"
            raise
        finally:
            self.on_op(op, time.perf_counter() - started, error)

    async def _attempts(self, op: str, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` (an etcd3aio call) with a short per-attempt deadline, retrying transient
        failures until ``timeout_s``; map failures to StoreUnavailable / StoreError.

        Short attempts matter when the leader dies: a member holds a proposal until etcd's own request timeout
        (~6 s) while the survivors elect a new leader in ~1 s, and a fresh attempt then succeeds at once. The channel
        balances over every endpoint and skips members it cannot reach, so a retry lands on a live member.
        Once an operation has failed for its whole ``timeout_s`` (etcd down), later ones make a single attempt
        (at most ``attempt_timeout_s``) until etcd answers again: callers learn of the outage at once instead of
        each waiting ``timeout_s``.
        """
        delay = 0.05
        last = "timed out"
        since = self.unreachable_since
        probing = since is not None
        try:
            async with asyncio.timeout(self.attempt_timeout_s if probing else self.timeout_s):
                while True:
                    try:
                        result = await fn(*args, timeout=self.attempt_timeout_s, max_attempts=1, **kwargs)
                        self._answered()
                        return result
                    except (EtcdConnectionError, EtcdTransientError, TimeoutError) as exc:
                        last = str(exc) or "attempt timed out"
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                            self._answered()
                            raise StoreError(f"etcd {op}: {exc.code().name} ({exc.details()})") from None
                        last = f"{exc.code().name} ({exc.details()})"
                    except EtcdError as exc:
                        self._answered()
                        raise StoreError(f"etcd {op}: {exc}") from None
                    if probing:
                        break
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
        except TimeoutError:
            pass
        if not probing and self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
            log.warning("etcd unreachable (%s: %s); failing fast until it answers again", op, last)
        if probing:
            raise StoreUnavailable(f"etcd {op} failed: etcd unreachable for {time.monotonic() - since:.0f}s ({last})")
        raise StoreUnavailable(f"etcd {op} failed for {self.timeout_s:g}s: {last}")

    def _answered(self) -> None:
        if self.unreachable_since is not None:
            log.warning("etcd answers again after %.1fs", time.monotonic() - self.unreachable_since)
            self.unreachable_since = None

    @property
    def kv(self) -> KVService:
        if self._kv is None:
            raise RuntimeError("EtcdStore is not connected")
        return self._kv

    @property
    def lease(self) -> LeaseService:
        if self._lease is None:
            raise RuntimeError("EtcdStore is not connected")
        return self._lease

    async def ping(self) -> None:
        """Raises StoreUnavailable unless etcd answers a linearizable read."""
        await self._call("ping", self.kv.get, self.keys.ping)

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
        return self.keys.worker(worker_id)

    async def put_worker(self, worker: common_pb2.Worker) -> None:
        """Store ``worker`` attached to ``worker.lease_id``. StoreError when that lease does not exist."""
        await self._call("put worker", self.kv.put, self.keys.worker(worker.worker_id), codec.worker_value(worker),
                         lease=worker.lease_id)

    async def get_worker(self, worker_id: str) -> common_pb2.Worker | None:
        resp = await self._call("get worker", self.kv.get, self.keys.worker(worker_id))
        return codec.parse_worker(resp.kvs[0].value) if resp.kvs else None

    async def list_workers(self) -> list[common_pb2.Worker]:
        return (await self._list_workers_at())[0]

    async def _list_workers_at(self) -> tuple[list[common_pb2.Worker], int]:
        resp = await self._call("list workers", self.kv.get, self.keys.workers, prefix_range_end(self.keys.workers))
        workers = [w for w in (codec.parse_worker(kv.value) for kv in resp.kvs) if w is not None]
        return sorted(workers, key=lambda w: w.worker_id), resp.header.revision

    async def delete_worker(self, worker_id: str) -> bool:
        resp = await self._call("delete worker", self.kv.delete, self.keys.worker(worker_id))
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
        async with contextlib.aclosing(self._watch_events(self.keys.workers, revision, prev_kv=True)) as events:
            async for ev in events:
                if ev.type == _EVENT_PUT:
                    worker = codec.parse_worker(ev.kv.value)
                    if worker is not None:
                        yield WorkerEvent("put", (worker,))
                else:
                    worker = codec.parse_worker(ev.prev_kv.value) if ev.HasField("prev_kv") else None
                    if worker is None:
                        worker = common_pb2.Worker(worker_id=self.keys.worker_id_of(ev.kv.key.decode()))
                    yield WorkerEvent("delete", (worker,))

    async def _watch_events(self, prefix: str, revision: int, *, prev_kv: bool = False) -> AsyncIterator[Any]:
        """Every event under ``prefix`` from ``revision`` on, until the stream ends; raises _WatchLost when etcd
        cancels the watch (e.g. compacted past ``revision``), grpc.aio.AioRpcError when the stream fails."""
        if self._watch is None:
            raise RuntimeError("EtcdStore is not connected")
        create = WatchCreateRequest(key=prefix.encode(), range_end=prefix_range_end(prefix), start_revision=revision,
                                    prev_kv=prev_kv)

        async def requests() -> AsyncIterator[WatchRequest]:
            yield WatchRequest(create_request=create)
            await asyncio.Event().wait()  # keep the request side open

        call = self._watch.Watch(requests(), metadata=_REQUIRE_LEADER)
        try:
            async for resp in call:
                if resp.canceled or resp.compact_revision:
                    raise _WatchLost(f"watch canceled by etcd ({resp.cancel_reason or 'compacted'})")
                for ev in resp.events:
                    yield ev
        finally:
            call.cancel()

    # -- sessions --------------------------------------------------------------------------------------------

    def session_key(self, tenant: str, session_id: str) -> str:
        return self.keys.session(tenant, session_id)

    def claim_key(self, tenant: str, session_id: str) -> str:
        return self.keys.claim(tenant, session_id)

    async def get_session(self, tenant: str, session_id: str, *,
                          with_handle: bool = True) -> common_pb2.Session | None:
        """The record with ``revision`` = its mod_revision and ``lease_id`` = its lease, or None. A claimed record
        comes with ``claimed`` set and its handle cleared. One range read returns the record and its claim; an
        out-of-record handle is read too unless ``with_handle`` is False."""
        key = self.keys.session(tenant, session_id)
        resp = await self._call("get session", self.kv.get, key, self.keys.session_range_end(key))
        session = codec.session_from(resp.kvs, key)
        if session is not None and not session.claimed and with_handle:
            await self._with_handle(session)
            self._recent.put(key, session)
        return session

    async def _with_handle(self, session: common_pb2.Session, known: common_pb2.Session | None = None) -> None:
        """Fill in an out-of-record handle (from ``known``, the caller's copy, when its digest matches; else from
        the history store). One that cannot be read leaves the record without a handle: it is not pulled."""
        if not session.handle_digest or session.kv_transfer_params_json:
            return
        if known is not None and known.kv_transfer_params_json and known.handle_digest == session.handle_digest \
                and handle_digest(known.kv_transfer_params_json) == session.handle_digest:
            session.kv_transfer_params_json = known.kv_transfer_params_json
            return
        if self.handles is None:
            log.warning("a session record keeps its KV handle in the history store, which this process was not "
                        "given (--history-store): it cannot be pulled")
            return
        started, error = time.perf_counter(), ""
        try:
            value = await self.handles.read_handle(session.tenant, session.session_id, session.history_generation,
                                                   session.handle_digest)
        except Exception as exc:  # noqa: BLE001 - any backend failure: no pull, the turn recomputes
            value, error = None, "unavailable"
            log.warning("could not read a session's KV handle from the history store: %s", exc)
        finally:
            self.on_op("read handle", time.perf_counter() - started, error)
        if value is not None and handle_digest(value.decode()) == session.handle_digest:
            session.kv_transfer_params_json = value.decode()

    async def put_session(self, session: common_pb2.Session, lease_id: int, *,
                          expect_revision: int, replaced_lease: int = 0) -> common_pb2.Session | None:
        """Write ``session`` under ``lease_id`` if the key's mod_revision is still ``expect_revision`` (0: absent).

        The same transaction deletes the claim of the record it replaces, so a claim only ever stands for the record
        it was made on. Returns the stored record (with its new revision and lease), or None when the record changed
        meanwhile. ``replaced_lease``, the lease of the record at ``expect_revision`` (the caller read it), is then
        revoked (best effort) since nothing else hangs on it; the put does not ask etcd for the old value back.
        """
        key = self.keys.session(session.tenant, session.session_id)
        record, value = codec.stored_record(session)
        record.kv_transfer_params_json = session.kv_transfer_params_json  # the caller's answer has the handle
        index = ([KVService.txn_op_put(self.keys.worker_session(record.decode_worker_id, session.tenant,
                                                                session.session_id), codec.summary(record),
                                       lease=lease_id)]
                 if record.decode_worker_id else [])
        # FindSession's index: the record's whole text and its boundaries (at most 1 + MAX_TEXT_BOUNDARIES keys); the
        # replaced record's entries go with its lease (revoked below)
        for content in dict.fromkeys([record.text_key, *(b.key for b in record.text_boundaries)]):
            if content:
                index.append(KVService.txn_op_put(self.keys.content(session.tenant, content),
                                                  codec.content_value(session.session_id), lease=lease_id))
        resp = await self._call("put session", self.kv.txn,
                                [_mod_revision_is(key, expect_revision)],
                                [KVService.txn_op_put(key, value, lease=lease_id),
                                 KVService.txn_op_delete(self.keys.claim_of(key)), *index],
                                [KVService.txn_op_get(key)])
        record.lease_id = lease_id
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if kvs and kvs[0].value == value and kvs[0].lease == lease_id:  # a retried attempt had committed
                record.revision = kvs[0].mod_revision
                return record
            return None
        if replaced_lease and replaced_lease != lease_id:
            await self._revoke_quietly(replaced_lease)
        record.revision = resp.header.revision
        self._recent.put(key, record)
        return record

    async def find_session(self, tenant: str, text_keys: Sequence[bytes]) -> tuple[int, common_pb2.Session] | None:
        """The record indexed under the first of ``text_keys`` that names a live record of ``tenant`` (whose own
        text_key, or one of whose text_boundaries, is still that key), and that key's position; None when none does.
        One transaction reads every index entry, then one read gets the record."""
        if not text_keys:
            return None
        resp = await self._call("find session", self.kv.txn, [], [
            KVService.txn_op_get(self.keys.content(tenant, key)) for key in text_keys], [])
        for i, (key, answer) in enumerate(zip(text_keys, resp.responses, strict=True)):
            kvs = answer.response_range.kvs
            if not kvs:
                continue
            session = await self.get_session(tenant, codec.content_session_id(kvs[0].value))
            if session is not None and (session.text_key == key or any(b.key == key for b in session.text_boundaries)):
                return i, session
        return None

    # -- stored responses (the gateway's Responses API) ---------------------------------------------------------

    async def put_response(self, response: registry_pb2.StoredResponse, ttl_s: int) -> registry_pb2.StoredResponse:
        """Store ``response`` under a new lease of ``ttl_s`` (replacing one with the same id, whose lease is revoked).
        Returns it with ``expires_at`` set."""
        lease_id, granted = await self.grant_lease(ttl_s)
        stored = registry_pb2.StoredResponse()
        stored.CopyFrom(response)
        stored.expires_at.FromSeconds(int(time.time()) + granted)
        key = self.keys.response(response.tenant, response.response_id)
        try:
            resp = await self._call("put response", self.kv.put, key, codec.response_value(stored), lease=lease_id,
                                    prev_kv=True)
        except BaseException:
            await self._revoke_quietly(lease_id)
            raise
        if resp.HasField("prev_kv") and resp.prev_kv.lease and resp.prev_kv.lease != lease_id:
            await self._revoke_quietly(resp.prev_kv.lease)
        return stored

    async def get_response(self, tenant: str, response_id: str) -> registry_pb2.StoredResponse | None:
        resp = await self._call("get response", self.kv.get, self.keys.response(tenant, response_id))
        return codec.parse_response(resp.kvs[0].value) if resp.kvs else None

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """Delete it and revoke its lease; False when there was none."""
        resp = await self._call("delete response", self.kv.delete, self.keys.response(tenant, response_id),
                                prev_kv=True)
        for lease in {kv.lease for kv in resp.prev_kvs} - {0}:
            await self._revoke_quietly(lease)
        return bool(resp.prev_kvs)

    def content_key(self, tenant: str, text_key: bytes) -> str:
        return self.keys.content(tenant, text_key)

    def worker_session_key(self, worker_id: str, tenant: str, session_id: str) -> str:
        return self.keys.worker_session(worker_id, tenant, session_id)

    def worker_claim_key(self, worker_id: str, tenant: str, session_id: str) -> str:
        return self.keys.worker_claim(worker_id, tenant, session_id)

    async def held_on_worker(self, worker_id: str) -> list[common_pb2.Session]:
        """Summaries (no ids, text or handle; ``revision`` set) of the records whose unspent handle's KV lives on
        ``worker_id``: the worker-sessions index less the claimed revisions, read in one transaction."""
        index, claims = self.keys.worker_sessions_of(worker_id), self.keys.worker_claims_of(worker_id)
        resp = await self._call("list held kv", self.kv.txn, [], [
            KVService.txn_op_get(index, range_end=prefix_range_end(index)),
            KVService.txn_op_get(claims, range_end=prefix_range_end(claims))], [])
        claimed = {kv.key.decode()[len(claims):]: kv.value for kv in resp.responses[1].response_range.kvs}
        held = []
        for kv in resp.responses[0].response_range.kvs:
            name = kv.key.decode()[len(index):]
            tenant, session_id = session_ref(name)
            if not session_id or claimed.get(name) == codec.worker_claim_value(kv.mod_revision):
                continue
            summary = codec.parse_session(kv.value, kv.mod_revision)
            if summary is None or summary.covered_tokens <= 0:  # an older, empty index entry: no summary to go by
                continue
            summary.tenant, summary.session_id, summary.decode_worker_id = tenant, session_id, worker_id
            summary.lease_id = kv.lease
            held.append(summary)
        return held

    async def campaign(self, name: str, holder: str, ttl_s: int) -> bool:
        """Whether ``holder`` leads ``name`` (key ``leaders/{name}``, on a lease of ``ttl_s`` that each call keeps
        alive): it takes the key when nobody holds it, and loses it when its lease ends (a call missed for ``ttl_s``,
        or etcd away). One leader at a time among the replicas that campaign for the same name."""
        key = self.keys.leader(name)
        lease = self._leases.get(name)
        if lease is not None and await self.keep_alive_once(lease) is None:
            self._leases.pop(name, None)
            lease = None
        if lease is None:
            lease, _ = await self.grant_lease(ttl_s)
            self._leases[name] = lease
        resp = await self._call("campaign", self.kv.txn, [_absent(key)],
                                [KVService.txn_op_put(key, codec.leader_value(holder), lease=lease)],
                                [KVService.txn_op_get(key)])
        if resp.succeeded:
            return True
        kvs = resp.responses[0].response_range.kvs
        return bool(kvs) and kvs[0].value == codec.leader_value(holder) and kvs[0].lease == lease

    # -- shared learning (services/scheduler/shared_learning.py) ---------------------------------------------

    async def put_outcome_batch(self, replica: str, seq: int, batch: bytes, lease_id: int) -> int:
        """Append one replica's batch of reported outcomes; returns the revision it was written at."""
        resp = await self._call("put outcomes", self.kv.put, self.keys.outcome_batch(replica, seq), batch,
                                lease=lease_id)
        return resp.header.revision

    async def outcome_batches(self, after_revision: int, page: int = 512) -> tuple[list[tuple[int, bytes]], int]:
        """The outcome batches still kept (their leases live) that were written after ``after_revision``, oldest
        first as (revision, value), and the revision the read saw (a watch continues from the next one)."""
        start, end = self.keys.outcome_batches, prefix_range_end(self.keys.outcome_batches)
        found: list[tuple[int, bytes]] = []
        at = 0
        while True:
            resp = await self._call("read outcomes", self.kv.get, start, end, revision=at, limit=page)
            at = at or resp.header.revision  # every page at the first page's revision: one consistent view
            found.extend((kv.mod_revision, kv.value) for kv in resp.kvs if kv.mod_revision > after_revision)
            if not resp.more or not resp.kvs:
                break
            start = resp.kvs[-1].key + b"\0"
        found.sort(key=lambda item: item[0])
        return found, at

    async def watch_outcome_batches(self, from_revision: int) -> AsyncIterator[tuple[int, bytes]]:
        """Each outcome batch written from ``from_revision`` on, as (revision, value), in revision order. Raises
        StoreUnavailable when the stream breaks or etcd cancels it (compacted past ``from_revision``): the caller
        reads :meth:`outcome_batches` again and watches on from there."""
        try:
            async with contextlib.aclosing(self._watch_events(self.keys.outcome_batches, from_revision)) as events:
                async for ev in events:
                    if ev.type == _EVENT_PUT:  # deletes are leases ending: nothing to learn
                        yield ev.kv.mod_revision, ev.kv.value
        except _WatchLost as exc:
            raise StoreUnavailable(f"outcome watch: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            raise StoreUnavailable(f"outcome watch: {exc.code().name} ({exc.details()})") from None
        raise StoreUnavailable("outcome watch ended")

    async def put_learned_snapshot(self, manifest: dict, blob: bytes, chunk_bytes: int = 1 << 20) -> None:
        """Store a snapshot of the learned state: ``blob`` in chunks under a new id, then the manifest naming them
        (``manifest`` plus id, chunks, bytes, sha256) in one put, then the previous snapshot's chunks go. A reader
        sees the old snapshot or the new one, whole."""
        snapshot_id = f"{manifest.get('revision', 0):016x}-{os.urandom(4).hex()}"
        chunks = [blob[i:i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)] or [b""]
        prefix = self.keys.learned_snapshot_chunks(snapshot_id)
        for i, chunk in enumerate(chunks):
            await self._call("put snapshot", self.kv.put, f"{prefix}{i:06d}", chunk)
        previous = await self._call("get snapshot", self.kv.get, self.keys.learned_snapshot)
        full = {**manifest, "id": snapshot_id, "chunks": len(chunks), "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest()}
        await self._call("put snapshot", self.kv.put, self.keys.learned_snapshot, json.dumps(full).encode())
        old_ids = {snapshot_id}
        if previous.kvs:
            with contextlib.suppress(ValueError, AttributeError):
                old_ids.add(json.loads(previous.kvs[0].value).get("id", snapshot_id))
        for old in old_ids - {snapshot_id}:
            old_prefix = self.keys.learned_snapshot_chunks(str(old))
            await self._call("delete snapshot", self.kv.delete, old_prefix, prefix_range_end(old_prefix))

    async def get_learned_snapshot(self) -> tuple[dict, bytes] | None:
        """The latest snapshot's manifest and blob (checked against its sha256), or None when there is none.
        Raises StoreError when it is unreadable (chunks missing or corrupt)."""
        resp = await self._call("get snapshot", self.kv.get, self.keys.learned_snapshot)
        if not resp.kvs:
            return None
        try:
            manifest = json.loads(resp.kvs[0].value)
            prefix = self.keys.learned_snapshot_chunks(str(manifest["id"]))
            count, digest = int(manifest["chunks"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"learned snapshot manifest unreadable: {exc}") from None
        parts = []
        for i in range(count):  # one chunk per read: a whole snapshot may exceed a gRPC message
            chunk = await self._call("get snapshot", self.kv.get, f"{prefix}{i:06d}", revision=resp.header.revision)
            if not chunk.kvs:
                break
            parts.append(chunk.kvs[0].value)
        blob = b"".join(parts)
        if len(parts) != count or hashlib.sha256(blob).hexdigest() != digest:
            raise StoreError(f"learned snapshot {manifest['id']} is incomplete or corrupt")
        return manifest, blob

    async def sessions_on_worker(self, worker_id: str) -> list[tuple[str, str]]:
        """(tenant, session id) of the records whose KV lives on ``worker_id`` (keys only: no record is read)."""
        prefix = self.keys.worker_sessions_of(worker_id)
        resp = await self._call("list worker sessions", self.kv.get, prefix, prefix_range_end(prefix),
                                keys_only=True)
        found = []
        for kv in resp.kvs:
            tenant, session_id = session_ref(kv.key.decode()[len(prefix):])
            if session_id:
                found.append((tenant, session_id))
        return found

    async def count_sessions(self) -> int:
        """How many session records there are, from the worker-sessions index (a serializable count: no keys are
        returned; an index entry outlives its record only when revoking a replaced record's lease failed)."""
        prefix = self.keys.worker_sessions
        resp = await self._call("count sessions", self.kv.get, prefix, prefix_range_end(prefix), serializable=True,
                                count_only=True)
        return resp.count

    async def indexed_workers(self) -> set[str]:
        """Worker ids that the worker-sessions index names (keys only)."""
        prefix = self.keys.worker_sessions
        resp = await self._call("list indexed workers", self.kv.get, prefix, prefix_range_end(prefix),
                                keys_only=True)
        return {first_segment(kv.key.decode()[len(prefix):]) for kv in resp.kvs}

    async def drop_sessions_on_worker(self, worker_id: str) -> int:
        """Delete every record whose KV lives on ``worker_id`` (it is gone: the worker's lease ended), by revoking
        the records' leases. A record written meanwhile for another worker is kept. Returns how many were dropped."""
        dropped = 0
        for tenant, session_id in await self.sessions_on_worker(worker_id):
            record = await self.get_session(tenant, session_id)
            if record is None or record.decode_worker_id != worker_id or not record.lease_id:
                continue
            self._recent.discard(self.keys.session(tenant, session_id))
            if await self.revoke_lease(record.lease_id):
                dropped += 1
        return dropped

    async def delete_session(self, tenant: str, session_id: str) -> bool:
        """Delete the record (and its claim) and revoke its lease; False when there was none."""
        key = self.keys.session(tenant, session_id)
        self._recent.discard(key)
        resp = await self._call("delete session", self.kv.delete, key, self.keys.session_range_end(key), prev_kv=True)
        for lease in {kv.lease for kv in resp.prev_kvs} - {0}:
            await self._revoke_quietly(lease)
        return any(kv.key == key.encode() for kv in resp.prev_kvs)

    async def claim_session(self, tenant: str, session_id: str, revision: int, *, now: float,
                            known: common_pb2.Session | None = None, free_reason: str = "") -> ClaimResult:
        """Take the handle of the record at ``revision``: one transaction that creates the record's claim key.

        The transaction compares the record's mod_revision (and lease) and that no claim exists, puts a small claim
        key under the record's lease (so it ends with the record), and reads the record back: the result carries the
        record as stored at ``revision`` (claimed, with its handle), never the caller's copy. The record itself is
        not rewritten. ``known`` is the caller's copy of the record at ``revision`` (a snapshot, possibly stale or
        wrong): its lease and expiry save a read; the transaction checks the lease. Refusals (missing, already
        claimed, changed, no handle, expired) carry a reason and the current record without its handle.
        ``free_reason`` claims the handle to free its KV (the scheduler's KV manager): later reads of the record
        show it as ``kv_freed``. The claim is also noted under the decode worker (``worker-claims/``), so what a
        worker still holds reads without the records.
        """
        key = self.keys.session(tenant, session_id)
        # The record at ``revision`` is immutable: its lease and expiry, from the caller or from this process's own
        # recent reads and writes, need no read. The transaction compares revision and lease, so a wrong or
        # outdated hint costs a refusal or one more round trip, never a second claim.
        hint = known if known is not None and known.revision == revision and known.lease_id else None
        hint = hint or self._recent.get(key, revision)
        if hint is None or claim_refusal(hint, revision, now) is not None:
            hint = await self.get_session(tenant, session_id)
            reason = claim_refusal(hint, revision, now)
            if reason is not None:
                return ClaimResult(False, reason, codec.handle_cleared(hint))
        for attempt in range(2):
            try:
                resp = await self._call("claim session", self.kv.txn,
                                        *claim_txn(self.keys, tenant, session_id, revision, hint.lease_id,
                                                   hint.decode_worker_id, free_reason))
            except StoreUnavailable:
                raise
            except StoreError as exc:
                if "lease not found" in str(exc):  # the lease ended as the transaction ran
                    return ClaimResult(False, "expired (lease ended)", None)
                raise
            if resp.succeeded:
                self._recent.discard(key)
                won = codec.session_from(resp.responses[1].response_range.kvs, key)
                if won is not None:
                    await self._with_handle(won, known)
                # The real record (the hint may have been wrong about its handle or expiry); the claim stands
                # either way, and a handle that cannot be used has nothing to pull.
                reason = claim_refusal(won, revision, now)
                if reason is not None:
                    return ClaimResult(False, reason, codec.handle_cleared(won))
                won.claimed, won.kv_freed = True, free_reason
                return ClaimResult(True, "", won)
            # Also when an earlier attempt of ours committed but its answer was lost (etcd failover): then the
            # handle goes unused and the next turn recomputes, which is safe; two pulls of one handle are not.
            current = codec.session_from(resp.responses[0].response_range.kvs, key)
            reason = claim_refusal(current, revision, now)
            if reason is None and current.lease_id != hint.lease_id and attempt == 0:
                hint = current  # only the hint's lease was wrong: once more with the record's own
                continue
            return ClaimResult(False, reason or f"{CHANGED}: revision {revision} is gone",
                               codec.handle_cleared(current))
        raise AssertionError("unreachable")


class _WatchLost(Exception):
    pass


class _RecentSessions:
    """What a claim needs to know of the session records this process wrote or read lately (revision, lease,
    handle, expiry; not the history), one revision per session; bounded in bytes (LRU).

    Only ever a hint for a record at a given revision (immutable in etcd), never an answer to "what is current".
    """

    def __init__(self, max_bytes: int):
        self._lru: BoundedLru[common_pb2.Session] = BoundedLru(max_bytes)

    def put(self, key: str, session: common_pb2.Session) -> None:
        hint = common_pb2.Session(revision=session.revision, lease_id=session.lease_id,
                                  kv_transfer_params_json=session.kv_transfer_params_json,
                                  decode_worker_id=session.decode_worker_id)
        hint.expires_at.CopyFrom(session.expires_at)
        self._lru.put(key, hint, len(key) + len(hint.kv_transfer_params_json) + 64)

    def get(self, key: str, revision: int) -> common_pb2.Session | None:
        hint = self._lru.get(key)
        return hint if hint is not None and hint.revision == revision else None

    def discard(self, key: str) -> None:
        self._lru.discard(key)


def _mod_revision_is(key: str, revision: int) -> Compare:
    # etcd compares an absent key as mod_revision 0.
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=key.encode(), mod_revision=revision)


def _lease_is(key: str, lease_id: int) -> Compare:
    return Compare(result=Compare.EQUAL, target=Compare.LEASE, key=key.encode(), lease=lease_id)


def _absent(key: str) -> Compare:
    return Compare(result=Compare.EQUAL, target=Compare.CREATE, key=key.encode(), create_revision=0)
