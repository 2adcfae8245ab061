"""SessionRegistry gRPC servicer: a thin adapter between the protos, kvshuttle.control_plane.session and the etcd store.

Every RPC either answers or aborts with a status and a clear message: INVALID_ARGUMENT (bad input),
NOT_FOUND (no such session/worker/lease), FAILED_PRECONDITION (e.g. the decode worker is not registered),
ABORTED (concurrent updates kept winning), UNAVAILABLE (etcd unreachable). Anything unexpected is logged and
answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

import grpc
import grpc.aio
from kvshuttle.control_plane import response_chain as chains
from kvshuttle.control_plane import session as rules
from kvshuttle.services.common.telemetry import hashed
from kvshuttle.services.store.etcd_store import EtcdStore, StoreError, StoreUnavailable
from kvshuttle.services.store.history import HistoryGone, HistoryStore, HistoryUnavailable, bytes_to_ids
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from opentelemetry import trace

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)
Event = registry_pb2.WatchWorkersResponse
_KINDS = {"snapshot": Event.EVENT_TYPE_SNAPSHOT, "put": Event.EVENT_TYPE_PUT, "delete": Event.EVENT_TYPE_DELETE}
_RECORD_ATTEMPTS = 5


class RpcFailure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _unary(method):
    """Turn domain and store errors into gRPC statuses; never let an exception escape unanswered."""
    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except RpcFailure as exc:
            failure = (exc.code, exc.message)
        except rules.InvalidArgument as exc:
            failure = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except rules.FailedPrecondition as exc:
            failure = (grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StoreUnavailable as exc:
            failure = (grpc.StatusCode.UNAVAILABLE, f"session store unavailable: {exc}")
        except HistoryUnavailable as exc:
            failure = (grpc.StatusCode.UNAVAILABLE, f"history store unavailable: {exc}")
        except StoreError as exc:
            log.error("%s: store error: %s", method.__name__, exc)
            failure = (grpc.StatusCode.INTERNAL, f"session store error: {exc}")
        except Exception as exc:  # noqa: BLE001 - the RPC must still get an answer
            log.exception("%s failed", method.__name__)
            failure = (grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        await context.abort(*failure)
    return wrapper


class SessionRegistryServicer(registry_pb2_grpc.SessionRegistryServicer):
    def __init__(self, store: EtcdStore, history: HistoryStore, *, default_lease_ttl_s: int = 10,
                 expiry_margin_s: float = 30.0, clock: Callable[[], float] = time.time,
                 handle_inline_bytes: int = rules.HANDLE_INLINE_BYTES, max_answer_bytes: int = 4 << 20):
        self.store = store
        self.max_answer_bytes = max_answer_bytes  # the most one answer may carry (GetResponseChain's bound)
        self.history = history
        self.handle_inline_bytes = handle_inline_bytes
        self._cleanups: set[asyncio.Task] = set()
        self.default_lease_ttl_s = default_lease_ttl_s
        self.expiry_margin_s = expiry_margin_s
        self.clock = clock

    # -- workers ---------------------------------------------------------------------------------------------

    @_unary
    async def RegisterWorker(self, request, context):
        worker = common_pb2.Worker()
        worker.CopyFrom(request.worker)
        rules.validate_worker(worker)
        ttl = rules.worker_lease_ttl(request.lease_ttl_s, self.default_lease_ttl_s)
        previous = await self.store.workers.get(worker.worker_id)
        lease_id, granted = await self.store.leases.grant(ttl)
        worker.lease_id = lease_id
        rules.set_seconds(worker.registered_at, self.clock())
        try:
            await self.store.workers.put(worker)
        except BaseException:
            with contextlib.suppress(StoreError):
                await self.store.leases.revoke(lease_id)
            raise
        if previous is not None and previous.lease_id and previous.lease_id != lease_id:
            with contextlib.suppress(StoreError):  # the old lease holds nothing now
                await self.store.leases.revoke(previous.lease_id)
        log.info("registered %s worker %s (lease %x, ttl %ds)", common_pb2.WorkerRole.Name(worker.role),
                 worker.worker_id, lease_id, granted)
        return registry_pb2.RegisterWorkerResponse(worker=worker, lease_id=lease_id, lease_ttl_s=granted)

    @_unary
    async def KeepAlive(self, request, context):
        rules.validate_id("worker_id", request.worker_id)
        if request.lease_id <= 0:
            raise rules.InvalidArgument("lease_id is required")
        ttl = await self.store.leases.keep_alive_once(request.lease_id)
        if ttl is None:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND,
                             f"lease {request.lease_id:x} of worker {request.worker_id!r} has expired: register again")
        worker = await self.store.workers.get(request.worker_id)
        if worker is None or worker.lease_id != request.lease_id:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND,
                             f"worker {request.worker_id!r} is not registered under lease {request.lease_id:x}: "
                             "register again")
        return registry_pb2.KeepAliveResponse(lease_ttl_s=ttl)

    @_unary
    async def DeregisterWorker(self, request, context):
        rules.validate_id("worker_id", request.worker_id)
        if request.lease_id < 0:
            raise rules.InvalidArgument("lease_id must not be negative")
        worker = await self.store.workers.get(request.worker_id)
        if worker is not None and request.lease_id and worker.lease_id != request.lease_id:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             f"worker {request.worker_id!r} is registered under another lease "
                             f"({worker.lease_id:x}, not {request.lease_id:x}); not removing it")
        revoked = False
        for lease_id in {request.lease_id, worker.lease_id if worker else 0} - {0}:
            revoked = await self.store.leases.revoke(lease_id) or revoked  # revoking deletes the record too
        deleted = await self.store.workers.delete(request.worker_id) if worker is not None else False
        if worker is None and not revoked and not deleted:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"worker {request.worker_id!r} is not registered")
        log.info("deregistered worker %s", request.worker_id)
        return registry_pb2.DeregisterWorkerResponse()

    @_unary
    async def ListWorkers(self, request, context):
        if request.role not in common_pb2.WorkerRole.values():
            raise rules.InvalidArgument(f"unknown role {request.role}")
        workers = await self.store.workers.live()
        if request.role:
            workers = [w for w in workers if w.role == request.role]
        return registry_pb2.ListWorkersResponse(workers=workers)

    async def WatchWorkers(self, request, context):
        events = self.store.workers.watch(raise_first=True)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield Event(type=_KINDS[event.kind], workers=event.workers)
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"session store unavailable: {exc}")
        except StoreError as exc:
            log.error("WatchWorkers: store error: %s", exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"session store error: {exc}")

    # -- sessions --------------------------------------------------------------------------------------------

    @_unary
    async def GetSession(self, request, context):
        self._validate_session_ref(request)
        found = await self.store.sessions.get(request.tenant, request.session_id)
        if found is None:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND,  # no id in messages: they end up in traces
                             f"no session with this id for tenant {request.tenant!r}")
        missing = await self._with_history(found) if request.include_token_ids else ""
        return registry_pb2.GetSessionResponse(session=found, expires_in_s=rules.expires_in(found, self.clock()),
                                               history_missing=missing)

    async def _with_history(self, session: common_pb2.Session) -> str:
        """Fill ``session.token_ids`` from the history store; '' when done, else why not (the caller then tokenizes
        the text again; the prefix digests still prove what may be pulled)."""
        if not session.history_generation or not session.history_tokens:
            return "the record names no history (written before the history store)"
        try:
            data = await self.history.read(session.tenant, session.session_id, session.history_generation,
                                           session.history_tokens)
        except HistoryUnavailable as exc:
            log.warning("history store unavailable reading a session's ids: %s", exc)
            return f"history store unavailable: {exc}"
        if data is None:
            return "the history store no longer holds the session's ids"
        session.token_ids.extend(bytes_to_ids(data))
        return ""

    @_unary
    async def RecordTurn(self, request, context):
        with tracer.start_as_current_span("registry.record_turn") as span:
            span.set_attribute("kvshuttle.session", hashed(request.session_id))
            self._validate_session_ref(request)
            rules.validate_id("decode_worker_id", request.decode_worker_id)
            for _ in range(_RECORD_ATTEMPTS):
                previous = await self.store.sessions.get(request.tenant, request.session_id, with_handle=False)
                worker = await self.store.workers.get(request.decode_worker_id)
                plan = rules.build_session(request, worker, now=self.clock(), margin_s=self.expiry_margin_s,
                                           previous=previous, handle_inline_bytes=self.handle_inline_bytes)
                # The ids first: a record never names ids the history store does not hold. Ids written for a
                # record that then loses its race are replaced by the next write at the same place, or expire.
                record = plan.session
                handle = ((record.handle_digest, record.kv_transfer_params_json.encode()) if record.handle_digest
                          else None)
                try:
                    await self.history.append(record.tenant, record.session_id, record.history_generation,
                                              plan.history_start, plan.history_ids,
                                              plan.lease_ttl_s + rules.HISTORY_GRACE_S, handle=handle,
                                              copy_from=plan.copy_from)
                except HistoryGone as exc:
                    raise rules.FailedPrecondition(f"the session's recorded history changed ({exc}): send the "
                                                   "whole history (base_tokens 0)") from None
                lease_id, _ = await self.store.leases.grant(plan.lease_ttl_s)
                try:
                    stored = await self.store.sessions.put(record, lease_id,
                                                           expect_revision=previous.revision if previous else 0,
                                                           replaced_lease=previous.lease_id if previous else 0)
                except BaseException:
                    with contextlib.suppress(StoreError):
                        await self.store.leases.revoke(lease_id)
                    raise
                if stored is not None:
                    # What the new record replaced goes off the turn's path (it would expire anyway).
                    if plan.replaces_generation:
                        self._later(self._drop_history(record.tenant, record.session_id, plan.replaces_generation))
                    elif previous is not None and previous.handle_digest not in (b"", record.handle_digest):
                        self._later(self._drop_handle(previous))
                    span.set_attribute("kvshuttle.covered_tokens", stored.covered_tokens)
                    if stored.handle_digest:  # the caller has it: do not send it back
                        stored.kv_transfer_params_json = ""
                    return registry_pb2.RecordTurnResponse(session=stored)
                with contextlib.suppress(StoreError):  # lost a race with another RecordTurn: read again
                    await self.store.leases.revoke(lease_id)
            raise RpcFailure(grpc.StatusCode.ABORTED,
                             "the session kept changing while recording the turn; retry")

    def _later(self, work) -> None:
        task = asyncio.create_task(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def drain(self) -> None:
        """Wait for the background clean-ups (tests, shutdown)."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    async def _drop_handle(self, replaced: common_pb2.Session) -> None:
        """The replaced record's out-of-record handle (best effort: it expires with its lineage)."""
        try:
            await self.history.drop_handle(replaced.tenant, replaced.session_id, replaced.history_generation,
                                           replaced.handle_digest)
        except HistoryUnavailable as exc:
            log.warning("could not drop a replaced KV handle (it expires with its history): %s", exc)

    async def _drop_history(self, tenant: str, session_id: str, generation: int) -> None:
        """Best effort: a lineage left behind expires with its TTL."""
        try:
            await self.history.drop(tenant, session_id, generation)
        except HistoryUnavailable as exc:
            log.warning("could not drop a replaced history (it expires with its TTL): %s", exc)

    @_unary
    async def ClaimSession(self, request, context):
        self._validate_session_ref(request)
        if request.revision <= 0:
            raise rules.InvalidArgument("revision is required: the record revision the caller planned with")
        rules.validate_free_reason(request.free_reason)
        result = await self.store.claims.claim(request.tenant, request.session_id, request.revision,
                                               now=self.clock(), free_reason=request.free_reason)
        return registry_pb2.ClaimSessionResponse(claimed=result.claimed, reason=result.reason, session=result.session)

    @_unary
    async def FindSession(self, request, context):
        request.tenant = request.tenant or rules.DEFAULT_TENANT
        rules.validate_id("tenant", request.tenant)
        rules.validate_find(request.text_keys)
        rules.validate_model(request.model)
        with tracer.start_as_current_span("registry.find_session") as span:
            found = await self.store.sessions.find(request.tenant, list(request.text_keys), request.model)
            span.set_attribute("kvshuttle.found", found is not None)
        if found is None:
            of_model = f" and model {request.model!r}" if request.model else ""
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"no session of tenant {request.tenant!r}{of_model} has a "
                                                        "recorded text that the prompt extends")
        matched, session = found
        missing = await self._with_history(session) if request.include_token_ids else ""
        return registry_pb2.FindSessionResponse(session=session, expires_in_s=rules.expires_in(session, self.clock()),
                                                matched_key=matched, history_missing=missing)

    # -- stored responses (the gateway's Responses API) ------------------------------------------------------

    @_unary
    async def PutResponse(self, request, context):
        """The body to the history store (the conversation's group), then the small index entry to etcd, on the
        conversation's lease (kept alive here: one keep-alive per response) or, for a new conversation, a new one."""
        response = request.response
        response.tenant = response.tenant or rules.DEFAULT_TENANT
        rules.validate_stored_response(response, request.ttl_s)
        if not response.HasField("created_at"):
            rules.set_seconds(response.created_at, self.clock())
        previous, lease_id, ttl = None, 0, request.ttl_s
        if response.previous_response_id:
            found = await self.store.responses.get(response.tenant, response.previous_response_id)
            if found is None:
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"previous response {response.previous_response_id!r} "
                                                            f"not found for tenant {response.tenant!r} (unknown, "
                                                            "expired or deleted)")
            previous, lease_id = found
        body = response.body_json
        where = chains.place(previous, response.response_id, len(body))
        if where.shares_lease:
            ttl = await self.store.leases.keep_alive_once(lease_id)
            if ttl is None:
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"previous response {response.previous_response_id!r}'s "
                                                            "conversation has expired")
        else:
            lease_id, ttl = await self.store.leases.grant(request.ttl_s)
        entry = registry_pb2.StoredResponse()
        entry.CopyFrom(response)
        entry.body_json = b""
        entry.chain_id, entry.chain_length, entry.chain_bytes = where.chain_id, where.chain_length, where.chain_bytes
        entry.body_in_history_store, entry.body_bytes = True, len(body)
        try:
            # The body first: an entry never names a body the history store does not hold. It outlives the lease.
            await self.history.put_response_body(entry.tenant, entry.chain_id, entry.response_id, body,
                                                 max(ttl, request.ttl_s) + rules.HISTORY_GRACE_S,
                                                 previous=entry.previous_response_id if previous else "")
            stored = await self.store.responses.put(entry, lease_id, ttl)
        except StoreError as exc:
            if not where.shares_lease:
                with contextlib.suppress(StoreError):
                    await self.store.leases.revoke(lease_id)
            if "lease not found" in str(exc):  # the conversation's lease ended between the keep-alive and the put
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"previous response {response.previous_response_id!r}'s "
                                                            "conversation has expired") from None
            raise
        except BaseException:
            if not where.shares_lease:
                with contextlib.suppress(StoreError):
                    await self.store.leases.revoke(lease_id)
            raise
        return registry_pb2.PutResponseResponse(response=stored)

    @_unary
    async def GetResponse(self, request, context):
        self._validate_response_ref(request)
        entry = await self._response_entry(request.tenant, request.response_id)
        if entry.body_in_history_store:
            bodies = await self.history.read_response_bodies(entry.tenant, entry.chain_id, [entry.response_id])
            if entry.response_id not in bodies:
                raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"stored response {request.response_id!r}'s items are "
                                                            "gone from the history store")
            entry.body_json = bodies[entry.response_id]
        return registry_pb2.GetResponseResponse(response=entry)

    async def _response_entry(self, tenant: str, response_id: str) -> registry_pb2.StoredResponse:
        found = await self.store.responses.get(tenant, response_id)
        if found is None:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"no stored response {response_id!r} for tenant "
                                                        f"{tenant!r} (unknown, expired or deleted)")
        return found[0]

    @_unary
    async def GetResponseChain(self, request, context):
        """The response's index entry (one etcd read: bounds checked on it before anything else is read), then its
        conversation's links and the chain's bodies from the history store (one read each, whatever the length).
        The earlier responses come with their id, link, place and body."""
        self._validate_response_ref(request)
        chains.validate_bounds(request.max_responses, request.max_bytes)
        max_bytes = min(request.max_bytes, self.max_answer_bytes)  # the most one answer of this registry carries
        last = await self._response_entry(request.tenant, request.response_id)
        try:
            chains.check_bounds(last, request.max_responses, max_bytes)
        except chains.ChainTooLong as exc:
            raise RpcFailure(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from None
        if not last.body_in_history_store:  # written before chains: the whole conversation in its own body
            return registry_pb2.GetResponseChainResponse(responses=[last])
        tenant, group = request.tenant, last.chain_id
        try:
            links = await self.history.read_response_links(tenant, group)
            ids = chains.walk(links, last)
        except chains.ChainBroken as exc:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        bodies = await self.history.read_response_bodies(tenant, group, [i for i in ids if i in links])
        entries = []
        for place, response_id in enumerate(ids, start=1):
            if response_id == last.response_id:
                entry = last
            elif response_id in links:
                entry = registry_pb2.StoredResponse(
                    response_id=response_id, tenant=tenant, chain_id=group, chain_length=place,
                    previous_response_id=links[response_id], body_in_history_store=True)
            else:  # the first, written before chains: its body is in its own etcd entry
                found = await self.store.responses.get(tenant, response_id)
                if found is None or found[0].chain_length != 0:
                    raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"response {response_id!r} of the "
                                     f"conversation of {request.response_id!r} is gone (deleted, or its conversation "
                                     "expired): the conversation cannot be read back")
                entries.append(found[0])
                continue
            if response_id not in bodies:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"response {response_id!r} of the "
                                 f"conversation of {request.response_id!r} has lost its items (the history store "
                                 "no longer holds them): the conversation cannot be read back")
            entry.body_json = bodies[response_id]
            entry.body_bytes = len(entry.body_json)
            entries.append(entry)
        answer = registry_pb2.GetResponseChainResponse(responses=entries)
        if answer.ByteSize() > max_bytes:  # the estimate before the reads was short: still refused whole
            raise RpcFailure(grpc.StatusCode.OUT_OF_RANGE, f"the conversation up to response {request.response_id!r} "
                                                           f"is {answer.ByteSize()} bytes; at most {max_bytes} are "
                                                           "read back")
        return answer

    @_unary
    async def DeleteResponse(self, request, context):
        """The body and its link first (so the conversation after it is broken at once, by name), then the index
        entry. Later responses of the conversation stay readable by id, but cannot be continued past this one."""
        self._validate_response_ref(request)
        found = await self.store.responses.get(request.tenant, request.response_id)
        if found is not None and found[0].body_in_history_store:
            await self.history.drop_response_body(request.tenant, found[0].chain_id, request.response_id)
        gone = await self.store.responses.delete(request.tenant, request.response_id)
        return registry_pb2.DeleteResponseResponse(deleted=gone is not None)

    @staticmethod
    def _validate_response_ref(request) -> None:
        rules.validate_id("response_id", request.response_id)
        request.tenant = request.tenant or rules.DEFAULT_TENANT
        rules.validate_id("tenant", request.tenant)

    @_unary
    async def DeleteSession(self, request, context):
        self._validate_session_ref(request)
        record = await self.store.sessions.get(request.tenant, request.session_id, with_handle=False)
        deleted = await self.store.sessions.delete(request.tenant, request.session_id)
        if record is not None and record.history_generation:
            await self._drop_history(request.tenant, request.session_id, record.history_generation)
        return registry_pb2.DeleteSessionResponse(deleted=deleted)

    @staticmethod
    def _validate_session_ref(request) -> None:
        """Checks the ids; an empty tenant means the default one (single-tenant deployments, REST reads)."""
        rules.validate_id("session_id", request.session_id)
        request.tenant = request.tenant or rules.DEFAULT_TENANT
        rules.validate_id("tenant", request.tenant)
