"""Stage 3, the prefill on P: pull the session's KV from its decode worker (or compute it), then hand D its
kv_transfer_params. A failed pull is retried once as a recompute on the same P; a failed P is WorkerDown (the runner
plans again without it); the scheduler learns what the prefill cost."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import grpc
from kvshuttle.control_plane import kv_params
from kvshuttle.control_plane import reasons as why
from kvshuttle.services.engine.client import EngineError, Final
from kvshuttle.services.gateway.turns.context import KvOutcome, TurnContext, elapsed_ms
from kvshuttle.services.gateway.turns.errors import TurnError, WorkerDown
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.spans import tracer
from kvshuttle.v1 import scheduler_pb2

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.services import TurnServices

log = logging.getLogger(__name__)


async def run(rt: TurnServices, ctx: TurnContext, attempt: int = 0) -> None:
    """Prefills ``ctx`` on the planned P; sets ``ctx.decode_params``, the KV figures and, when D may continue after
    it, P's first token. WorkerDown when P failed (``attempt``: how many P failed before in this turn)."""
    req, kv = ctx.request, ctx.kv
    t = time.perf_counter()
    p_final = await prefill(rt, f"{ctx.id}-{attempt}" if attempt else ctx.id, ctx.plan, ctx.prompt_ids, kv, req)
    ctx.timings["prefill_ms"] = elapsed_ms(t)
    kv.computed_tokens = len(ctx.prompt_ids) - p_final.cached_tokens
    # what P loaded over NIXL (its own prefix cache may have held the start of the history); a worker that does not
    # say (no kvshuttle plugin): what the pull covered
    loaded = kv_params.take_loaded_tokens(p_final.kv_transfer_params, p_final.cached_tokens)
    kv.pulled_tokens = (ctx.plan.figures.reusable_tokens if loaded is None else loaded) if kv.decision == "pull" else 0
    report(rt, ctx.plan, kv, len(ctx.prompt_ids), ctx.timings["prefill_ms"], req.session_id, req.tenant,
           req.base_model or req.model)
    ctx.span.set_attributes({"kvshuttle.pulled_tokens": kv.pulled_tokens,
                             "kvshuttle.computed_tokens": kv.computed_tokens,
                             "kvshuttle.retried_as_recompute": kv.retried_as_recompute,
                             "kvshuttle.decision": kv.decision, "kvshuttle.reason": kv.reason,
                             "kvshuttle.reason_code": kv.reason_code,
                             "kvshuttle.prefill_worker": kv.prefill_worker_id,
                             "kvshuttle.decode_worker": kv.decode_worker_id,
                             "kvshuttle.prefill_ms": ctx.timings["prefill_ms"],
                             "gen_ai.usage.input_tokens": len(ctx.prompt_ids),
                             "gen_ai.usage.cache_read.input_tokens": len(ctx.prompt_ids) - kv.computed_tokens})
    if rt.kv_bytes_per_token:
        ctx.span.set_attribute("kvshuttle.pulled_kv_bytes", kv.pulled_tokens * rt.kv_bytes_per_token)
    ctx.decode_params = p_final.kv_transfer_params
    # Stop strings are matched by D on what it generates; one starting inside the first token would be missed.
    # Presence/frequency penalties count the answer's tokens, and D's answer would not hold P's token. Either
    # way D samples the first token itself. D's prompt grows by P's token: P's handle must list a block for it
    # (see covers_extra_token).
    # A constraint (grammar) must hold from the answer's first token: D, which applies it, samples that token too.
    if (rt.first_token_from_prefill and not req.stop and not req.penalizes_output and req.constraint is None
            and p_final.output_ids
            and kv_params.covers_extra_token(p_final.kv_transfer_params, len(ctx.prompt_ids),
                                             ctx.plan.decode.block_size)):
        ctx.first_token, ctx.first_finish = p_final.output_ids[-1], p_final.finish_reason
        ctx.first_logprob = p_final.logprobs[-1] if p_final.logprobs else None


async def prefill(rt: TurnServices, turn_id: str, plan: scheduler_pb2.PlanTurnResponse, prompt_ids: list[int],
                  kv: KvOutcome, req: TurnRequest) -> Final:
    """P's prefill (a failed pull is run once more as a recompute on the same P). WorkerDown when P failed."""
    engine = rt.engine(plan.prefill)
    worker = plan.prefill.worker_id
    # P samples at most the answer's first token: with min_tokens it must not end the answer there.
    sampling = {**req.engine_sampling(), "min_tokens": min(req.min_tokens, 1), "timeout_s": rt.prefill_timeout_s,
                "cache_salt": rt.cache_salt(req.tenant)}
    params = json.loads(plan.prefill_kv_transfer_params_json)
    with tracer.start_as_current_span("prefill") as span:
        span.set_attributes({"kvshuttle.worker": worker, "kvshuttle.decision": kv.decision})
        try:
            final = await engine.prefill(f"{turn_id}-p", prompt_ids, kv_transfer_params=params, **sampling)
            if final.finish_reason != "error":
                span.set_attribute("kvshuttle.cached_tokens", final.cached_tokens)
                return final
            failure = "prefill finished with error"
        except EngineError as exc:
            failure = f"prefill failed: {exc}"
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT and kv.decision != "pull":
                raise refused(exc) from None
            if kv.decision != "pull":
                raise WorkerDown(worker, exc) from None
        if kv.decision != "pull":  # a recompute that finished with error: P's engine is not well
            raise WorkerDown(worker, EngineError(None, failure))
        # A failed pull (stale handle, decode worker gone): the same turn once more, computing everything.
        log.warning("pull failed for turn %s (%s); retrying as recompute", turn_id, failure)
        span.add_event("pull_failed", {"error": failure})
        kv.decision, kv.retried_as_recompute = "recompute", True
        kv.reason, kv.reason_code = f"pull failed ({failure}); retried as recompute", why.PULL_FAILED
        try:
            final = await engine.prefill(f"{turn_id}-r", prompt_ids,
                                         kv_transfer_params=kv_params.prefill_request_params(), **sampling)
        except EngineError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise refused(exc) from None
            raise WorkerDown(worker, exc) from None
        if final.finish_reason == "error":
            raise WorkerDown(worker, EngineError(None, "prefill finished with error"))
        return final


def refused(exc: EngineError) -> TurnError:
    """The engine found the request itself invalid (a client error that the gateway's own checks let through)."""
    return TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"the prefill worker refused the request: {exc.message}")


def report(rt: TurnServices, plan: scheduler_pb2.PlanTurnResponse, kv: KvOutcome, prompt_tokens: int,
           prefill_ms: float, session_id: str = "", tenant: str = "", model: str = "") -> None:
    """Tell the scheduler what the prefill cost (its cost model learns from it, per base ``model``); off the turn's
    path."""
    request = scheduler_pb2.ReportOutcomeRequest(
        prefill_worker_id=plan.prefill.worker_id, decode_worker_id=plan.decode.worker_id,
        prompt_tokens=prompt_tokens, pulled_tokens=kv.pulled_tokens, computed_tokens=kv.computed_tokens,
        prefill_ms=prefill_ms, source_worker_id=plan.source.worker_id,
        pullable_tokens=plan.figures.pullable_tokens, policy=plan.figures.policy,
        cached_tokens_estimate=plan.figures.cached_tokens_estimate, session_id=session_id, tenant=tenant, model=model,
        decision=scheduler_pb2.DECISION_PULL if kv.decision == "pull" else scheduler_pb2.DECISION_RECOMPUTE)
    send_outcome(rt, request)


def send_outcome(rt: TurnServices, request: scheduler_pb2.ReportOutcomeRequest) -> None:
    """ReportOutcome in the background: a lost report costs the cost model one observation, never the turn."""

    async def send() -> None:
        try:
            await rt.scheduler.ReportOutcome(request, timeout=rt.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("could not report a turn's outcome (%s)", exc.code().name)

    rt.background(send())
