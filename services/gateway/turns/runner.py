"""The turn runner: one turn through the disaggregated pair as a chain of stages over one TurnContext.

    prompt (prompt.py)   render the chat, find the session, exact prompt ids
    plan (plan.py)       the scheduler's choice of P and D: pull, recompute, or continue on D (local.py)
    prefill (prefill.py) P pulls or computes the prompt's KV; D's kv_transfer_params (none when continued on D)
    decode (decode.py)   D's tokens as text deltas
    parse (parse.py)     what the deltas mean: reasoning, content, tool calls (events on each delta)
    record (record.py)   the registry keeps D's handle and the exact ids for the next turn

``prepare`` runs the first three (a front end can still refuse or shape the answer then), ``decode`` the rest.
Each stage reads what earlier stages put in the context and adds its own part, so it can be tested alone with a
context built by hand. Stages never call each other: one that cannot go on raises a typed outcome (errors.py:
SnapshotStale, WorkerDown, DecodeFailed), and the runner alone owns the loops that follow (read the record again
and re-plan; plan without a failed P; resume the answer on another D). Stages are typed against
services.TurnServices, which the runner provides. The front ends build the TurnRequest with builder.py and spell
the events in their API's shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import grpc
from kvshuttle.control_plane import cache_salt as cache_salts
from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.lru import BoundedLru
from kvshuttle.control_plane.prefix import PrefixHasher, ids_bytes
from kvshuttle.services.common import metrics
from kvshuttle.services.common.telemetry import hashed
from kvshuttle.services.engine.client import EngineClient, Final
from kvshuttle.services.gateway.turns import decode as decoding
from kvshuttle.services.gateway.turns import local as on_decode
from kvshuttle.services.gateway.turns import parse as parsing
from kvshuttle.services.gateway.turns import plan as planning
from kvshuttle.services.gateway.turns import prefill as prefilling
from kvshuttle.services.gateway.turns import prompt as prompting
from kvshuttle.services.gateway.turns import record as recording
from kvshuttle.services.gateway.turns.context import (
    Delta,
    Finished,
    KnownSession,
    KvOutcome,
    Tokenizer,
    TurnContext,
    elapsed_ms,
)
from kvshuttle.services.gateway.turns.errors import DecodeFailed, SnapshotStale, TurnError, WorkerDown
from kvshuttle.services.gateway.turns.request import TurnRequest, check_length, validate
from kvshuttle.services.gateway.turns.spans import (
    finished_attributes,
    limit_attributes,
    record_failure,
    release_span,
    request_attributes,
    tracer,
)
from kvshuttle.v1 import common_pb2, registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from opentelemetry import trace

log = logging.getLogger(__name__)
# One line per answered turn (an access log of turns; route or silence it by this name).
turn_log = logging.getLogger("kvshuttle.gateway.turns")

# TurnRunner.degraded: session reads that failed, turns that recomputed because the registry/etcd was unreachable,
# turns whose record could not be written (their next turn cannot pull them), and turns whose session's exact ids
# the history store no longer had (their text was tokenized again).
DEGRADED_KINDS = ("session_read_failed", "recomputed_store_unavailable", "record_failed", "history_missing")


class TurnRunner:
    """What the stages share: the tokenizer, the registry and scheduler stubs, the engine clients, the limits, this
    gateway's copies of the records it wrote, and its counters."""

    max_prompt_tokens = 0  # the gateway's limit on a prompt's tokens (0: only the context length limits it)
    served_model = ""  # the model's name for clients (trace attributes) and the workers' (Worker.model) it plans on
    kv_bytes_per_token = 0  # an estimate of one token's KV in bytes (trace attributes; 0: unknown)
    lean_streams = True  # Generate calls (P's prefill, D's streams) over h2_streams (off: grpc.aio; --engine-streams)
    # The tenants' limits (tenant_limits.TenantQuotas: begin_turn(tenant) -> a quota with charge_prompt(n) and
    # end(generated)); None: no limits.
    quotas: Any = None

    def __init__(self, tokenizer: Tokenizer, registry: registry_pb2_grpc.SessionRegistryStub,
                 scheduler: scheduler_pb2_grpc.TransferSchedulerStub, *, max_model_len: int,
                 engine_timeout_s: float = 120.0, control_timeout_s: float = 5.0, session_cache_bytes: int = 64 << 20,
                 first_token_from_prefill: bool = True, prefill_timeout_s: float = 120.0,
                 decode_stall_timeout_s: float = 120.0, worker_retries: int = 2):
        """``prefill_timeout_s`` bounds one prefill call, ``decode_stall_timeout_s`` the wait for each of D's
        tokens (the first included): past them the worker counts as failed. ``worker_retries``: how many failed
        workers one turn may move away from (to another worker of the same role) before it fails with a 503."""
        self.tokenizer = tokenizer
        self.registry = registry
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.engine_timeout_s = engine_timeout_s
        self.control_timeout_s = control_timeout_s
        self.first_token_from_prefill = first_token_from_prefill
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_stall_timeout_s = decode_stall_timeout_s
        self.worker_retries = worker_retries
        self._engines: dict[str, EngineClient] = {}
        # The records this gateway wrote (RecordTurn's answer, with its revision): the next turn of a session that
        # stays on this gateway needs no registry read. A record another gateway changed since makes the scheduler
        # report the snapshot stale (its claim is at our revision), and the turn reads the record and plans again.
        self._sessions: BoundedLru[common_pb2.Session] = BoundedLru(session_cache_bytes)
        # Per recorded session, the digest state over its whole history (prefix.PrefixHasher): the next turn's record
        # digests hash only the new ids. Kept with what identifies the history it covers (turn, length, lineage).
        self._hashers: BoundedLru[tuple[tuple, PrefixHasher]] = BoundedLru(max(1 << 20, session_cache_bytes // 16))
        self._reports: set[asyncio.Task] = set()  # background work in flight (kept so it is not collected)
        # Turns served without the session store (registry/etcd unreachable), by kind; GET /health shows them, and
        # /metrics (metrics_state).
        self.degraded: dict[str, int] = dict.fromkeys(DEGRADED_KINDS, 0)
        self.release_unused_handles = True
        self.free_unrecorded_kv = True  # free the KV of turns nothing records (no session id, record refused)
        self.answer_room_tokens = 1024  # KV room planned for an answer only the context limits (room_tokens)
        self.released_handles = 0  # KV handles freed on their decode worker: unused, unrecorded, or ended sessions
        # Chats sent without a session id continue the session their prompt text extends (FindSession), or start a
        # new one, recorded under a new id; off: such turns are not recorded (their KV is freed after the answer).
        self.find_sessions = False
        self.sessions_found = 0  # turns without a session id that continued a recorded session
        # A tenant's cache group ("": none; the keys file's cache_group): tenants of one group share a prefix-cache
        # salt (cache_salt).
        self.cache_group_of: Callable[[str], str] = lambda tenant: ""

    # -- what the stages share -------------------------------------------------------------------------------

    def engine(self, worker: common_pb2.Worker) -> EngineClient:
        client = self._engines.get(worker.grpc_address)
        if client is None:
            client = self._engines[worker.grpc_address] = EngineClient(
                worker.grpc_address, timeout_s=self.engine_timeout_s, lean_streams=self.lean_streams)
        return client

    def cache_salt(self, tenant: str) -> str:
        """The prefix-cache salt of ``tenant``'s engine calls, on P and on D (kvshuttle.control_plane.cache_salt)."""
        return cache_salts.for_tenant(tenant, self.cache_group_of(tenant))

    def own_record(self, tenant: str, session_id: str) -> common_pb2.Session | None:
        return self._sessions.get((tenant, session_id))

    def keep_record(self, tenant: str, session_id: str, record: common_pb2.Session) -> None:
        self._sessions.put((tenant, session_id), record, record.ByteSize())

    def history_hasher(self, tenant: str, session_id: str, base: common_pb2.Session) -> PrefixHasher | None:
        """A copy of the digest state over ``base``'s whole history (None: not kept here, or another history)."""
        kept = self._hashers.get((tenant, session_id))
        if kept is None or kept[0] != _history_identity(base) or kept[1].length != base.history_tokens:
            return None
        return kept[1].copy()

    def keep_hasher(self, tenant: str, session_id: str, recorded: common_pb2.Session, hasher: PrefixHasher) -> None:
        self._hashers.put((tenant, session_id), (_history_identity(recorded), hasher), _HASHER_BYTES)

    def forget_record(self, tenant: str, session_id: str) -> None:
        self._sessions.discard((tenant, session_id))

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` off the turn's path (outcome reports, freeing KV), keeping a reference until it ends."""
        task = asyncio.create_task(work)
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def validate(self, req: TurnRequest) -> None:
        """Checks shared by the HTTP and gRPC front ends (types are already checked by each)."""
        vocab = getattr(self.tokenizer, "vocab_size", None)
        validate(req, max_model_len=self.max_model_len, vocab=vocab if isinstance(vocab, int) else None)

    def check_length(self, req: TurnRequest, prompt_ids: list[int], span: trace.Span) -> None:
        check_length(req, prompt_ids, max_prompt_tokens=self.max_prompt_tokens, max_model_len=self.max_model_len)
        span.set_attributes(limit_attributes(req))

    def hidden_token_ids(self, req: TurnRequest) -> set[int]:
        return decoding.hidden_token_ids(self, req)

    async def close(self) -> None:
        for client in self._engines.values():
            await client.close()

    def metrics_state(self) -> metrics.GatewayState:
        """This runner's counts for the gateway's /metrics (registered with ``metrics.GATEWAY_STATE``)."""
        return metrics.GatewayState(degraded=dict(self.degraded), released_handles=self.released_handles)

    # -- the turn --------------------------------------------------------------------------------------------

    async def prepare(self, req: TurnRequest) -> TurnContext:
        """The prompt, plan and prefill stages: a turn whose prompt is prefilled on P."""
        req.model = req.model or self.served_model
        ctx = TurnContext(f"kvs-{uuid.uuid4().hex[:24]}", req, time.perf_counter())
        ctx.span = tracer.start_span("kvshuttle.turn", attributes=request_attributes(req, req.model))
        try:
            with trace.use_span(ctx.span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                self.validate(req)
                if self.quotas is not None:  # held until decode ends (or the context is dropped undecoded)
                    ctx.quota = self.quotas.begin_turn(req.tenant)
                    weakref.finalize(ctx, ctx.quota.end, 0)
                t = time.perf_counter()
                await prompting.build(self, ctx)
                ctx.timings["prompt_ms"] = elapsed_ms(t)
                if req.session_id:
                    snapshot = ctx.known_session.snapshot
                    ctx.span.set_attribute("kvshuttle.turn_index", snapshot.session.turn + 1 if snapshot else 1)
                self.check_length(req, ctx.prompt_ids, ctx.span)
                if ctx.quota is not None:
                    ctx.quota.charge_prompt(len(ctx.prompt_ids))
                await self._plan(ctx)
                if ctx.kv.decision == on_decode.DECISION:  # D serves the whole turn: no prefill
                    ctx.decode_params = on_decode.request_params()
                    return ctx

                async def prefill_on(plan: scheduler_pb2.PlanTurnResponse, attempt: int) -> None:
                    ctx.plan = plan
                    await prefilling.run(self, ctx, attempt)

                await self._prefill(ctx.id, ctx.plan, ctx.prompt_ids, ctx.kv, req, ctx.excluded, prefill_on)
                ctx.release = recording.release_unused_handle(self, ctx)
                return ctx
        except BaseException as exc:
            if ctx.quota is not None:
                ctx.quota.end(0)
            record_failure(ctx.span, exc)
            ctx.span.end()
            metrics.turn_failed(exc, req.model)
            raise

    async def decode(self, turn: TurnContext) -> AsyncIterator[Delta | Finished]:
        """The decode, parse and record stages: stream D's tokens as text deltas (with what they mean), record the
        session, then yield the summary.

        The consumer may resume this generator from another task (HTTP streaming), so no span is made current
        across a ``yield``; child spans name their parent explicitly.
        """
        answered = False
        try:
            parse, decode = parsing.Parsing(turn), decoding.Decoding(self, turn)
            lane = turn.express
            if lane.open:  # the API's front end and its response opened it: D's plain chunks may skip the iterators
                spell, write, events_of = lane.spell, lane.write, parse.answer.feed

                def deliver(delta: Delta) -> None:
                    delta.events = events_of(delta.text)  # parse.feed(delta), one call less
                    for frame in spell(delta):
                        write(frame)

                decode.open_express(lane.ready, deliver)
            async for delta in decode.first():
                yield parse.feed(delta)
            while True:  # the decode stage, resumed on another D each time one fails mid-answer
                try:
                    async for delta in decode.stream():
                        yield parse.feed(delta)
                    break
                except DecodeFailed as failed:
                    decode.resumed(await self._resume(turn, failed, decode.attempt))
            async for delta in decode.finish():
                yield parse.feed(delta)
            parse.finish()
            assert turn.final is not None
            on_decode.finished(self, turn)
            await recording.run(self, turn)
            turn.timings["total_ms"] = elapsed_ms(turn.started)
            req = turn.request
            event = Finished(turn.final.finish_reason, turn.text, turn.output_ids, len(turn.prompt_ids), turn.kv,
                             turn.timings, turn.output_logprobs if req.logprobs is not None else None,
                             turn.held_events, turn.answer)
            # the turn is done (a consumer may close this generator later)
            log_turn(turn, event)
            turn.span.set_attributes(finished_attributes(turn, event, req.model))
            turn.span.end()
            answered = True
            metrics.turn_answered(event, self.kv_bytes_per_token, turn.request.model)
            yield event
        except BaseException as exc:
            if turn.span.is_recording():
                record_failure(turn.span, exc)
            if not answered:
                metrics.turn_failed(exc, turn.request.model)
            raise
        finally:
            if turn.quota is not None:  # the tokens it generated count against its tenant's tokens per minute
                turn.quota.end(len(turn.output_ids))
            if turn.span.is_recording():
                turn.span.end()

    # -- the loops the stages leave to the runner: a stale snapshot, a failed P, a failed D ----------------------

    async def _plan(self, ctx: TurnContext) -> None:
        """The plan stage; when the scheduler finds the snapshot stale (another gateway changed the record), the
        record is read again, the prompt built again and the turn planned once more."""
        req = ctx.request
        try:
            await planning.run(self, ctx)
        except SnapshotStale:
            self.forget_record(req.tenant, req.session_id)
            await prompting.build(self, ctx, fresh=True)
            self.check_length(req, ctx.prompt_ids, ctx.span)
            await planning.run(self, ctx, settle=True)

    async def _prefill(self, turn_id: str, plan: scheduler_pb2.PlanTurnResponse, prompt_ids: list[int],
                       kv: KvOutcome, req: TurnRequest, excluded: list[str],
                       attempt_on: Callable[[scheduler_pb2.PlanTurnResponse, int], Awaitable[object]],
                       ) -> scheduler_pb2.PlanTurnResponse:
        """``attempt_on(plan, attempt)`` (a prefill) until one P does not fail: a failed P is excluded and the turn
        planned again without it (a recompute elsewhere), up to ``worker_retries`` times. Returns the plan that
        worked; TurnError (503) when none is left."""
        attempt = 0
        while True:
            try:
                await attempt_on(plan, attempt)
                return plan
            except WorkerDown as down:
                attempt += 1
                excluded.append(down.worker_id)
                metrics.worker_failed("prefill")
                failure = f"prefill worker {down.worker_id} failed ({down.error})"
                log.warning("turn %s: %s", turn_id, failure)
                trace.get_current_span().add_event("worker_failed", {"kvshuttle.worker": down.worker_id,
                                                                     "error": str(down.error)})
                if attempt > self.worker_retries:
                    kv.worker_failures.append(failure)
                    raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"{failure}; no retries left",
                                    retry_after_s=1) from None
                try:
                    plan = await planning.ask(self, req, prompt_ids, KnownSession(), exclude=excluded)
                except TurnError as exc:
                    kv.worker_failures.append(failure)
                    raise TurnError(exc.http_status, exc.code, f"{failure}; {exc.message}",
                                    exc.retry_after_s) from None
                kv.worker_failures.append(f"{failure}; recomputed on {plan.prefill.worker_id}")
                kv.decision, kv.reason = "recompute", f"{failure}: recomputed on another worker"
                kv.reason_code = why.WORKER_FAILED
                kv.prefill_worker_id, kv.decode_worker_id = plan.prefill.worker_id, plan.decode.worker_id

    async def _resume(self, ctx: TurnContext, failed: DecodeFailed, attempt: int) -> list[int]:
        """D failed mid-answer: prefill the prompt plus the tokens already generated on a live P (a recompute),
        point the turn at a new D, and return D's new prompt. The client's stream goes on where it stopped (with
        greedy sampling, exactly as if nothing happened). TurnError (503) when no retry or no worker is left."""
        output = ctx.output_ids
        ctx.excluded.append(failed.worker_id)
        metrics.worker_failed("decode")
        failure = f"decode worker {failed.worker_id} failed after {len(output)} tokens ({failed.error})"
        log.warning("turn %s: %s", ctx.id, failure)
        ctx.span.add_event("worker_failed", {"kvshuttle.worker": failed.worker_id, "error": str(failed.error),
                                             "kvshuttle.generated_tokens": len(output)})
        if attempt > self.worker_retries or (ctx.request.constraint is not None and output):
            # A constrained answer cannot go on elsewhere: a new D would start the grammar afresh mid-answer.
            why_not = "no retries left" if attempt > self.worker_retries else "a constrained answer cannot resume"
            ctx.kv.worker_failures.append(failure)
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"{failure}; {why_not}", retry_after_s=1)
        resume_ids = [*ctx.prompt_ids, *output]
        scratch = KvOutcome("recompute", "resume after a decode worker failed")
        resume_id = f"{ctx.id}-resume{attempt}"
        p_final: list[Final] = []

        async def prefill_on(plan: scheduler_pb2.PlanTurnResponse, tries: int) -> None:
            p_final[:] = [await prefilling.prefill(self, f"{resume_id}-{tries}" if tries else resume_id, plan,
                                                   resume_ids, scratch, ctx.request)]

        with trace.use_span(ctx.span, end_on_exit=False):
            try:
                plan = await planning.ask(self, ctx.request, resume_ids, KnownSession(), exclude=ctx.excluded)
                plan = await self._prefill(resume_id, plan, resume_ids, scratch, ctx.request, ctx.excluded,
                                           prefill_on)
            except TurnError as exc:
                ctx.kv.worker_failures.extend([*scratch.worker_failures, failure])
                raise TurnError(exc.http_status, exc.code, f"{failure}; {exc.message}", exc.retry_after_s) from None
        ctx.kv.worker_failures.extend(scratch.worker_failures)
        ctx.kv.worker_failures.append(f"{failure}; resumed on {plan.decode.worker_id} (prefilled "
                                      f"{len(resume_ids)} tokens on {plan.prefill.worker_id})")
        if ctx.kv.decision == on_decode.DECISION:  # the turn continued on D became a recompute on P and another D
            ctx.kv.decision, ctx.kv.reason_code = "recompute", why.WORKER_FAILED
            ctx.kv.reason = f"{failure}: recomputed on {plan.prefill.worker_id}"
            ctx.kv.prefill_worker_id = plan.prefill.worker_id
            ctx.kv.computed_tokens = len(resume_ids) - p_final[0].cached_tokens
        ctx.kv.decode_worker_id = plan.decode.worker_id
        ctx.plan, ctx.decode_params = plan, p_final[0].kv_transfer_params
        return resume_ids

    async def run(self, req: TurnRequest) -> tuple[TurnContext, Finished]:
        turn = await self.prepare(req)
        finished = None
        async for event in self.decode(turn):
            if isinstance(event, Finished):
                finished = event
        assert finished is not None
        return turn, finished

    async def end_session(self, tenant: str, session_id: str) -> tuple[bool, bool]:
        """Free the session's KV on its decode worker (when it has a usable handle), then delete its record.
        Returns (record deleted, KV freed)."""
        try:
            session_rules.validate_id("session_id", session_id)
        except session_rules.InvalidArgument as exc:
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self.forget_record(tenant, session_id)
        released = False
        try:
            record = (await self.registry.GetSession(registry_pb2.GetSessionRequest(
                session_id=session_id, tenant=tenant), timeout=self.control_timeout_s)).session
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False, False
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                            retry_after_s=1) from None
        if session_rules.freeable(record, len(record.head_token_ids), time.time()):
            first_block = list(record.head_token_ids[:record.block_size + 1])
            try:  # any live prefill worker of the session's model will do: ask the scheduler for one
                plan = await self.scheduler.PlanTurn(scheduler_pb2.PlanTurnRequest(
                    tenant=tenant, prompt_ids_packed=ids_bytes(first_block), disable_pull=True,
                    model=record.model or self.served_model),
                    timeout=self.control_timeout_s)
                released = await release_span(recording.free_handle(
                    self, f"end-{uuid.uuid4().hex[:16]}", record, plan.prefill, first_block, tenant, session_id))
            except grpc.aio.AioRpcError as exc:
                log.debug("ending a session: no prefill worker to free its KV (%s)", exc.code().name)
        try:
            deleted = await self.registry.DeleteSession(registry_pb2.DeleteSessionRequest(
                session_id=session_id, tenant=tenant), timeout=self.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                            retry_after_s=1) from None
        return deleted.deleted, released


_HASHER_BYTES = 512  # a kept digest state, about (a blake2b state and its key)


def log_turn(turn: TurnContext, event: Finished) -> None:
    """The turn's log line: its session (hashed), decision, tokens and record; and, when the client named them, whom
    it was for (user, safety_identifier)."""
    if not turn_log.isEnabledFor(logging.INFO):
        return
    req, kv = turn.request, turn.kv
    who = "".join(f" {name}={value!r}" for name, value in (("user", req.end_user),
                                                           ("safety_identifier", req.safety_identifier)) if value)
    turn_log.info("turn %s: model %s tenant %s session %s (%s) %s/%s, %d prompt tokens (%d pulled, %d computed), %d "
                  "generated, record %s%s", turn.id,
                  f"{req.model} (adapter of {req.base_model})" if req.base_model else req.model or "-", req.tenant,
                  hashed(req.session_id) if req.session_id else "-",
                  kv.session_source or "-", kv.decision, kv.reason_code, event.prompt_tokens, kv.pulled_tokens,
                  kv.computed_tokens, len(event.output_ids), kv.record or "-", who)


def _history_identity(session: common_pb2.Session) -> tuple:
    """What tells one recorded history from another of the same session (a later turn, a replaced lineage)."""
    return session.turn, session.history_tokens, session.history_generation, session.prefix_digest
