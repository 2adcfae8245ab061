"""The turn span's attributes (OpenTelemetry's GenAI ones and kvshuttle's) and how a failed turn is recorded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from kvshuttle.services.common.telemetry import QuietTracer, hashed
from kvshuttle.services.gateway.turns.context import Finished, TurnContext
from kvshuttle.services.gateway.turns.errors import TurnError
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.v1 import scheduler_pb2
from opentelemetry import trace

tracer = QuietTracer("kvshuttle.gateway")


def request_attributes(req: TurnRequest, model: str) -> dict[str, Any]:
    """The turn span's request attributes: OpenTelemetry's GenAI ones, the tenant and the session id (hashed)."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if req.messages is not None else "text_completion",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.temperature": req.temperature, "gen_ai.request.top_p": req.top_p,
        "kvshuttle.tenant": req.tenant, "kvshuttle.session": hashed(req.session_id) if req.session_id else "",
    }
    if model:
        attrs["gen_ai.request.model"] = model
    if req.base_model:  # a LoRA adapter's turn (gen_ai.request.model names the adapter): its base model
        attrs["kvshuttle.base_model"] = req.base_model
    if req.max_tokens is not None:  # none asked: set once the prompt's length decides it (limit_attributes)
        attrs["gen_ai.request.max_tokens"] = req.max_tokens
    if req.seed is not None:
        attrs["gen_ai.request.seed"] = req.seed
    # The other GenAI request attributes the conventions define, when the request sets them.
    if req.top_k > 0:
        attrs["gen_ai.request.top_k"] = float(req.top_k)  # a double in the conventions
    if req.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = req.frequency_penalty
    if req.stop:
        attrs["gen_ai.request.stop_sequences"] = list(req.stop)
    if req.disable_pull:
        attrs["kvshuttle.disable_pull"] = True
    if req.end_user:  # who the turn is for, as the client said (OpenAI's user, Anthropic's metadata.user_id)
        attrs["user.id"] = req.end_user
    if req.safety_identifier:
        attrs["kvshuttle.safety_identifier"] = req.safety_identifier
    if req.cache_key:
        attrs["kvshuttle.prompt_cache_key"] = hashed(req.cache_key)
    return attrs


def limit_attributes(req: TurnRequest) -> dict[str, Any]:
    """The answer's limit once the prompt's length is known, and where it came from (TurnRequest.max_tokens_source)."""
    return {"gen_ai.request.max_tokens": req.max_tokens, "kvshuttle.max_tokens_source": req.max_tokens_source}


def predicted_ttft(plan: scheduler_pb2.PlanTurnResponse) -> dict[str, float]:
    """The scheduler's predicted time from the plan to the first token (its wait at P + the chosen option's prefill;
    a turn continued on D: D's predicted time), when it predicted one."""
    fig = plan.figures
    if plan.decision == scheduler_pb2.DECISION_LOCAL:
        return {"kvshuttle.predicted_ttft_ms": round(fig.predicted_local_ms, 3)} if fig.predicted_local_ms else {}
    prefill_ms = fig.predicted_pull_ms if plan.decision == scheduler_pb2.DECISION_PULL else fig.predicted_recompute_ms
    return {"kvshuttle.predicted_ttft_ms": round(fig.predicted_wait_ms + prefill_ms, 3)} if prefill_ms > 0 else {}


def finished_attributes(turn: TurnContext, finished: Finished, model: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.response.id": turn.id, "gen_ai.response.finish_reasons": [finished.finish_reason],
        "gen_ai.usage.output_tokens": len(finished.output_ids), "kvshuttle.decode_worker": finished.kv.decode_worker_id,
        "kvshuttle.ttft_ms": finished.timings.get("ttft_ms", 0.0),
    }
    if model:
        attrs["gen_ai.response.model"] = model
    return attrs


def record_failure(span, exc: BaseException) -> None:
    """A turn that failed: the exception as an event and ``error.type``; the status is ERROR unless the caller's
    request was at fault (a TurnError under 500, e.g. a prompt over the context length)."""
    if isinstance(exc, TurnError):
        kind = exc.code.name
    elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        kind = "cancelled"  # the client went away
    else:
        kind = type(exc).__qualname__
    span.set_attribute("error.type", kind)
    span.record_exception(exc)
    if not (isinstance(exc, TurnError) and exc.http_status < 500):
        span.set_status(trace.StatusCode.ERROR, exc.message if isinstance(exc, TurnError) else f"{kind}: {exc}")


async def release_span(freeing: Awaitable[bool]) -> bool:
    """Freeing a session's unused KV handle, as a ``release`` span (claim + P's read of its first block)."""
    with tracer.start_as_current_span("release") as span:
        released = await freeing
        span.set_attribute("kvshuttle.released", released)
        return released
