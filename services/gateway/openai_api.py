"""OpenAI-compatible HTTP API of the gateway: /v1/chat/completions, /v1/completions, /v1/models, health.

The session (conversation) id comes from the `X-Session-ID` header or the body's `conversation_id`. Only the
scheduler decides what P pulls: a client's `kv_transfer_params` is a 400. Every response says what happened to the
KV (`X-KV-Decision`, `X-KV-Reason`, ... headers, and a `kvshuttle` object in the body / last stream chunk).

Nothing a client sends is dropped silently: a field this gateway does not apply (any unknown one, and the OpenAI and
vLLM fields listed in ``SamplingIn.KNOWN``) is a 400 naming it, except at a value that asks for nothing (null,
``store: false``, ...). docs/api.md lists every field and what becomes of it.

This module only translates the API's spelling: the turn's rules (model, tools, constraint, parsing) are
turns/builder.py's, what it reports turns/reply.py's.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kvshuttle.control_plane.constraints import Constraint
from kvshuttle.services.engine.client import TokenLogprob
from kvshuttle.services.gateway.api_errors import SESSION_HEADER, TURN_RESPONSES, error_body
from kvshuttle.services.gateway.chat_answer import AnswerShape
from kvshuttle.services.gateway.chat_tools import (
    MAX_TOOLS,
    FieldError,
    NamedToolChoice,
    ToolCallIn,
    ToolChoice,
    ToolIn,
    template_tool_calls,
)
from kvshuttle.services.gateway.http_entry import GatewayRoute
from kvshuttle.services.gateway.http_guard import caller
from kvshuttle.services.gateway.input_check import INT32_MAX
from kvshuttle.services.gateway.logprob_format import Spell, chat_content, completion_logprobs, speller
from kvshuttle.services.gateway.request_model import SESSION_ID_PATTERN, UNSUPPORTED, StrictIn, session_id_of
from kvshuttle.services.gateway.sse import frame as _sse
from kvshuttle.services.gateway.sse import stream_response
from kvshuttle.services.gateway.structured_output import (
    ResponseFormatIn,
    StructuredOutputsIn,
    requested_constraint,
)
from kvshuttle.services.gateway.turns import Delta, TurnContext, TurnError, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns.builder import NamedTool, TurnBuilder, check_tool_results
from kvshuttle.services.gateway.turns.reply import Usage, drain, kv_body, kv_headers
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class TextPart(StrictIn):
    KNOWN = frozenset({"cache_control"})
    type: Literal["text"]
    text: str


class ChatMessageIn(StrictIn):
    # An assistant message echoed back from a response (the SDK's model_dump()) carries these as null.
    KNOWN = frozenset({"function_call", "refusal", "audio", "annotations"})
    NEUTRAL = {"annotations": ([],)}
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # Given to the chat template as vLLM gives it (most templates ignore it; some render it).
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)  # assistant messages
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool messages: the call they answer
    # An answer's reasoning, echoed back (vLLM reads either name); templates that keep reasoning render it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def plain(self, where: str = "message") -> dict[str, Any]:
        """The message as the chat template gets it (content parts joined, tool call arguments as dicts)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls and self.role != "assistant":
            raise FieldError(f"{where}.tool_calls", f"only assistant messages carry tool_calls, not {self.role}")
        if self.tool_calls:
            out["tool_calls"] = template_tool_calls(self.tool_calls, where)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out


class StreamOptions(StrictIn):
    KNOWN = frozenset({"continuous_usage_stats"})
    NEUTRAL = {"continuous_usage_stats": (False,)}
    include_usage: bool = False


TOKEN_ID = Annotated[int, Field(ge=0, le=2**31 - 1)]
# OpenAI's logit_bias: token ids as JSON object keys (strings), each to a bias in [-100, 100].
LOGIT_BIAS_KEY = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
BIAS = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]


class SamplingIn(StrictIn):
    # Fields of OpenAI's and vLLM's APIs this gateway does not apply: a 400 naming them, unless null (or neutral).
    KNOWN = frozenset({
        "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "top_logprobs", "audio", "modalities", "prediction", "web_search_options", "store", "metadata",
        "service_tier", "reasoning_effort", "verbosity", "echo", "best_of",
        "suffix", "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "prompt_logprobs",
        "truncate_prompt_tokens", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
        "add_special_tokens", "documents", "priority", "request_id", "return_tokens_as_token_ids", "cache_salt",
        "mm_processor_kwargs", "vllm_xargs", "include_reasoning",
        # Only the scheduler decides what P pulls: a router's or client's kv_transfer_params would be wrong here.
        "kv_transfer_params"})
    NEUTRAL = {"top_logprobs": (0,), "store": (False,), "echo": (False,), "best_of": (1,),
               "service_tier": ("auto", "default"), "modalities": (["text"],), "parallel_tool_calls": (True, False),
               "use_beam_search": (False,)}
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
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
    # vLLM's sampling parameters beyond OpenAI's (null: the default); checked as vLLM checks them.
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stop_token_ids: list[TOKEN_ID] | None = Field(default=None, max_length=1024)
    logit_bias: dict[LOGIT_BIAS_KEY, BIAS] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Who the turn is for (OpenAI's end-user ids): on the turn's span and log line; they change no decision.
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    # OpenAI's cache key: a session hint when the request names no session (docs/agents.md).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: the prompt's token ids (top level) and each choice's answer ids, as the workers saw them.
    return_token_ids: bool | None = None
    # Structured output (guided decoding on D): OpenAI's response_format, or vLLM's structured_outputs.
    response_format: ResponseFormatIn | None = None
    structured_outputs: StructuredOutputsIn | None = None

    def sampling(self) -> dict[str, Any]:
        """TurnRequest's keywords for the sampling fields the request set."""
        out = {name: value for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                                        "repetition_penalty", "min_tokens", "include_stop_str_in_output",
                                        "skip_special_tokens", "spaces_between_special_tokens")
               if (value := getattr(self, name)) is not None}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return out


# chat_template_kwargs may not set what the gateway itself gives the template.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "conversation"})


MAX_LOGPROBS = 20  # the most likely tokens a request may ask for at each position (OpenAI's limit)


class ChatCompletionIn(SamplingIn):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer

    def template_vars(self) -> dict[str, Any]:
        """What the chat template gets besides the messages."""
        extra = dict(self.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_VARS & extra.keys())
        if reserved:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}")
        tools = [t.template_dict() for t in self.tools or []]
        if tools:  # given to the template even with tool_choice "none", as vLLM gives them
            extra["tools"] = tools
        return extra


class CompletionIn(SamplingIn):
    # The sampled token's logprob, and this many of the most likely (0: none).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Constraints on each member, so that the OpenAPI document shows them too (on the union it showed none).
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def logprobs_of(body: SamplingIn) -> int | None:
    """The turn's logprobs setting: None, or how many most-likely tokens to report (chat: top_logprobs, which needs
    logprobs true; completions: logprobs, an int)."""
    if isinstance(body, ChatCompletionIn):
        if body.top_logprobs and not body.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def usage(used: Usage) -> dict[str, Any]:
    """OpenAI's usage (``cached_tokens``: see reply.Usage)."""
    return {"prompt_tokens": used.prompt, "completion_tokens": used.completion, "total_tokens": used.total,
            "prompt_tokens_details": {"cached_tokens": used.cached}}


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
               extra_routes: list | None = None, *, tool_call_parser: str = "", reasoning_parser: str = "") -> FastAPI:
    """``tool_call_parser`` / ``reasoning_parser``: the parsers' names (tool_calls.TOOL_CALL_PARSERS,
    reasoning.REASONING_PARSERS); "" leaves tool calls (a request with tools is then refused) or reasoning
    unparsed."""
    builder = TurnBuilder(served_model, default_max_tokens, tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser)
    app = FastAPI(title="kvshuttle gateway", version="0.1.0",
                  description="OpenAI-compatible API over P/D-disaggregated vLLM with KV reuse across turns.")
    app.router.route_class = GatewayRoute  # input_check on every body, and a JSON 500 for what nothing else answers
    for route in extra_routes or []:
        app.router.routes.append(route)
    app.openapi = _without_422(app.openapi)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            if err.get("type") == UNSUPPORTED:  # name the first refused field in full, as OpenAI's `param`
                first = err.get("ctx", {}).get("first", "")
                param = param or (f"{where}.{first}" if where else first)
            elif err.get("type") == "extra_forbidden":
                param = param or where
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        if param is None and parts:
            first = exc.errors()[0]
            param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return JSONResponse(error_body(400, "; ".join(parts) or "invalid request", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette's Allow names only the first route on the path (GET, not DELETE)
            path = request.scope["path"]
            headers["Allow"] = ", ".join(sorted({m for r in app.router.routes if getattr(r, "methods", None)
                                                 and r.path_regex.match(path) for m in r.methods}))
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=headers)

    @app.exception_handler(FieldError)
    async def _tool(_: Request, exc: FieldError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), param=exc.param), status_code=400)

    @app.exception_handler(TurnError)
    async def _turn(_: Request, exc: TurnError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        limit = getattr(exc, "openai_type", None)  # tenant_limits.RateLimited: OpenAI's rate-limit shape
        return JSONResponse(error_body(exc.http_status, exc.message, limit, "rate_limit_exceeded" if limit else None),
                            status_code=exc.http_status, headers=headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Up; ``degraded`` counts the turns served without the session store (registry/etcd unreachable)."""
        return {"status": "ok", "degraded": dict(runner.degraded)}

    @app.get("/v1/models", responses={401: TURN_RESPONSES[401]})
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": served_model, "object": "model", "created": 0, "owned_by": "kvshuttle"}]}

    def turn_request(body: SamplingIn, request: Request, max_tokens: int | None, **prompt: Any) -> TurnRequest:
        builder.check_model(body.model)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        session = session_id_of(request.headers, body.conversation_id)
        who = caller(request)  # the tenant comes from the API key only (no identity: 401)
        return builder.request(session_id=session, tenant=who.tenant, max_tokens=max_tokens,
                               temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                               ignore_eos=body.ignore_eos, stop=stop, disable_pull=body.disable_pull,
                               policy=body.policy, logprobs=logprobs_of(body), cache_key=body.prompt_cache_key or "",
                               end_user=body.user or "", safety_identifier=body.safety_identifier or "",
                               **body.sampling(), **prompt)

    async def respond(body: SamplingIn, req: TurnRequest, shape: _Shape, answer: AnswerShape | None = None):
        turn = await runner.prepare(req)
        answer = answer or AnswerShape()
        lps = _Logprobs(speller(runner.tokenizer), runner.hidden_token_ids(req)) if req.logprobs is not None else None
        ids = bool(body.return_token_ids)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return stream_response(_stream(runner, turn, served_model, include_usage, shape, answer, lps, ids),
                                   turn, _error_tail)
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

    def structured(body: SamplingIn) -> tuple[Constraint | None, str]:
        """The structured output the body asks for, and the field that asked."""
        return (requested_constraint(body.response_format, body.structured_outputs),
                "response_format" if body.response_format else "structured_outputs")

    @app.post("/v1/chat/completions", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
    async def chat(body: ChatCompletionIn, request: Request):
        choice = body.tool_choice
        tools = builder.tools([t.function for t in body.tools or []],
                              NamedTool(choice.function.name) if isinstance(choice, NamedToolChoice) else choice,
                              parallel=body.parallel_tool_calls)
        messages = [m.plain(f"messages.{i}") for i, m in enumerate(body.messages)]
        check_tool_results(messages)
        asked, param = structured(body)
        req = turn_request(body, request, body.max_completion_tokens or body.max_tokens, messages=messages,
                           template_vars=body.template_vars(), constraint=builder.constraint(asked, param, tools),
                           tools=tools, constraint_after_reasoning=body.structured_outputs is None)
        answer = AnswerShape(parsed=builder.parsers.reasoning is not None or tools.calls,
                             parallel_tool_calls=body.parallel_tool_calls, include_reasoning=body.include_reasoning)
        return await respond(body, req, CHAT, answer)

    @app.post("/v1/completions", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
    async def completions(body: CompletionIn, request: Request):
        prompt = {"prompt_text": body.prompt} if isinstance(body.prompt, str) else {"prompt_ids": body.prompt}
        asked, param = structured(body)
        return await respond(body, turn_request(body, request, body.max_tokens, constraint=builder.constraint(
            asked, param), constraint_after_reasoning=False, **prompt), COMPLETION)

    return app


def _error_tail(status: int, message: str) -> list[bytes]:
    """How a chat or completions stream ends after a failure: OpenAI's error object, then ``[DONE]``."""
    return [_sse(error_body(status, message)), _sse("[DONE]")]


@dataclass(frozen=True)
class _Shape:
    """How one OpenAI endpoint spells its objects and choices."""

    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A completions choice (chat choices come from chat_answer)."""
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}


@dataclass
class _Logprobs:
    """A turn's logprobs in OpenAI's shapes; ``offset``: where the next completions token starts in the text."""

    spell: Spell
    hidden: set[int]
    offset: int = 0

    def chat(self, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"content": chat_content(lps or [], self.spell, self.hidden), "refusal": None}

    def completion(self, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        out = completion_logprobs(lps or [], self.spell, self.hidden, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


CHAT = _Shape("chat.completion", "chat.completion.chunk", chat=True)
COMPLETION = _Shape("text_completion", "text_completion", chat=False)


async def _stream(runner: TurnRunner, turn: TurnContext, model: str, include_usage: bool, shape: _Shape,
                  answer: AnswerShape, lps: _Logprobs | None = None, ids: bool = False):
    """``ids`` (vLLM's return_token_ids): the first chunk carries the prompt's ids, each chunk its tokens' ids."""
    base = {"id": turn.id, "object": shape.chunk_object, "created": int(time.time()), "model": model}

    # The per-token chunk (a delta of one text field, nothing else) is spelled from a prefix and suffix made once
    # per stream: the same bytes as _sse() would write, without building and encoding the whole dict each token.
    text_frames: dict[str, tuple[bytes, bytes]] = {}

    def text_chunk(key: str, text: str) -> bytes:
        frame = text_frames.get(key)
        if frame is None:
            whole = _sse({**base, "choices": [{"index": 0, "delta": {key: ""}, "finish_reason": None}]})
            cut = whole.index(b'""}', whole.index(b'"delta":'))
            frame = text_frames[key] = (whole[:cut], whole[cut + 2:])
        return frame[0] + json.dumps(text).encode() + frame[1]

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None,
              token_ids: list[int] | None = None) -> bytes:
        if finish is None and not logprobs and not (ids and token_ids is not None) and len(delta) == 1:
            (key, text), = delta.items()
            if type(text) is str:
                return text_chunk(key, text)
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                          **({"logprobs": logprobs} if logprobs else {}),
                                          **({"token_ids": token_ids} if ids and token_ids is not None else {})}]})

    if shape.chat:
        first = {"role": "assistant", "content": ""}
        yield _sse({**base, "choices": [{"index": 0, "delta": first, "finish_reason": None}],
                    **({"prompt_token_ids": list(turn.prompt_ids)} if ids else {})})
    sent_prompt = False
    async for event in runner.decode(turn):
        if isinstance(event, Delta):
            if not shape.chat:
                choice = shape.choice(event.text, None, lps.completion(event.logprobs) if lps else None)
                yield _sse({**base, "choices": [{**choice, **({"token_ids": event.token_ids} if ids else {})}],
                            **({"prompt_token_ids": list(turn.prompt_ids)} if ids and not sent_prompt else {})})
                sent_prompt = True
                continue
            # The delta's token logprobs and ids go with its first chunk (on an empty delta when the parser holds the
            # text).
            logprobs = lps.chat(event.logprobs) if lps and event.logprobs else None
            token_ids = list(event.token_ids) if ids else None
            for delta in answer.deltas(event.events) or ([{}] if logprobs or token_ids else []):
                yield chunk(delta, logprobs=logprobs, token_ids=token_ids)
                logprobs, token_ids = None, []
        else:
            if shape.chat:
                for delta in answer.finish_deltas(event.events):
                    yield chunk(delta)
                last = {**base, "choices": [{"index": 0, "delta": {},
                                             "finish_reason": answer.finish_reason(event.finish_reason)}]}
            else:
                last = {**base, "choices": [shape.choice("", event.finish_reason)]}
            yield _sse({**last, "kvshuttle": kv_body(event.kv, event.timings, turn.request)})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage(Usage.of(event))})
    yield _sse("[DONE]")
