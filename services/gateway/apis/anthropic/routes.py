"""Anthropic's Messages API on the gateway: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, the protocol
Claude-Code-style coding agents speak (the official ``anthropic`` SDK, streaming or not).

A thin translator onto the same turn runner as the OpenAI chat route: the request becomes the chat messages, template
variables and forced-call constraint the chat route would build for the same conversation (prompt.py), and the
answer is parsed by the same reasoning and tool-call parsers, then spelled as Anthropic's content blocks (blocks.py).
The session is the ``X-Session-ID`` header's; without one, the runner finds the session by the prompt's content.
``thinking.budget_tokens`` cannot be enforced (no way to stop the reasoning early on the workers): it is taken when
``max_tokens`` bounds it anyway (``budget_tokens >= max_tokens - 1``, as Claude Code sends it) and refused, naming it,
when smaller. The ``X-KV-*`` headers and a ``kvshuttle`` object (in the streamed ``message_delta``) say what happened
to the KV, as on the chat route.

Errors are Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), also for a bad body (a field this
gateway does not apply is a 400 naming it, as on the OpenAI routes) and for a turn that fails mid-stream (an ``error``
event).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from kvshuttle.services.gateway.apis.anthropic.blocks import ContentBlocks, stop_reason, usage
from kvshuttle.services.gateway.apis.anthropic.models import CountTokensIn, MessagesIn
from kvshuttle.services.gateway.apis.anthropic.prompt import chat_messages, chat_tools, template_vars
from kvshuttle.services.gateway.apis.request_model import session_id_of
from kvshuttle.services.gateway.apis.state import api_state, prepare_turn
from kvshuttle.services.gateway.edge.api_errors import ANTHROPIC_ERRORS, SESSION_HEADER, anthropic_error_body
from kvshuttle.services.gateway.edge.http_entry import GatewayRoute
from kvshuttle.services.gateway.edge.http_guard import caller
from kvshuttle.services.gateway.edge.input_check import InputError
from kvshuttle.services.gateway.edge.sse import frame, stream_response
from kvshuttle.services.gateway.tokens import off_loop
from kvshuttle.services.gateway.turns import Delta, TurnContext, TurnError, TurnRunner
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.reply import Usage, drain, kv_body, kv_headers
from kvshuttle.services.gateway.turns.tools import ANTHROPIC_TOOLS, ToolUse, check_tools, template_tools
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

# -- errors ---------------------------------------------------------------------------------------------------------


def anthropic_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=dict(headers or {}))


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'invalid')})")
            continue
        parts.append(f"{where or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


class AnthropicRoute(GatewayRoute):
    """A route whose every error is Anthropic-shaped: the body's validation (FastAPI's own handler answers in
    OpenAI's shape), bad tools and history, failed turns, input_check's refusals, unexpected errors."""

    def refusal(self, exc: InputError) -> Response:
        return anthropic_error(400, str(exc))

    def internal_error(self) -> Response:
        return anthropic_error(500, "internal error")

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return anthropic_error(400, _validation_message(list(exc.errors())))
            except FieldError as exc:
                return anthropic_error(400, f"{exc.param}: {exc}")
            except TurnError as exc:
                return anthropic_error(exc.http_status, exc.message,
                                       {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None)
            except StarletteHTTPException as exc:
                return anthropic_error(exc.status_code, str(exc.detail), exc.headers)
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                return anthropic_error(500, "internal error")

        return route


MESSAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The message; with `stream: true`, server-sent events (message_start, content blocks, "
                         "message_delta, message_stop)",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    **ANTHROPIC_ERRORS}


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return frame(payload, kind)


# -- the routes -----------------------------------------------------------------------------------------------------

router = APIRouter(route_class=AnthropicRoute, tags=["anthropic"])


def add_anthropic_routes(app: FastAPI) -> None:
    """Adds the Messages API to the gateway's app (create_app's: its ApiState's models and parsers; "" parsers
    leave that part unparsed, and a request with tools is then refused unless tool_choice is none). Its
    ``default_max_tokens`` is not used: Anthropic's ``max_tokens`` is required."""
    app.include_router(router)


@router.post(MESSAGES_PATH, responses=MESSAGE_RESPONSES, openapi_extra=SESSION_HEADER)
async def messages(body: MessagesIn, request: Request) -> Response:
    """Anthropic's Messages API (Claude-Code-style agents): one assistant turn, streamed or whole."""
    served = api_state(request).model(body.model, caller(request), required=True)
    builder, runner, served_model = served.builder, served.runner, served.name
    budget = getattr(body.thinking, "budget_tokens", None)
    if budget is not None and budget < body.max_tokens - 1:
        raise FieldError("thinking.budget_tokens", f"thinking.budget_tokens {budget} cannot be enforced (the "
                                                   "workers cannot stop the reasoning early): send max_tokens - 1 "
                                                   f"({body.max_tokens - 1}), or thinking {{\"type\": "
                                                   "\"adaptive\"}")
    functions, choice, parallel = chat_tools(body)
    tools = builder.tools(functions, choice, ANTHROPIC_TOOLS, parallel=parallel, tenant=caller(request).tenant)
    messages = chat_messages(body)
    if body.messages[-1].role == "assistant":
        raise FieldError(f"messages.{len(body.messages) - 1}", "a final assistant message (prefill) is not "
                                                                "supported: end with a user message")
    stop = list(body.stop_sequences or [])
    who = caller(request)  # the tenant comes from the API key only (no identity: 401)
    req = builder.request(tools, session_id=session_id_of(request.headers), tenant=who.tenant,
                          messages=messages, template_vars=template_vars(body, tools), max_tokens=body.max_tokens,
                          temperature=body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
                          top_k=body.top_k or 0, stop=stop, constraint=builder.constraint(None, "", tools),
                          end_user=(body.metadata.user_id if body.metadata else None) or "")
    turn = await prepare_turn(request, req)
    blocks = ContentBlocks(parallel)
    if body.stream:
        return stream_response(_stream(runner, turn, served_model, blocks, stop), turn, _error_tail,
                               **{"request-id": turn.id})
    finished = await drain(runner, turn)
    blocks.finish(finished.answer_events)
    reason, sequence = stop_reason(finished.finish_reason, finished.text, stop, bool(blocks.calls))
    return JSONResponse({
        "id": f"msg_{turn.id}", "type": "message", "role": "assistant", "model": served_model,
        "content": blocks.content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage(Usage.of(finished)),
        "kvshuttle": kv_body(finished.kv, finished.timings, turn.request),
    }, headers={**kv_headers(finished.kv), "X-Session-ID": req.session_id, "request-id": turn.id})


@router.post(COUNT_TOKENS_PATH, responses={200: {"description": "The prompt's tokens",
                                                 "content": {"application/json": {"schema": {
                                                     "type": "object", "required": ["input_tokens"],
                                                     "properties": {"input_tokens": {"type": "integer"}}}}}},
                                           **ANTHROPIC_ERRORS})
async def count_tokens(body: CountTokensIn, request: Request) -> Response:
    """The prompt's tokens for the same body, as /v1/messages would render it (no turn runs)."""
    served = api_state(request).model(body.model, caller(request), required=True)
    functions, choice, _ = chat_tools(body)
    # counted as rendered, whatever the gateway parses
    check_tools(functions, choice, ANTHROPIC_TOOLS, tenant=caller(request).tenant)
    tools = ToolUse(template_tools(functions))
    messages = chat_messages(body)
    tokenizer = served.runner.tokenizer
    try:
        text = await off_loop.render_chat(tokenizer, messages, **template_vars(body, tools))
    except Exception as exc:  # template errors are the caller's input
        raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"cannot render chat: {exc}") from None
    ids = await off_loop.encode(tokenizer, text)
    return JSONResponse({"input_tokens": len(ids)})


async def _stream(runner: TurnRunner, turn: TurnContext, model: str, blocks: ContentBlocks,
                  stop: list[str]) -> AsyncIterator[bytes]:
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": f"msg_{turn.id}", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage(Usage.at(len(turn.prompt_ids), 0, turn.kv))}})

    def spell(event: Delta) -> list[bytes]:  # a delta's events (the express lane's too: context.ExpressLane)
        return [_sse(kind, payload) for kind, payload in blocks.feed(event.events)]

    turn.express.spell = spell
    async for event in runner.decode(turn):
        if isinstance(event, Delta):
            for frame in spell(event):
                yield frame
            continue
        for kind, payload in blocks.finish(event.events):
            yield _sse(kind, payload)
        reason, sequence = stop_reason(event.finish_reason, event.text, stop, bool(blocks.calls))
        yield _sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(Usage.of(event)), "kvshuttle": kv_body(event.kv, event.timings, turn.request)})
        yield _sse("message_stop", {"type": "message_stop"})


def _error_tail(status: int, message: str) -> list[bytes]:
    """How a Messages stream ends after a failure: Anthropic's ``error`` event."""
    return [_sse("error", anthropic_error_body(status, message))]