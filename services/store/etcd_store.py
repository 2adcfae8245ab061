"""The etcd store of kvshuttle: one connection (etcd_connection) and one store per kind of record, under one name.

Used by the registry (workers, sessions, claims, responses, leases) and by the scheduler when it reads and claims in
etcd itself (through :class:`~kvshuttle.services.store.interface.ClaimStore`) and shares its learning. The schema has
one owner each: the key layout is :mod:`kvshuttle.services.store.keys` (the connection's ``keys``), the values
:mod:`kvshuttle.services.store.codec`.

``EtcdStore`` is the connection with its parts, each holding one kind of record; callers use the part they need
(``store.workers.put(worker)``, ``store.sessions.get(tenant, session_id)``, ``store.claims.claim(...)``,
``store.leases.grant(ttl_s)``, ``store.elections.campaign(...)``), or are handed just that part:

- ``workers`` (etcd_workers.WorkerStore): the registered workers and their watch;
- ``sessions`` (etcd_sessions.SessionStore): session records and their indexes (by decode worker, by text);
- ``claims`` (etcd_claims.HandleClaims): claims of records' KV handles, and what each decode worker still holds;
- ``responses`` (etcd_responses.ResponseStore): the gateway's stored responses;
- ``leases`` and ``elections`` (etcd_leases): leases, and the leaders campaigned for on them;
- ``outcomes`` (etcd_outcomes.OutcomeLog) and ``snapshots`` (etcd_snapshots.LearnedSnapshots): shared learning.

Every part goes through the one connection (its channel, retries and ``on_op``). Errors surface as
``StoreUnavailable`` (etcd unreachable, no leader, timeout) or ``StoreError``; each operation is reported to ``on_op``
(name, seconds, error kind).
"""

from __future__ import annotations

from collections.abc import Sequence

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

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
