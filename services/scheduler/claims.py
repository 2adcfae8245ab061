"""How the scheduler reads a session record and claims its KV handle: through the registry, or in etcd directly.

``RegistryClaims`` calls the registry (``GetSession``, ``ClaimSession``): one more gRPC hop per call, but the
scheduler needs no access to etcd. ``EtcdClaims`` runs the very same store code the registry runs, through the
store's small ``ClaimStore`` interface (kvshuttle.services.store.interface; ``store.sessions.get`` /
``store.claims.claim``: one etcd transaction that creates the record's claim key only while the record is at the planned
revision and unclaimed, so a handle is claimed at most once whoever claims it) in the scheduler's own process, which
saves the hop and the registry's CPU on the planning path. The scheduler picks ``EtcdClaims`` when it is given etcd
endpoints.

Both answer alike: ``get_session`` gives the record (``revision`` = its mod_revision) and the seconds until its handle
expires, or None when there is none; ``claim`` gives a ``Claim`` (``known``, the caller's copy of the record at that
revision, may save the etcd claim a read: its lease is compared, its content never trusted); failures raise
``ClaimsError`` with the gRPC status the registry would have answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from kvshuttle.control_plane import session as session_rules
from kvshuttle.services.store.history import HistoryStore
from kvshuttle.services.store.interface import ClaimStore, StoreError, StoreUnavailable
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc


class ClaimsError(Exception):
    """A session read or claim that failed; ``code`` is the gRPC status (UNAVAILABLE when the store is down)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Claim:
    claimed: bool
    reason: str  # why not (starts with one of kvshuttle.control_plane.session's refusal reasons); "" when claimed
    # Claimed: the record with its handle. Refused: the current record without its handle, or None.
    session: common_pb2.Session | None


class SessionClaims(Protocol):
    """Where the scheduler reads session records and claims handles."""

    via: str  # "registry" or "etcd" (logs)

    async def get_session(self, tenant: str, session_id: str) -> tuple[common_pb2.Session, float] | None: ...

    async def claim(self, tenant: str, session_id: str, revision: int,
                    known: common_pb2.Session | None = None, free_reason: str = "") -> Claim: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class RegistryClaims:
    """Through the session registry's gRPC API."""

    via = "registry"

    def __init__(self, registry: registry_pb2_grpc.SessionRegistryStub, timeout_s: float):
        self._registry = registry
        self._timeout = timeout_s

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass  # the channel is the caller's

    async def get_session(self, tenant: str, session_id: str) -> tuple[common_pb2.Session, float] | None:
        try:
            resp = await self._registry.GetSession(
                registry_pb2.GetSessionRequest(session_id=session_id, tenant=tenant), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise ClaimsError(exc.code(), exc.details() or "") from None
        return resp.session, resp.expires_in_s

    async def claim(self, tenant: str, session_id: str, revision: int,
                    known: common_pb2.Session | None = None, free_reason: str = "") -> Claim:
        try:
            resp = await self._registry.ClaimSession(
                registry_pb2.ClaimSessionRequest(session_id=session_id, tenant=tenant, revision=revision,
                                                 free_reason=free_reason),
                timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise ClaimsError(exc.code(), exc.details() or "") from None
        return Claim(resp.claimed, resp.reason, resp.session if resp.HasField("session") else None)


class EtcdClaims:
    """In etcd, with the store the registry uses (same keys, same transaction, same refusal reasons)."""

    via = "etcd"

    def __init__(self, store: ClaimStore, clock: Callable[[], float] = time.time, history: HistoryStore | None = None):
        """``history``: the registry's history store, which ``store`` reads out-of-record handles from (opened and
        closed here)."""
        self._store = store
        self._clock = clock
        self._history = history

    @property
    def store(self) -> ClaimStore:
        """The etcd store (shared learning writes its outcome log there too)."""
        return self._store

    async def start(self) -> None:
        if self._history is not None:
            await self._history.connect()
        await self._store.connect()

    async def close(self) -> None:
        await self._store.close()
        if self._history is not None:
            await self._history.close()

    async def get_session(self, tenant: str, session_id: str) -> tuple[common_pb2.Session, float] | None:
        tenant = _checked(tenant, session_id)
        try:
            found = await self._store.sessions.get(tenant, session_id)
        except StoreError as exc:
            raise _status(exc) from None
        return None if found is None else (found, session_rules.expires_in(found, self._clock()))

    async def claim(self, tenant: str, session_id: str, revision: int,
                    known: common_pb2.Session | None = None, free_reason: str = "") -> Claim:
        tenant = _checked(tenant, session_id)
        if revision <= 0:
            raise ClaimsError(grpc.StatusCode.INVALID_ARGUMENT,
                              "revision is required: the record revision the caller planned with")
        try:
            session_rules.validate_free_reason(free_reason)
        except session_rules.InvalidArgument as exc:
            raise ClaimsError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        try:
            result = await self._store.claims.claim(tenant, session_id, revision, now=self._clock(), known=known,
                                                    free_reason=free_reason)
        except StoreError as exc:
            raise _status(exc) from None
        return Claim(result.claimed, result.reason, result.session)

    async def campaign(self, name: str, holder: str, ttl_s: int) -> bool:
        """Whether ``holder`` leads ``name`` among the replicas (the store's ``elections.campaign``)."""
        try:
            return await self._store.elections.campaign(name, holder, ttl_s)
        except StoreError as exc:
            raise _status(exc) from None

    async def held_on(self, worker_id: str) -> list[common_pb2.Session]:
        """Summaries of the records whose unspent handle's KV lives on ``worker_id`` (the store's
        ``claims.held_on_worker``)."""
        try:
            return await self._store.claims.held_on_worker(worker_id)
        except StoreError as exc:
            raise _status(exc) from None


def _checked(tenant: str, session_id: str) -> str:
    """The registry's checks on a session reference (ids become etcd key segments); returns the tenant."""
    tenant = tenant or session_rules.DEFAULT_TENANT
    try:
        session_rules.validate_id("session_id", session_id)
        session_rules.validate_id("tenant", tenant)
    except session_rules.InvalidArgument as exc:
        raise ClaimsError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return tenant


def _status(exc: StoreError) -> ClaimsError:
    if isinstance(exc, StoreUnavailable):
        return ClaimsError(grpc.StatusCode.UNAVAILABLE, f"session store unavailable: {exc}")
    return ClaimsError(grpc.StatusCode.INTERNAL, f"session store error: {exc}")
