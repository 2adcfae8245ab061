"""The etcd store of kvshuttle: one connection (etcd_connection) and one store per kind of record, under one name.

Used by the registry (workers, sessions, responses, leases) and by the scheduler when it reads and claims in etcd
itself (through :class:`~kvshuttle.services.store.interface.ClaimStore`) and shares its learning. The schema has one
owner each: the key layout is :mod:`kvshuttle.services.store.keys`, the values :mod:`kvshuttle.services.store.codec`.

``EtcdStore`` is the connection with its parts, each holding one kind of record:

- ``workers`` (etcd_workers.WorkerStore): the registered workers and their watch;
- ``sessions`` (etcd_sessions.SessionStore): session records and their indexes (by decode worker, by text);
- ``claims`` (etcd_claims.HandleClaims): claims of records' KV handles, and what each decode worker still holds;
- ``responses`` (etcd_responses.ResponseStore): the gateway's stored responses;
- ``leases`` and ``elections`` (etcd_leases): leases, and the leaders campaigned for on them;
- ``outcomes`` (etcd_outcomes.OutcomeLog) and ``snapshots`` (etcd_snapshots.LearnedSnapshots): shared learning.

Its methods (``put_worker``, ``get_session``, ``claim_session``, ...) are those parts' under the names the services
have always called; new code may use a part directly. Errors surface as ``StoreUnavailable`` (etcd unreachable, no
leader, timeout) or ``StoreError``; each operation is reported to ``on_op`` (name, seconds, error kind).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from kvshuttle.services.common.tls import EtcdSecurity
from kvshuttle.services.store.etcd_claims import HandleClaims, claim_txn
from kvshuttle.services.store.etcd_connection import EtcdConnection, parse_endpoints
from kvshuttle.services.store.etcd_leases import LeaderElections, Leases
from kvshuttle.services.store.etcd_outcomes import OutcomeLog
from kvshuttle.services.store.etcd_responses import ResponseStore
from kvshuttle.services.store.etcd_sessions import SessionStore
from kvshuttle.services.store.etcd_snapshots import LearnedSnapshots
from kvshuttle.services.store.etcd_workers import WorkerEvent, WorkerStore
from kvshuttle.services.store.interface import (
    ClaimResult,
    HandleReader,
    OpObserver,
    StoreError,
    StoreUnavailable,
    no_op,
)
from kvshuttle.v1 import common_pb2, registry_pb2

__all__ = ["ClaimResult", "EtcdStore", "StoreError", "StoreUnavailable", "WorkerEvent", "claim_txn",
           "parse_endpoints"]


class EtcdStore(EtcdConnection):
    """Workers, sessions, claims, responses, leases, leaders and shared learning in etcd. ``connect()`` first (no
    I/O: channels connect lazily)."""

    def __init__(self, endpoints: str | Sequence[str], prefix: str = "/kvshuttle/", *, timeout_s: float = 5.0,
                 attempt_timeout_s: float = 2.0, recent_sessions_bytes: int = 64 << 20,
                 security: EtcdSecurity | None = None, on_op: OpObserver = no_op,
                 handles: HandleReader | None = None):
        """``security``: TLS towards etcd and/or its user/password auth (None: plaintext, no auth). ``on_op`` is told
        of each operation: its name, its seconds (retries included) and "" / "unavailable" / "error". ``handles``:
        where the records' out-of-record KV handles are read (None: such a record reads as having no handle)."""
        super().__init__(endpoints, prefix, timeout_s=timeout_s, attempt_timeout_s=attempt_timeout_s,
                         security=security, on_op=on_op)
        self.leases = Leases(self)
        self.elections = LeaderElections(self, self.leases)
        self.workers = WorkerStore(self)
        self.sessions = SessionStore(self, self.leases, recent_bytes=recent_sessions_bytes, handles=handles)
        self.claims = HandleClaims(self, self.sessions)
        self.responses = ResponseStore(self, self.leases)
        self.outcomes = OutcomeLog(self)
        self.snapshots = LearnedSnapshots(self)

    @property
    def handles(self) -> HandleReader | None:
        return self.sessions.handles

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- leases and leaders ----------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> tuple[int, int]:
        return await self.leases.grant(ttl_s)

    async def keep_alive_once(self, lease_id: int) -> int | None:
        return await self.leases.keep_alive_once(lease_id)

    async def revoke_lease(self, lease_id: int) -> bool:
        return await self.leases.revoke(lease_id)

    async def campaign(self, name: str, holder: str, ttl_s: int) -> bool:
        return await self.elections.campaign(name, holder, ttl_s)

    # -- workers ---------------------------------------------------------------------------------------------

    def worker_key(self, worker_id: str) -> str:
        return self.workers.key(worker_id)

    async def put_worker(self, worker: common_pb2.Worker) -> None:
        await self.workers.put(worker)

    async def get_worker(self, worker_id: str) -> common_pb2.Worker | None:
        return await self.workers.get(worker_id)

    async def list_workers(self) -> list[common_pb2.Worker]:
        return await self.workers.live()

    async def delete_worker(self, worker_id: str) -> bool:
        return await self.workers.delete(worker_id)

    def watch_workers(self, *, raise_first: bool = True) -> AsyncIterator[WorkerEvent]:
        return self.workers.watch(raise_first=raise_first)

    # -- sessions, their indexes and claims ------------------------------------------------------------------

    def session_key(self, tenant: str, session_id: str) -> str:
        return self.sessions.key(tenant, session_id)

    def claim_key(self, tenant: str, session_id: str) -> str:
        return self.claims.key(tenant, session_id)

    def content_key(self, tenant: str, text_key: bytes) -> str:
        return self.keys.content(tenant, text_key)

    def worker_session_key(self, worker_id: str, tenant: str, session_id: str) -> str:
        return self.keys.worker_session(worker_id, tenant, session_id)

    def worker_claim_key(self, worker_id: str, tenant: str, session_id: str) -> str:
        return self.claims.worker_key(worker_id, tenant, session_id)

    async def get_session(self, tenant: str, session_id: str, *,
                          with_handle: bool = True) -> common_pb2.Session | None:
        return await self.sessions.get(tenant, session_id, with_handle=with_handle)

    async def put_session(self, session: common_pb2.Session, lease_id: int, *,
                          expect_revision: int, replaced_lease: int = 0) -> common_pb2.Session | None:
        return await self.sessions.put(session, lease_id, expect_revision=expect_revision,
                                       replaced_lease=replaced_lease)

    async def find_session(self, tenant: str, text_keys: Sequence[bytes]) -> tuple[int, common_pb2.Session] | None:
        return await self.sessions.find(tenant, text_keys)

    async def delete_session(self, tenant: str, session_id: str) -> bool:
        return await self.sessions.delete(tenant, session_id)

    async def sessions_on_worker(self, worker_id: str) -> list[tuple[str, str]]:
        return await self.sessions.on_worker(worker_id)

    async def count_sessions(self) -> int:
        return await self.sessions.count()

    async def indexed_workers(self) -> set[str]:
        return await self.sessions.indexed_workers()

    async def drop_sessions_on_worker(self, worker_id: str) -> int:
        return await self.sessions.drop_on_worker(worker_id)

    async def claim_session(self, tenant: str, session_id: str, revision: int, *, now: float,
                            known: common_pb2.Session | None = None, free_reason: str = "") -> ClaimResult:
        return await self.claims.claim(tenant, session_id, revision, now=now, known=known, free_reason=free_reason)

    async def held_on_worker(self, worker_id: str) -> list[common_pb2.Session]:
        return await self.claims.held_on_worker(worker_id)

    # -- stored responses (the gateway's Responses API) ------------------------------------------------------

    async def put_response(self, response: registry_pb2.StoredResponse, lease_id: int,
                           ttl_s: int) -> registry_pb2.StoredResponse:
        return await self.responses.put(response, lease_id, ttl_s)

    async def get_response(self, tenant: str, response_id: str) -> tuple[registry_pb2.StoredResponse, int] | None:
        return await self.responses.get(tenant, response_id)

    async def delete_response(self, tenant: str, response_id: str) -> registry_pb2.StoredResponse | None:
        return await self.responses.delete(tenant, response_id)

    # -- shared learning (services/scheduler/learning.py) ----------------------------------------------------

    async def put_outcome_batch(self, replica: str, seq: int, batch: bytes, lease_id: int) -> int:
        return await self.outcomes.put_batch(replica, seq, batch, lease_id)

    async def outcome_batches(self, after_revision: int, page: int = 512) -> tuple[list[tuple[int, bytes]], int]:
        return await self.outcomes.batches(after_revision, page)

    def watch_outcome_batches(self, from_revision: int) -> AsyncIterator[tuple[int, bytes]]:
        return self.outcomes.watch(from_revision)

    async def put_learned_snapshot(self, manifest: dict, blob: bytes, chunk_bytes: int = 1 << 20) -> None:
        await self.snapshots.put(manifest, blob, chunk_bytes)

    async def get_learned_snapshot(self) -> tuple[dict, bytes] | None:
        return await self.snapshots.get()
