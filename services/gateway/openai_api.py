"""OpenAI-compatible HTTP API of the gateway: /v1/chat/completions, /v1/completions, /v1/models, health.

The session (conversation) id comes from the `X-Session-ID` header or the body's `conversation_id`. Clients'
`kv_transfer_params` are ignored: only the scheduler decides what P pulls. Every response says what happened to the
KV (`X-KV-Decision`, `X-KV-Reason`, ... headers, and a `kvshuttle` object in the body / last stream chunk).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from kvshuttle.services.gateway.auth import OPEN
from kvshuttle.services.gateway.http_guard import principal
from kvshuttle.services.gateway.turns import (
    Delta,
    Finished,
    KvOutcome,
    PreparedTurn,
    TurnError,
    TurnRequest,
    TurnRunner,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


# strict: JSON types exactly as documented (no "5" for 5, 0 for false or false for a token id), as the fuzzer expects.
class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


# kvshuttle.control_plane.session.validate_id's alphabet; "" means no session.
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:@=+-]*$"


class SamplingIn(BaseModel):
    # OpenAI clients send many optional fields; kv_transfer_params too
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)  # vLLM's gRPC API takes an int32
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    conversation_id: str | None = Field(default=None, max_length=256, pattern=SESSION_ID_PATTERN)
    disable_pull: bool = False  # kvshuttle extension: force a recompute (benchmarks)
    # kvshuttle extension: plan with this named scheduler policy (A/B tests, benchmarks)
    policy: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_-]*$")


class ChatCompletionIn(SamplingIn):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionIn(SamplingIn):
    # Constraints on each member, so that the OpenAPI document shows them too (on the union it showed none).
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def error_body(status: int, message: str, kind: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": code or status}}


def kv_headers(kv: KvOutcome) -> dict[str, str]:
    return {
        "X-KV-Decision": kv.decision,
        "X-KV-Reason": kv.reason.encode("ascii", "replace").decode(),
        "X-KV-Reason-Code": kv.reason_code,
        "X-KV-Pulled-Tokens": str(kv.pulled_tokens),
        "X-KV-Computed-Tokens": str(kv.computed_tokens),
        "X-KV-Prefill-Worker": kv.prefill_worker_id,
        "X-KV-Decode-Worker": kv.decode_worker_id,
    }


def kv_body(kv: KvOutcome, timings: dict[str, float]) -> dict[str, Any]:
    fig = kv.figures
    return {
        "decision": kv.decision, "reason": kv.reason, "reason_code": kv.reason_code, "pulled_tokens": kv.pulled_tokens,
        "computed_tokens": kv.computed_tokens, "retried_as_recompute": kv.retried_as_recompute,
        "prefill_worker": kv.prefill_worker_id, "decode_worker": kv.decode_worker_id,
        "matched_tokens": fig.matched_tokens if fig else 0, "covered_tokens": fig.covered_tokens if fig else 0,
        "policy": fig.policy if fig else "", "pullable_tokens": fig.pullable_tokens if fig else 0,
        "predicted_pull_ms": fig.predicted_pull_ms if fig else 0.0,
        "predicted_recompute_ms": fig.predicted_recompute_ms if fig else 0.0,
        "worker_choice": fig.worker_choice if fig else "", "worker_failures": kv.worker_failures,
        "timings_ms": timings,
    }


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}
# What a turn can answer, for the OpenAI routes' OpenAPI document (validation errors are 400s, not FastAPI's 422).
TURN_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer; with `stream: true`, server-sent events (JSON chunks, then `[DONE]`)",
          "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                       "properties": {"data": {"type": "string"}}}}}},
    **{status: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
       for status, text in [(400, "Invalid request"), (401, "Missing or unknown API key"), (404, "Unknown model"),
                            (413, "Request body too large"), (429, "Overloaded"), (503, "No worker could serve it"),
                            (504, "A deadline passed")]},
}
SESSION_HEADER = {"parameters": [{
    "name": "X-Session-ID", "in": "header", "required": False,
    "description": "Conversation id (else the body's conversation_id): turns with the same id reuse each other's KV",
    "schema": {"type": "string", "maxLength": 256, "pattern": SESSION_ID_PATTERN}}]}


def _without_422(openapi):
    """FastAPI documents a 422 on every route with a body; the gateway answers those errors with a 400."""
    def document() -> dict[str, Any]:
        doc = openapi()
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        return doc
    return document


def create_app(runner: TurnRunner, served_model: str, default_max_tokens: int,
               extra_routes: list | None = None) -> FastAPI:
    app = FastAPI(title="kvshuttle gateway", version="0.1.0",
                  description="OpenAI-compatible API over P/D-disaggregated vLLM with KV reuse across turns.")
    for route in extra_routes or []:
        app.router.routes.append(route)
    app.openapi = _without_422(app.openapi)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(error_body(400, "; ".join(parts) or "invalid request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette's Allow names only the first route on the path (GET, not DELETE)
            path = request.scope["path"]
            headers["Allow"] = ", ".join(sorted({m for r in app.router.routes if getattr(r, "methods", None)
                                                 and r.path_regex.match(path) for m in r.methods}))
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=headers)

    @app.exception_handler(TurnError)
    async def _turn(_: Request, exc: TurnError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return JSONResponse(error_body(exc.http_status, exc.message), status_code=exc.http_status, headers=headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Up; ``degraded`` counts the turns served without the session store (registry/etcd unreachable)."""
        return {"status": "ok", "degraded": dict(runner.degraded)}

    @app.get("/v1/models", responses={401: TURN_RESPONSES[401]})
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": served_model, "object": "model", "created": 0, "owned_by": "kvshuttle"}]}

    def turn_request(body: SamplingIn, request: Request, max_tokens: int | None, **prompt: Any) -> TurnRequest:
        if body.model and body.model != served_model:
            raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"model {body.model!r} not found; this gateway serves {served_model!r}")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        session = request.headers.get("x-session-id") or body.conversation_id or ""
        caller = principal(request) or OPEN  # the tenant comes from the API key only (no guard: open gateway)
        return TurnRequest(session_id=session, tenant=caller.tenant, max_tokens=max_tokens or default_max_tokens,
                           temperature=body.temperature, top_p=body.top_p, seed=body.seed, ignore_eos=body.ignore_eos,
                           stop=stop, disable_pull=body.disable_pull, policy=body.policy, **prompt)

    async def respond(body: SamplingIn, req: TurnRequest, shape: _Shape):
        turn = await runner.prepare(req)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(runner, turn, served_model, include_usage, shape),
                                     media_type="text/event-stream", headers=_stream_headers(turn))
        finished = await _drain(runner, turn)
        return JSONResponse({
            "id": turn.id, "object": shape.object, "created": int(time.time()), "model": served_model,
            "choices": [shape.choice(finished.text, finished.finish_reason, final=True)],
            "usage": usage(finished.prompt_tokens, len(finished.output_ids)),
            "kvshuttle": kv_body(finished.kv, finished.timings),
        }, headers={**kv_headers(finished.kv), "X-Session-ID": req.session_id})

    @app.post("/v1/chat/completions", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
    async def chat(body: ChatCompletionIn, request: Request):
        req = turn_request(body, request, body.max_completion_tokens or body.max_tokens,
                           messages=[m.plain() for m in body.messages])
        return await respond(body, req, CHAT)

    @app.post("/v1/completions", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
    async def completions(body: CompletionIn, request: Request):
        prompt = {"prompt_text": body.prompt} if isinstance(body.prompt, str) else {"prompt_ids": body.prompt}
        return await respond(body, turn_request(body, request, body.max_tokens, **prompt), COMPLETION)

    return app


def _stream_headers(turn: PreparedTurn) -> dict[str, str]:
    return {**kv_headers(turn.kv), "X-Session-ID": turn.request.session_id, "Cache-Control": "no-cache"}


async def _drain(runner: TurnRunner, turn: PreparedTurn) -> Finished:
    async for event in runner.decode(turn):
        if isinstance(event, Finished):
            return event
    raise TurnError(503, grpc.StatusCode.UNAVAILABLE, "decode ended without a result")


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _events(runner: TurnRunner, turn: PreparedTurn) -> AsyncIterator[Delta | Finished | TurnError]:
    try:
        async for event in runner.decode(turn):
            yield event
    except TurnError as exc:
        log.warning("stream of turn %s failed: %s", turn.id, exc.message)
        yield exc


@dataclass(frozen=True)
class _Shape:
    """How one OpenAI endpoint spells its objects and choices."""

    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish: str | None, final: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if final:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}


CHAT = _Shape("chat.completion", "chat.completion.chunk", chat=True)
COMPLETION = _Shape("text_completion", "text_completion", chat=False)


async def _stream(runner: TurnRunner, turn: PreparedTurn, model: str, include_usage: bool, shape: _Shape):
    base = {"id": turn.id, "object": shape.chunk_object, "created": int(time.time()), "model": model}
    if shape.chat:
        yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
    async for event in _events(runner, turn):
        if isinstance(event, TurnError):
            yield _sse(error_body(event.http_status, event.message))
            break
        if isinstance(event, Delta):
            yield _sse({**base, "choices": [shape.choice(event.text, None)]})
        else:
            yield _sse({**base, "choices": [shape.choice("", event.finish_reason)],
                        "kvshuttle": kv_body(event.kv, event.timings)})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage(event.prompt_tokens, len(event.output_ids))})
    yield _sse("[DONE]")
