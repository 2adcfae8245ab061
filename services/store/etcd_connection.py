"""The connection to etcd that every etcd store shares: the channel, the retries, the watch stream, txn compares.

The only place that talks to etcd through etcd3aio (so the client can be swapped): each record's store
(etcd_workers, etcd_sessions, etcd_claims, etcd_responses, etcd_leases, etcd_outcomes, etcd_snapshots) runs its
operations through :meth:`EtcdConnection.call`. Errors surface as ``StoreUnavailable`` (etcd unreachable, no leader,
timeout) or ``StoreError``; each operation is reported to ``on_op`` (name, seconds, error kind): the services pass
their metrics' ``etcd_op``.

Pinned to etcd3aio 0.3.0: the watch stream and txn compares use its generated stubs (``etcd3aio._protobuf``) because
the library's own watch hides reconnects (the stores re-send a snapshot after each) and has no mod_revision compare
helper.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError, prefix_range_end
from etcd3aio._protobuf import Compare, WatchCreateRequest, WatchRequest, WatchStub
from etcd3aio.connections import ConnectionManager
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from kvshuttle.services.common.tls import EtcdSecurity
from kvshuttle.services.store.etcd_channel import EtcdAuthError, etcd_channel, grpc_target, resolved_endpoints
from kvshuttle.services.store.interface import OpObserver, StoreError, StoreUnavailable, no_op
from kvshuttle.services.store.keys import Keys

log = logging.getLogger(__name__)

# Reconnect quickly to a member that comes back (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# etcd fails a watch instead of hanging when its member has no leader (clientv3.WithRequireLeader).
_REQUIRE_LEADER = (("hasleader", "true"),)
EVENT_PUT = 0  # a watch event's type (else a delete)


class WatchLost(Exception):
    """etcd canceled a watch (e.g. compacted past its start revision)."""


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list -> ``["h1:p1", "h2:p2"]`` (an ``http://`` scheme is dropped)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [e.strip().removeprefix("http://") for e in items if e.strip()]
    if not out:
        raise ValueError("no etcd endpoints given")
    return out


class EtcdConnection:
    """The channel to etcd and the way every operation runs on it. ``connect()`` first (no I/O: channels connect
    lazily)."""

    def __init__(self, endpoints: str | Sequence[str], prefix: str = "/kvshuttle/", *, timeout_s: float = 5.0,
                 attempt_timeout_s: float = 2.0, security: EtcdSecurity | None = None, on_op: OpObserver = no_op):
        """``security``: TLS towards etcd and/or its user/password auth (None: plaintext, no auth). ``on_op`` is told
        of each operation: its name, its seconds (retries included) and "" / "unavailable" / "error"."""
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
        # Set when an operation failed for its whole timeout; cleared by any answer from etcd (see call).
        self.unreachable_since: float | None = None

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
        await self.call("ping", self.kv.get, self.keys.ping)

    async def call(self, op: str, fn, *args, **kwargs):
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

    async def watch_events(self, prefix: str, revision: int, *, prev_kv: bool = False) -> AsyncIterator[Any]:
        """Every event under ``prefix`` from ``revision`` on, until the stream ends; raises WatchLost when etcd
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
                    raise WatchLost(f"watch canceled by etcd ({resp.cancel_reason or 'compacted'})")
                for ev in resp.events:
                    yield ev
        finally:
            call.cancel()


def mod_revision_is(key: str, revision: int) -> Compare:
    # etcd compares an absent key as mod_revision 0.
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=key.encode(), mod_revision=revision)


def lease_is(key: str, lease_id: int) -> Compare:
    return Compare(result=Compare.EQUAL, target=Compare.LEASE, key=key.encode(), lease=lease_id)


def absent(key: str) -> Compare:
    return Compare(result=Compare.EQUAL, target=Compare.CREATE, key=key.encode(), create_revision=0)
