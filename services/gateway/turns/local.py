"""A turn continued on D (the plan's DECISION_LOCAL): the decode worker holding the session's KV serves the whole turn.

No prefill worker and no transfer: the gateway sends D the exact prompt ids as an ordinary request whose
``kv_transfer_params`` set neither remote flag (:func:`request_params`). vLLM's NIXL connector then treats it as a
decode-side request: the prompt's cached prefix comes from D's own prefix cache (the blocks it holds for the
session, matched token for token by vLLM's block hashes and the tenant's ``cache_salt``), the rest is computed
within D's batch, and D hands back a handle for the next turn exactly as after a disaggregated turn.

The plan claimed the session's previous handle (a concurrent fork recomputes). Once D has answered (its request then
holds the history's blocks itself), that handle is freed with a one-block read on the plan's prefill worker, as the
gateway frees any unused handle (record.py), and the scheduler learns what the turn cost on D.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvshuttle.control_plane import kv_params
from kvshuttle.services.engine.client import EngineError
from kvshuttle.services.gateway.turns.context import TurnContext
from kvshuttle.services.gateway.turns.prefill import send_outcome
from kvshuttle.v1 import scheduler_pb2

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.services import TurnServices

log = logging.getLogger(__name__)

DECISION = "local"


def request_params() -> dict[str, Any]:
    """D's ``kv_transfer_params`` for a turn it serves alone: not empty (vLLM's connector ignores a request without
    params, and would hand back no handle), and neither ``do_remote_prefill`` (nothing is read from a remote) nor
    ``do_remote_decode`` (D keeps the KV itself)."""
    return {"kvshuttle_local": True}


def finished(rt: TurnServices, ctx: TurnContext) -> None:
    """After D's final message: the turn's KV figures from D's own counters, the report to the scheduler, and the
    session's previous handle freed; the last two off the turn's path."""
    final, kv = ctx.final, ctx.kv
    if final is None or kv.decision != DECISION:
        return
    # What D's prefix cache held of the prompt, by D's own count: never assumed from the record.
    d_prompt = len(ctx.prompt_ids)
    kv.computed_tokens = max(0, d_prompt - final.cached_tokens)
    ctx.span.set_attributes({"kvshuttle.computed_tokens": kv.computed_tokens,
                             "kvshuttle.decode_cached_tokens": final.cached_tokens,
                             "gen_ai.usage.input_tokens": d_prompt,
                             "gen_ai.usage.cache_read.input_tokens": final.cached_tokens})
    first_ms = ctx.timings.get("prefill_ms")  # D's request to its first token: the prefill on D
    if first_ms is not None:
        ctx.span.set_attribute("kvshuttle.prefill_ms", first_ms)
        _report(rt, ctx, first_ms)
    _free_previous(rt, ctx)


def _report(rt: TurnServices, ctx: TurnContext, first_ms: float) -> None:
    plan, kv, req = ctx.plan, ctx.kv, ctx.request
    request = scheduler_pb2.ReportOutcomeRequest(
        prefill_worker_id=plan.prefill.worker_id, decode_worker_id=plan.decode.worker_id,
        prompt_tokens=len(ctx.prompt_ids), pulled_tokens=0, computed_tokens=kv.computed_tokens, prefill_ms=first_ms,
        source_worker_id=plan.decode.worker_id, pullable_tokens=plan.figures.pullable_tokens,
        policy=plan.figures.policy, session_id=req.session_id, tenant=req.tenant,
        decode_streams=plan.figures.decode_streams, decision=scheduler_pb2.DECISION_LOCAL,
        model=req.base_model or req.model)
    send_outcome(rt, request)


def _free_previous(rt: TurnServices, ctx: TurnContext) -> None:
    """Free the handle the plan claimed (D's request for this turn now holds the history's blocks itself): a
    one-block read on the plan's prefill worker. Without the record's handle here (the scheduler read the record,
    not this gateway) it stays until its TTL."""
    snapshot = ctx.known_session.snapshot
    record = snapshot.session if snapshot is not None else None
    if record is None or not record.kv_transfer_params_json or not rt.release_unused_handles:
        return
    try:
        params, prompt = kv_params.free_read(kv_params.parse_handle(record.kv_transfer_params_json), ctx.prompt_ids,
                                             record.block_size)
    except kv_params.HandleError as exc:
        log.debug("turn %s: the previous handle cannot be freed (%s)", ctx.id, exc)
        return
    n = len(prompt) - 1
    if len(record.head_token_ids) < n or prompt[:n] != list(record.head_token_ids[:n]):
        return  # the prompt's first block is not the handle's: P must not take D's KV for it
    engine, tenant, adapter = rt.engine(ctx.plan.prefill), ctx.request.tenant, ctx.request.adapter

    async def free() -> None:
        try:
            if await engine.read_to_free(f"{ctx.id}-release", prompt, params, timeout_s=rt.prefill_timeout_s,
                                         cache_salt=rt.cache_salt(tenant), adapter=adapter):
                rt.released_handles += 1
        except EngineError as exc:
            log.debug("turn %s: could not free the previous KV handle: %s", ctx.id, exc)

    rt.background(free())
