"""etcd maintenance: each member's database size, and defragmentation, one member at a time.

etcd compacts old key versions (every minute here: ``RETENTION_ARGS``, the chart's bundled etcd), but compaction only
frees pages inside its bbolt file: the file (``dbSize``) keeps its size, and what the live data takes
(``dbSizeInUse``) is all that shrinks (measured: 442 MB left after 1,000 sessions). Only ``Maintenance.Defragment``
rewrites the file. It is per member and blocks that member (its reads, writes and raft apply) while it runs, seconds
for hundreds of MB: so the members are defragmented one after the other, the leader last, each with its own
generous deadline, and a member whose defragmentation fails or times out ends the run (it may still be at it).

The members are ``Cluster.MemberList``'s, each reached at its advertised client URLs on a channel of its own (with the
store's TLS and auth), and its ``Maintenance.Status`` must name that member (a load-balanced URL could land on
another). When no configured endpoint answers the member list, each configured endpoint is a member (deduplicated by
the member id its Status names). Operations are reported to ``on_op`` like the store's (``kvshuttle_etcd_*``).

With etcd auth on, Defragment (and on etcd 3.5, Status) needs the ``root`` role.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
import grpc.aio
from etcd3aio._protobuf import (
    ClusterStub,
    DefragmentRequest,
    MaintenanceStub,
    MemberListRequest,
    StatusRequest,
    StatusResponse,
)
from kvshuttle.services.common.tls import EtcdSecurity
from kvshuttle.services.store.etcd_channel import EtcdAuthError, etcd_channel
from kvshuttle.services.store.interface import OpObserver, StoreError, StoreUnavailable, no_op

__all__ = ["Defragmented", "EtcdMaintenance", "MemberStatus", "defragment"]

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class MemberStatus:
    """One member's ``Maintenance.Status``: its database file (``db_size``) and what its data takes of it."""

    member_id: int
    name: str
    endpoint: str  # host:port it answered at
    db_size: int
    db_size_in_use: int
    leader: bool

    @property
    def free_bytes(self) -> int:
        """Bytes a defragmentation would give back (pages freed by compaction)."""
        return max(0, self.db_size - self.db_size_in_use)


@dataclass(frozen=True)
class Defragmented:
    """One member's defragmentation: its status before and after (None when not read), seconds, error ("" = done)."""

    before: MemberStatus
    after: MemberStatus | None
    seconds: float
    error: str = ""


def _host_port(url: str) -> str | None:
    """``http(s)://host:port`` (or ``host:port``) -> ``host:port``; None for what a gRPC channel cannot dial here."""
    if "://" not in url:
        return url or None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port or 2379}"


class EtcdMaintenance:
    """Member statuses and defragmentation. ``await close()`` (or ``async with``) when done: channels are cached
    per endpoint."""

    def __init__(self, endpoints: Sequence[str], security: EtcdSecurity | None = None, *, timeout_s: float = 5.0,
                 defrag_timeout_s: float = 60.0, on_op: OpObserver = no_op):
        """``timeout_s``: each MemberList and Status call; ``defrag_timeout_s``: each member's Defragment."""
        self.endpoints = list(endpoints)
        if not self.endpoints:
            raise ValueError("no etcd endpoints given")
        self.security = security
        self.timeout_s = timeout_s
        self.defrag_timeout_s = defrag_timeout_s
        self.on_op = on_op
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def of(cls, store, **kwargs) -> EtcdMaintenance:
        """For an ``EtcdStore``: its endpoints, TLS and auth, and its operation observer."""
        kwargs.setdefault("on_op", store.on_op)
        return cls(store.endpoints, store.security, **kwargs)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> EtcdMaintenance:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            # One endpoint per channel, through gRPC's DNS resolver: a member's advertised URL is usually a name.
            channel, _ = etcd_channel(endpoint, _CHANNEL_OPTIONS, self.security, endpoint.rsplit(":", 1)[0])
            self._channels[endpoint] = channel
        return channel

    async def _call(self, op: str, rpc: Callable, request, timeout_s: float):
        """One attempt of ``rpc(request)`` within ``timeout_s``, reported to ``on_op``; errors as StoreUnavailable
        (unreachable, timed out) or StoreError."""
        started, error = time.perf_counter(), ""
        try:
            return await rpc(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            error = "unavailable" if exc.code() in _UNAVAILABLE else "error"
            kind = StoreUnavailable if error == "unavailable" else StoreError
            raise kind(f"etcd {op}: {exc.code().name} ({exc.details()})") from None
        except EtcdAuthError as exc:
            error = "error"
            raise StoreError(str(exc)) from None
        finally:
            self.on_op(op, time.perf_counter() - started, error)

    async def status(self, endpoint: str, name: str = "") -> MemberStatus:
        """The status of the member that answers at ``endpoint`` (host:port)."""
        resp: StatusResponse = await self._call("member status", MaintenanceStub(self._channel(endpoint)).Status,
                                                StatusRequest(), self.timeout_s)
        member_id = resp.header.member_id
        return MemberStatus(member_id, name or f"{member_id:x}", endpoint, resp.dbSize, resp.dbSizeInUse,
                            bool(resp.leader) and resp.leader == member_id)

    async def _members(self) -> list[tuple[int, str, list[str]]] | None:
        """(id, name, client host:ports) of each member from the first configured endpoint that answers; None when
        none does."""
        last = ""
        for endpoint in self.endpoints:
            try:
                resp = await self._call("member list", ClusterStub(self._channel(endpoint)).MemberList,
                                        MemberListRequest(), self.timeout_s)
            except StoreError as exc:
                last = str(exc)
                continue
            return [(m.ID, m.name or f"{m.ID:x}", [ep for url in m.clientURLs if (ep := _host_port(url))])
                    for m in resp.members]
        log.warning("etcd member list: no endpoint answered (%s); using the configured endpoints", last)
        return None

    async def statuses(self) -> tuple[list[MemberStatus], list[str]]:
        """Every member's status, the leader last, and a line for each member (or endpoint) that did not answer.

        Raises StoreUnavailable when no member answers at all."""
        found: dict[int, MemberStatus] = {}
        problems: list[str] = []
        members = await self._members()
        if members is not None:
            for member_id, name, endpoints in members:
                status, why = None, "no client URL"
                for endpoint in endpoints:
                    try:
                        status = await self.status(endpoint, name)
                    except StoreError as exc:
                        why = str(exc)
                        continue
                    if status.member_id == member_id:
                        break
                    why, status = f"{endpoint} answers as member {status.member_id:x}", None
                if status is None:
                    problems.append(f"member {name}: {why}")
                else:
                    found[member_id] = status
        else:
            for endpoint in self.endpoints:
                try:
                    status = await self.status(endpoint)
                except StoreError as exc:
                    problems.append(f"{endpoint}: {exc}")
                    continue
                found.setdefault(status.member_id, status)
        if not found:
            raise StoreUnavailable("etcd: no member answered its status: " + "; ".join(problems))
        return sorted(found.values(), key=lambda s: (s.leader, s.name)), problems

    async def defragment_member(self, member: MemberStatus) -> Defragmented:
        """Defragment ``member`` (as found by :meth:`statuses`) and read its status again. Never raises StoreError:
        a failure is the result's ``error``."""
        started = time.perf_counter()
        log.info("defragmenting etcd member %s at %s: %d bytes, %d in use", member.name, member.endpoint,
                 member.db_size, member.db_size_in_use)
        try:
            await self._call("defragment", MaintenanceStub(self._channel(member.endpoint)).Defragment,
                             DefragmentRequest(), self.defrag_timeout_s)
        except StoreError as exc:
            error = str(exc) or type(exc).__name__
            if "permission denied" in error.lower():
                error += ": defragmentation needs etcd's root role"
            return Defragmented(member, None, time.perf_counter() - started, error)
        seconds = time.perf_counter() - started
        try:
            after = await self.status(member.endpoint, member.name)
        except StoreError as exc:
            log.warning("etcd member %s defragmented in %.1fs; its status after: %s", member.name, seconds, exc)
            return Defragmented(member, None, seconds)
        log.info("etcd member %s defragmented in %.1fs: %d -> %d bytes (%d in use)", member.name, seconds,
                 member.db_size, after.db_size, after.db_size_in_use)
        return Defragmented(member, after, seconds)

    async def defragment(self, members: Sequence[MemberStatus]) -> list[Defragmented]:
        """Defragment ``members`` one at a time, in order; a failure ends the run (the member may still be at it:
        the next must not start meanwhile). Returns what was tried, the failure last."""
        done = []
        for member in members:
            result = await self.defragment_member(member)
            done.append(result)
            if result.error:
                log.warning("could not defragment etcd member %s: %s", member.name, result.error)
                break
        return done


async def defragment(store_or_endpoints, security: EtcdSecurity | None = None, *, timeout_s: float = 60.0,
                     select: Callable[[MemberStatus], bool] | None = None,
                     on_op: OpObserver | None = None) -> list[Defragmented]:
    """Defragment every member of the etcd cluster (or those ``select`` picks by their status), one at a time, the
    leader last, each within ``timeout_s``.

    ``store_or_endpoints``: an ``EtcdStore`` (its endpoints, TLS, auth and observer) or endpoints (``"h1:p1,h2:p2"``
    or a list, with ``security``). Raises StoreUnavailable when no member answers."""
    if isinstance(store_or_endpoints, str | list | tuple):
        endpoints = [e.strip().removeprefix("http://").removeprefix("https://")
                     for e in (store_or_endpoints.split(",") if isinstance(store_or_endpoints, str)
                               else store_or_endpoints) if e.strip()]
        maintenance = EtcdMaintenance(endpoints, security, defrag_timeout_s=timeout_s, on_op=on_op or no_op)
    else:
        maintenance = EtcdMaintenance.of(store_or_endpoints, defrag_timeout_s=timeout_s,
                                         **({"on_op": on_op} if on_op is not None else {}))
    async with maintenance:
        members, problems = await maintenance.statuses()
        for problem in problems:
            log.warning("etcd defragmentation skips %s", problem)
        return await maintenance.defragment([m for m in members if select is None or select(m)])

