"""Session records in etcd (``sessions/{tenant}/{id}``, each on its own lease) and their indexes: by decode worker
(``worker-sessions/``) and by text (FindSession's ``content/``).

Session.revision and Session.lease_id in returned records are the key's mod_revision and lease. ``put`` deletes the
claim of the record it replaces (claims: etcd_claims.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from etcd3aio import prefix_range_end
from etcd3aio.kv import KVService
from kvshuttle.control_plane.lru import BoundedLru
from kvshuttle.control_plane.session import handle_digest
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_connection import EtcdConnection, mod_revision_is
from kvshuttle.services.store.etcd_leases import Leases
from kvshuttle.services.store.interface import HandleReader
from kvshuttle.services.store.keys import first_segment, session_ref
from kvshuttle.v1 import common_pb2

log = logging.getLogger(__name__)


class RecentSessions:
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


class SessionStore:
    def __init__(self, conn: EtcdConnection, leases: Leases, *, recent_bytes: int = 64 << 20,
                 handles: HandleReader | None = None):
        """``handles``: where the records' out-of-record KV handles are read (None: such a record reads as having
        no handle)."""
        self._conn = conn
        self._keys = conn.keys
        self._leases = leases
        self.handles = handles
        self.recent = RecentSessions(recent_bytes)

    def key(self, tenant: str, session_id: str) -> str:
        return self._keys.session(tenant, session_id)

    async def get(self, tenant: str, session_id: str, *, with_handle: bool = True) -> common_pb2.Session | None:
        """The record with ``revision`` = its mod_revision and ``lease_id`` = its lease, or None. A claimed record
        comes with ``claimed`` set and its handle cleared. One range read returns the record and its claim; an
        out-of-record handle is read too unless ``with_handle`` is False."""
        key = self._keys.session(tenant, session_id)
        resp = await self._conn.call("get session", self._conn.kv.get, key, self._keys.session_range_end(key))
        session = codec.session_from(resp.kvs, key)
        if session is not None and not session.claimed and with_handle:
            await self.with_handle(session)
            self.recent.put(key, session)
        return session

    async def with_handle(self, session: common_pb2.Session, known: common_pb2.Session | None = None) -> None:
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
            self._conn.on_op("read handle", time.perf_counter() - started, error)
        if value is not None and handle_digest(value.decode()) == session.handle_digest:
            session.kv_transfer_params_json = value.decode()

    async def put(self, session: common_pb2.Session, lease_id: int, *,
                  expect_revision: int, replaced_lease: int = 0) -> common_pb2.Session | None:
        """Write ``session`` under ``lease_id`` if the key's mod_revision is still ``expect_revision`` (0: absent).

        The same transaction deletes the claim of the record it replaces, so a claim only ever stands for the record
        it was made on. Returns the stored record (with its new revision and lease), or None when the record changed
        meanwhile. ``replaced_lease``, the lease of the record at ``expect_revision`` (the caller read it), is then
        revoked (best effort) since nothing else hangs on it; the put does not ask etcd for the old value back.
        """
        keys = self._keys
        key = keys.session(session.tenant, session.session_id)
        record, value = codec.stored_record(session)
        record.kv_transfer_params_json = session.kv_transfer_params_json  # the caller's answer has the handle
        index = ([KVService.txn_op_put(keys.worker_session(record.decode_worker_id, session.tenant,
                                                           session.session_id), codec.summary(record),
                                       lease=lease_id)]
                 if record.decode_worker_id else [])
        # FindSession's index: the record's whole text and its boundaries (at most 1 + MAX_TEXT_BOUNDARIES keys); the
        # replaced record's entries go with its lease (revoked below)
        for content in dict.fromkeys([record.text_key, *(b.key for b in record.text_boundaries)]):
            if content:
                index.append(KVService.txn_op_put(keys.content(session.tenant, content, record.model),
                                                  codec.content_value(session.session_id), lease=lease_id))
        resp = await self._conn.call("put session", self._conn.kv.txn,
                                     [mod_revision_is(key, expect_revision)],
                                     [KVService.txn_op_put(key, value, lease=lease_id),
                                      KVService.txn_op_delete(keys.claim_of(key)), *index],
                                     [KVService.txn_op_get(key)])
        record.lease_id = lease_id
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if kvs and kvs[0].value == value and kvs[0].lease == lease_id:  # a retried attempt had committed
                record.revision = kvs[0].mod_revision
                return record
            return None
        if replaced_lease and replaced_lease != lease_id:
            await self._leases.revoke_quietly(replaced_lease)
        record.revision = resp.header.revision
        self.recent.put(key, record)
        return record

    async def find(self, tenant: str, text_keys: Sequence[bytes],
                   model: str = "") -> tuple[int, common_pb2.Session] | None:
        """The record of ``model`` indexed under the first of ``text_keys`` that names a live record of ``tenant``
        and ``model`` (whose own text_key, or one of whose text_boundaries, is still that key), and that key's
        position; None when none does. One transaction reads every index entry, then one read gets the record."""
        if not text_keys:
            return None
        resp = await self._conn.call("find session", self._conn.kv.txn, [], [
            KVService.txn_op_get(self._keys.content(tenant, key, model)) for key in text_keys], [])
        for i, (key, answer) in enumerate(zip(text_keys, resp.responses, strict=True)):
            kvs = answer.response_range.kvs
            if not kvs:
                continue
            session = await self.get(tenant, codec.content_session_id(kvs[0].value))
            if session is not None and session.model == model and (
                    session.text_key == key or any(b.key == key for b in session.text_boundaries)):
                return i, session
        return None

    async def delete(self, tenant: str, session_id: str) -> bool:
        """Delete the record (and its claim) and revoke its lease; False when there was none."""
        key = self._keys.session(tenant, session_id)
        self.recent.discard(key)
        resp = await self._conn.call("delete session", self._conn.kv.delete, key, self._keys.session_range_end(key),
                                     prev_kv=True)
        for lease in {kv.lease for kv in resp.prev_kvs} - {0}:
            await self._leases.revoke_quietly(lease)
        return any(kv.key == key.encode() for kv in resp.prev_kvs)

    # -- the worker-sessions index ------------------------------------------------------------------------------

    async def on_worker(self, worker_id: str) -> list[tuple[str, str]]:
        """(tenant, session id) of the records whose KV lives on ``worker_id`` (keys only: no record is read)."""
        prefix = self._keys.worker_sessions_of(worker_id)
        resp = await self._conn.call("list worker sessions", self._conn.kv.get, prefix, prefix_range_end(prefix),
                                     keys_only=True)
        found = []
        for kv in resp.kvs:
            tenant, session_id = session_ref(kv.key.decode()[len(prefix):])
            if session_id:
                found.append((tenant, session_id))
        return found

    async def count(self) -> int:
        """How many session records there are, from the worker-sessions index (a serializable count: no keys are
        returned; an index entry outlives its record only when revoking a replaced record's lease failed)."""
        prefix = self._keys.worker_sessions
        resp = await self._conn.call("count sessions", self._conn.kv.get, prefix, prefix_range_end(prefix),
                                     serializable=True, count_only=True)
        return resp.count

    async def indexed_workers(self) -> set[str]:
        """Worker ids that the worker-sessions index names (keys only)."""
        prefix = self._keys.worker_sessions
        resp = await self._conn.call("list indexed workers", self._conn.kv.get, prefix, prefix_range_end(prefix),
                                     keys_only=True)
        return {first_segment(kv.key.decode()[len(prefix):]) for kv in resp.kvs}

    async def drop_on_worker(self, worker_id: str) -> int:
        """Delete every record whose KV lives on ``worker_id`` (it is gone: the worker's lease ended), by revoking
        the records' leases. A record written meanwhile for another worker is kept. Returns how many were dropped."""
        dropped = 0
        for tenant, session_id in await self.on_worker(worker_id):
            record = await self.get(tenant, session_id)
            if record is None or record.decode_worker_id != worker_id or not record.lease_id:
                continue
            self.recent.discard(self._keys.session(tenant, session_id))
            if await self._leases.revoke(record.lease_id):
                dropped += 1
        return dropped
