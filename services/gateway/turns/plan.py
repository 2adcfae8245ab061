"""Stage 2, the plan: the scheduler picks P and D and decides pull, recompute or continue on D (from the session snapshot the
prompt stage read, which it checks against its own view). A stale snapshot is SnapshotStale: the runner reads the
record again and plans once more."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.constraints import after_reasoning
from kvshuttle.control_plane.prefix import ids_bytes
from kvshuttle.services.common.telemetry import hashed
from kvshuttle.services.gateway.turns.context import KnownSession, KvOutcome, TurnContext, elapsed_ms
from kvshuttle.services.gateway.turns.errors import SnapshotStale, TurnError
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.spans import predicted_ttft, tracer
from kvshuttle.v1 import scheduler_pb2

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.services import TurnServices

log = logging.getLogger(__name__)
DECISIONS = {scheduler_pb2.DECISION_PULL: "pull", scheduler_pb2.DECISION_RECOMPUTE: "recompute",
             scheduler_pb2.DECISION_LOCAL: "local"}
CLAIMING = (scheduler_pb2.DECISION_PULL, scheduler_pb2.DECISION_LOCAL)  # plans that claimed the session's handle


async def run(rt: TurnServices, ctx: TurnContext, *, settle: bool = False) -> None:
    """Sets ``ctx.plan`` and ``ctx.kv``; places the request's constraint after the reasoning the prompt leaves room
    for (the rendered prompt is known now). SnapshotStale when the scheduler says the snapshot is out of date,
    unless ``settle`` (the second plan, on a record read afresh: taken as it is)."""
    req = ctx.request
    t = time.perf_counter()
    plan = await ask(rt, req, ctx.prompt_ids, ctx.known_session)
    ctx.timings["plan_ms"] = ctx.timings.get("plan_ms", 0.0) + elapsed_ms(t)
    if plan.figures.snapshot_stale and not settle:
        raise SnapshotStale()
    if plan.decision in CLAIMING:  # the claim consumed the record we hold
        rt.forget_record(req.tenant, req.session_id)
    if req.constraint is not None and req.reasoning_tags is not None and ctx.prompt_text:
        req.constraint = after_reasoning(req.constraint, req.reasoning_tags, ctx.prompt_text)
        req.reasoning_tags = None  # placed
    if plan.decision == scheduler_pb2.DECISION_RECOMPUTE and plan.reason.startswith(session_rules.STORE_UNAVAILABLE):
        rt.degraded["recomputed_store_unavailable"] += 1
        log.warning("turn %s recomputes without the session store: %s (%d such turns)", ctx.id, plan.reason,
                    rt.degraded["recomputed_store_unavailable"])
    ctx.plan = plan
    local = plan.decision == scheduler_pb2.DECISION_LOCAL
    ctx.kv = KvOutcome(DECISIONS.get(plan.decision, "recompute"), plan.reason,
                       prefill_worker_id="" if local else plan.prefill.worker_id,
                       decode_worker_id=plan.decode.worker_id, figures=plan.figures, reason_code=plan.reason_code,
                       session_source=req.session_source, session_id=req.session_id)
    ctx.span.set_attributes({
        "kvshuttle.session": hashed(req.session_id) if req.session_id else "",
        "kvshuttle.session_source": req.session_source, "kvshuttle.decision": ctx.kv.decision,
        "kvshuttle.reason": plan.reason, "kvshuttle.reason_code": ctx.kv.reason_code,
        "kvshuttle.prompt_tokens": len(ctx.prompt_ids), "kvshuttle.continued_ids": ctx.continued,
        "kvshuttle.history_kept_tokens": ctx.history_kept,
        "kvshuttle.history_match_tokens": ctx.known_session.history_match_tokens,
        "kvshuttle.reusable_tokens": plan.figures.reusable_tokens,
        "kvshuttle.prefill_worker": plan.prefill.worker_id, "kvshuttle.decode_worker": plan.decode.worker_id,
        "kvshuttle.policy": plan.figures.policy, **predicted_ttft(plan),
    })


async def ask(rt: TurnServices, req: TurnRequest, prompt_ids: list[int], known_session: KnownSession, *,
              exclude: Sequence[str] = ()) -> scheduler_pb2.PlanTurnResponse:
    """The scheduler's plan. With ``exclude`` (workers that failed in this turn) it is a re-plan: the session's
    handle is not used (the failed attempt claimed it) and those workers are not chosen."""
    with tracer.start_as_current_span("plan"):
        try:
            return await rt.scheduler.PlanTurn(scheduler_pb2.PlanTurnRequest(
                session_id=req.session_id, tenant=req.tenant, prompt_ids_packed=ids_bytes(prompt_ids),
                disable_pull=req.disable_pull or bool(exclude), policy=req.policy,
                exclude_worker_ids=list(exclude), max_tokens=req.room_tokens(rt.answer_room_tokens),
                cache_salt=rt.cache_salt(req.tenant), model=req.model,
                **known_session.plan_fields()),
                timeout=rt.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise TurnError(400, exc.code(), exc.details() or "invalid request") from None
            what = "scheduler" if exc.code() != grpc.StatusCode.UNAVAILABLE or not exclude else "no worker left"
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE,
                            f"{what}: {exc.details() or exc.code().name}", retry_after_s=1) from None
