"""OpenAI-compatible routes of the gateway: /v1/chat/completions, /v1/completions, /v1/models, health.

The session (conversation) id comes from the `X-Session-ID` header or the body's `conversation_id`. Only the
scheduler decides what P pulls: a client's `kv_transfer_params` is a 400. Every response says what happened to the
KV (`X-KV-Decision`, `X-KV-Reason`, ... headers, and a `kvshuttle` object in the body / last stream chunk).

The handlers only translate the API's spelling (the bodies: models.py; the answer: stream.py): the turn's rules
(model, tools, constraint, parsing) are turns/builder.py's, what it reports turns/reply.py's. Errors are answered in
OpenAI's shape by the app's handlers (apis/http_app.py).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from kvshuttle.control_plane.constraints import Constraint
from kvshuttle.services.gateway.apis.openai.chat_answer import AnswerShape
from kvshuttle.services.gateway.apis.openai.chat_tools import NamedToolChoice
from kvshuttle.services.gateway.apis.openai.logprob_format import speller
from kvshuttle.services.gateway.apis.openai.models import ChatCompletionIn, CompletionIn, SamplingIn, logprobs_of
from kvshuttle.services.gateway.apis.openai.stream import CHAT, COMPLETION, Logprobs, Shape, error_tail, stream, usage
from kvshuttle.services.gateway.apis.openai.structured_output import requested_constraint
from kvshuttle.services.gateway.apis.request_model import session_id_of
from kvshuttle.services.gateway.apis.state import api_state, prepare_turn
from kvshuttle.services.gateway.edge.api_errors import SESSION_HEADER, TURN_RESPONSES
from kvshuttle.services.gateway.edge.http_entry import GatewayRoute
from kvshuttle.services.gateway.edge.http_guard import caller
from kvshuttle.services.gateway.edge.sse import stream_response
from kvshuttle.services.gateway.turns import TurnRequest
from kvshuttle.services.gateway.turns.catalog import ServedModel
from kvshuttle.services.gateway.turns.reply import Usage, drain, kv_body, kv_headers
from kvshuttle.services.gateway.turns.tools import NamedTool, check_tool_results

router = APIRouter(route_class=GatewayRoute)  # input_check on every body, and a JSON 500 for what nothing else answers


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """Up; ``degraded`` counts the turns served without the session store (registry/etcd unreachable)."""
    degraded: dict[str, int] = {}
    for served in api_state(request).models:
        for kind, n in served.runner.degraded.items():
            degraded[kind] = degraded.get(kind, 0) + n
    return {"status": "ok", "degraded": degraded}


@router.get("/v1/models", responses={401: TURN_RESPONSES[401]})
async def models(request: Request) -> dict[str, Any]:
    """The served models as vLLM lists them: ``root`` (its name here: the model's path stays on the workers),
    ``parent`` (an adapter's base model; None for a base model) and ``max_model_len``."""
    return {"object": "list", "data": [{
        "id": served.name, "object": "model", "created": 0, "owned_by": "kvshuttle", "root": served.name,
        "parent": served.parent or None, "max_model_len": served.runner.max_model_len}
        for served in api_state(request).models.usable(caller(request).models)]}


@router.post("/v1/chat/completions", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
async def chat(body: ChatCompletionIn, request: Request):
    served = api_state(request).model(body.model, caller(request))
    builder, choice = served.builder, body.tool_choice
    tenant = caller(request).tenant
    tools = builder.tools([t.function for t in body.tools or []],
                          NamedTool(choice.function.name) if isinstance(choice, NamedToolChoice) else choice,
                          parallel=body.parallel_tool_calls, tenant=tenant)
    messages = [m.plain(f"messages.{i}") for i, m in enumerate(body.messages)]
    check_tool_results(messages)
    asked, param = _structured(body, tenant)
    req = _turn_request(served, body, request, body.max_completion_tokens or body.max_tokens, messages=messages,
                        template_vars=body.template_vars(), constraint=builder.constraint(asked, param, tools),
                        tools=tools, constraint_after_reasoning=body.structured_outputs is None)
    answer = AnswerShape(parsed=builder.parsers.reasoning is not None or tools.calls,
                         parallel_tool_calls=body.parallel_tool_calls, include_reasoning=body.include_reasoning)
    return await _respond(request, served, body, req, CHAT, answer)


@router.post("/v1/completions", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
async def completions(body: CompletionIn, request: Request):
    served = api_state(request).model(body.model, caller(request))
    prompt = {"prompt_text": body.prompt} if isinstance(body.prompt, str) else {"prompt_ids": body.prompt}
    asked, param = _structured(body, caller(request).tenant)
    constraint = served.builder.constraint(asked, param)
    req = _turn_request(served, body, request, body.max_tokens, constraint=constraint,
                        constraint_after_reasoning=False, **prompt)
    return await _respond(request, served, body, req, COMPLETION)


def _turn_request(served: ServedModel, body: SamplingIn, request: Request, max_tokens: int | None,
                  **prompt: Any) -> TurnRequest:
    builder = served.builder
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    session = session_id_of(request.headers, body.conversation_id)
    who = caller(request)  # the tenant comes from the API key only (no identity: 401)
    return builder.request(session_id=session, tenant=who.tenant, max_tokens=max_tokens,
                           temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                           ignore_eos=body.ignore_eos, stop=stop, disable_pull=body.disable_pull,
                           policy=body.policy, logprobs=logprobs_of(body), cache_key=body.prompt_cache_key or "",
                           end_user=body.user or "", safety_identifier=body.safety_identifier or "",
                           **body.sampling(), **prompt)


def _structured(body: SamplingIn, tenant: str) -> tuple[Constraint | None, str]:
    """The structured output the body asks for, and the field that asked."""
    return (requested_constraint(body.response_format, body.structured_outputs, tenant=tenant),
            "response_format" if body.response_format else "structured_outputs")


async def _respond(request: Request, served: ServedModel, body: SamplingIn, req: TurnRequest, shape: Shape,
                   answer: AnswerShape | None = None):
    runner, served_model = served.runner, served.name
    turn = await prepare_turn(request, req)
    answer = answer or AnswerShape()
    lps = Logprobs(speller(runner.tokenizer), runner.hidden_token_ids(req)) if req.logprobs is not None else None
    ids = bool(body.return_token_ids)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return stream_response(stream(runner, turn, served_model, include_usage, shape, answer, lps, ids),
                               turn, error_tail)
    finished = await drain(runner, turn)
    if shape.chat:
        message, _ = answer.message(finished.text, finished.answer_events)
        choice = {"index": 0, "message": message, "finish_reason": answer.finish_reason(finished.finish_reason),
                  "logprobs": lps.chat(finished.logprobs) if lps else None}
    else:
        choice = shape.choice(finished.text, finished.finish_reason,
                              lps.completion(finished.logprobs) if lps else None)
    token_ids = {"prompt_token_ids": list(turn.prompt_ids)} if ids else {}
    if ids:
        choice["token_ids"] = list(finished.output_ids)
    return JSONResponse({
        "id": turn.id, "object": shape.object, "created": int(time.time()), "model": served_model,
        "choices": [choice], "usage": usage(Usage.of(finished)), **token_ids,
        "kvshuttle": kv_body(finished.kv, finished.timings, turn.request),
    }, headers={**kv_headers(finished.kv), "X-Session-ID": req.session_id})
