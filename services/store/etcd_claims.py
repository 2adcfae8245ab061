"""Claims of session records' KV handles in etcd (``sessions/{tenant}/{id}!claim``, on the record's lease, noted
under the decode worker in ``worker-claims/``), and what each decode worker still holds unclaimed.

``claim`` creates the claim key in one transaction comparing the record's mod_revision and lease, so a handle is
claimed at most once whoever claims it (the registry, or a scheduler claiming in etcd itself).
"""

from __future__ import annotations

from etcd3aio import prefix_range_end
from etcd3aio.kv import KVService
from kvshuttle.control_plane.session import CHANGED, claim_refusal
from kvshuttle.services.store import codec
from kvshuttle.services.store.etcd_connection import EtcdConnection, absent, lease_is, mod_revision_is
from kvshuttle.services.store.etcd_sessions import SessionStore
from kvshuttle.services.store.interface import ClaimResult, StoreError, StoreUnavailable
from kvshuttle.services.store.keys import Keys, session_ref
from kvshuttle.v1 import common_pb2


def claim_txn(keys: Keys, tenant: str, session_id: str, revision: int, lease_id: int, decode_worker_id: str,
              free_reason: str = "") -> tuple[list, list, list]:
    """(compare, success, failure) of the claim of ``session_id``'s record at ``revision`` (on ``lease_id``,
    its handle on ``decode_worker_id``): the record unchanged and unclaimed, then the claim key and the worker's claim
    note on the record's lease and the record read back; else the record and its claim read."""
    key = keys.session(tenant, session_id)
    claim_key = keys.claim_of(key)
    return ([mod_revision_is(key, revision), lease_is(key, lease_id), absent(claim_key)],
            [KVService.txn_op_put(claim_key, codec.claim_value(revision, free_reason), lease=lease_id),
             KVService.txn_op_get(key),
             *([KVService.txn_op_put(keys.worker_claim(decode_worker_id, tenant, session_id),
                                     codec.worker_claim_value(revision), lease=lease_id)]
               if decode_worker_id else [])],
            [KVService.txn_op_get(key, range_end=keys.session_range_end(key))])


class HandleClaims:
    def __init__(self, conn: EtcdConnection, sessions: SessionStore):
        self._conn = conn
        self._keys = conn.keys
        self._sessions = sessions

    def key(self, tenant: str, session_id: str) -> str:
        return self._keys.claim(tenant, session_id)

    def worker_key(self, worker_id: str, tenant: str, session_id: str) -> str:
        return self._keys.worker_claim(worker_id, tenant, session_id)

    async def claim(self, tenant: str, session_id: str, revision: int, *, now: float,
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
        key = self._keys.session(tenant, session_id)
        # The record at ``revision`` is immutable: its lease and expiry, from the caller or from this process's own
        # recent reads and writes, need no read. The transaction compares revision and lease, so a wrong or
        # outdated hint costs a refusal or one more round trip, never a second claim.
        hint = known if known is not None and known.revision == revision and known.lease_id else None
        hint = hint or self._sessions.recent.get(key, revision)
        if hint is None or claim_refusal(hint, revision, now) is not None:
            hint = await self._sessions.get(tenant, session_id)
            reason = claim_refusal(hint, revision, now)
            if reason is not None:
                return ClaimResult(False, reason, codec.handle_cleared(hint))
        for attempt in range(2):
            try:
                resp = await self._conn.call("claim session", self._conn.kv.txn,
                                             *claim_txn(self._keys, tenant, session_id, revision, hint.lease_id,
                                                        hint.decode_worker_id, free_reason))
            except StoreUnavailable:
                raise
            except StoreError as exc:
                if "lease not found" in str(exc):  # the lease ended as the transaction ran
                    return ClaimResult(False, "expired (lease ended)", None)
                raise
            if resp.succeeded:
                self._sessions.recent.discard(key)
                won = codec.session_from(resp.responses[1].response_range.kvs, key)
                if won is not None:
                    await self._sessions.with_handle(won, known)
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

    async def held_on_worker(self, worker_id: str) -> list[common_pb2.Session]:
        """Summaries (no ids, text or handle; ``revision`` set) of the records whose unspent handle's KV lives on
        ``worker_id``: the worker-sessions index less the claimed revisions, read in one transaction."""
        index, claims = self._keys.worker_sessions_of(worker_id), self._keys.worker_claims_of(worker_id)
        resp = await self._conn.call("list held kv", self._conn.kv.txn, [], [
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
