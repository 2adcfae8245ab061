"""What users of the session store see of it: its errors, a claim's result, and ``ClaimStore``, the small interface
the scheduler reads records and claims handles through: the store's ``sessions``, ``claims`` and ``elections`` parts
(``EtcdStore`` has them; the scheduler never needs the registry's service code or the rest of the store).
``LeaseGrants`` and ``Campaigns`` are also what the scheduler's shared learning uses of the leases and elections."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvshuttle.v1 import common_pb2

# Told of each etcd operation: its name (one of the store's fixed names), its seconds (retries included), and
# "" / "unavailable" / "error". The services pass kvshuttle.services.common.metrics.etcd_op.
OpObserver = Callable[[str, float, str], None]


def no_op(op: str, seconds: float, error: str) -> None:
    """The default observer: nothing."""


class HandleReader(Protocol):
    """Where records' out-of-record KV handles are read (Session.handle_digest): the history store."""

    async def read_handle(self, tenant: str, session_id: str, generation: int, digest: bytes) -> bytes | None: ...


class StoreError(Exception):
    """etcd answered with an error that is not about reachability."""


class StoreUnavailable(StoreError):
    """etcd is unreachable, has no leader, or did not answer in time."""


@dataclass(frozen=True)
class ClaimResult:
    claimed: bool
    reason: str
    # Claimed: the stored record at the claimed revision, with its handle. Refused: the current record without handle.
    session: common_pb2.Session | None


class SessionReads(Protocol):
    """The records (``EtcdStore.sessions``)."""

    async def get(self, tenant: str, session_id: str, *, with_handle: bool = True) -> common_pb2.Session | None:
        """The record (``revision`` = its mod_revision, ``lease_id`` = its lease; claimed: handle cleared), or None;
        an out-of-record handle (``handle_digest``) is read too unless ``with_handle`` is False."""
        ...


class HandleClaiming(Protocol):
    """Claims of the records' KV handles, and what each decode worker still holds (``EtcdStore.claims``)."""

    async def claim(self, tenant: str, session_id: str, revision: int, *, now: float,
                    known: common_pb2.Session | None = None, free_reason: str = "") -> ClaimResult:
        """Take the handle of the record at ``revision``, at most once whoever claims it."""
        ...

    async def held_on_worker(self, worker_id: str) -> list[common_pb2.Session]:
        """Summaries of the records whose unspent handle's KV lives on ``worker_id``."""
        ...


class LeaseGrants(Protocol):
    """New leases (``EtcdStore.leases``)."""

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (lease id, TTL granted)."""
        ...


class Campaigns(Protocol):
    """Leadership among replicas (``EtcdStore.elections``)."""

    async def campaign(self, name: str, holder: str, ttl_s: int) -> bool:
        """Whether ``holder`` leads ``name`` (one leader at a time among the replicas campaigning for it)."""
        ...


class ClaimStore(Protocol):
    """Session reads, handle claims, leadership and the decode workers' held KV (the scheduler's use of the store):
    ``store.sessions.get``, ``store.claims.claim`` / ``held_on_worker``, ``store.elections.campaign``.

    Failures raise ``StoreUnavailable`` (etcd unreachable, no leader, timeout) or ``StoreError``.
    """

    @property
    def sessions(self) -> SessionReads: ...

    @property
    def claims(self) -> HandleClaiming: ...

    @property
    def elections(self) -> Campaigns: ...

    async def connect(self) -> None: ...

    async def close(self) -> None: ...
