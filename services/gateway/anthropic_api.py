"""Anthropic's Messages API on the gateway: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, the protocol
Claude-Code-style coding agents speak (the official ``anthropic`` SDK, streaming or not).

A thin translator onto the same turn runner as the OpenAI chat route: the request becomes the chat messages, template
variables and forced-call constraint the chat route would build for the same conversation (so the prompt, and with it
the KV reuse across turns, is the same whichever API an agent speaks), and the answer is parsed by the same reasoning
and tool-call parsers, then spelled as Anthropic's content blocks (``thinking``, ``text``, ``tool_use``).

Translation:

- ``system`` → a system message; assistant ``text`` blocks → its content, ``thinking`` → ``reasoning_content``,
  ``tool_use`` → ``tool_calls`` (arguments as a dict, as the chat route gives them to the template); a user message's
  ``tool_result`` blocks → ``tool`` messages (before the message's text, in order; ``is_error`` goes with them to the
  template, as a message's ``name`` does on the chat route). Text blocks are joined with a newline, as the chat route
  (and vLLM) join content parts. ``redacted_thinking`` blocks are accepted and left out (only Anthropic can read them).
- ``tools`` → OpenAI function tools; ``tool_choice`` ``auto`` / ``any`` (forced calls, as ``required``) / ``tool``
  (one named call) / ``none`` (tools rendered, calls not parsed); ``disable_parallel_tool_use`` keeps the first call.
- ``thinking`` ``enabled`` / ``adaptive`` / ``disabled`` → the template variable ``enable_thinking``. ``budget_tokens``
  cannot be enforced (no way to stop the reasoning early on the workers): it is taken when ``max_tokens`` bounds it
  anyway (``budget_tokens >= max_tokens - 1``, as Claude Code sends it) and refused, naming it, when smaller.
- ``cache_control`` (on blocks, tools, or the request) is accepted and ignored: kvshuttle reuses a conversation's KV
  without being asked (the session's prompt prefix is pulled or found in P's prefix cache).
- The session is the ``X-Session-ID`` header's; without one, the runner finds the session by the prompt's content.

Answers: ``stop_reason`` ``tool_use`` (a call was parsed), ``max_tokens``, ``stop_sequence`` (the answer's text ends
with the stop sequence that matched; it is kept in the text, as the chat route keeps it) or ``end_turn``. ``usage``
follows Anthropic's accounting: ``cache_read_input_tokens`` are the prompt tokens this turn did not compute (pulled or
cached), ``input_tokens`` the rest, so their sum is the prompt; ``cache_creation_input_tokens`` is 0. The ``X-KV-*``
headers and a ``kvshuttle`` object (in the streamed ``message_delta``) say what happened to the KV, as on the chat route.

Errors are Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), also for a bad body (a field this
gateway does not apply is a 400 naming it, as on the OpenAI routes) and for a turn that fails mid-stream (an ``error``
event).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

import grpc
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from kvshuttle.control_plane.answer import Event
from kvshuttle.control_plane.answer_blocks import APPENDED, CALL_BLOCK, CLOSED, TEXT_BLOCK, AnswerBlocks, Step
from kvshuttle.services.gateway.api_errors import ANTHROPIC_ERRORS, SESSION_HEADER, anthropic_error_body
from kvshuttle.services.gateway.chat_tools import FUNCTION_NAME, MAX_TOOLS, FieldError, FunctionIn
from kvshuttle.services.gateway.http_entry import GatewayRoute
from kvshuttle.services.gateway.http_guard import caller
from kvshuttle.services.gateway.input_check import InputError
from kvshuttle.services.gateway.request_model import StrictIn, session_id_of
from kvshuttle.services.gateway.sse import frame, stream_response
from kvshuttle.services.gateway.turns import Delta, TurnContext, TurnError, TurnRunner
from kvshuttle.services.gateway.turns.builder import (
    ANTHROPIC_TOOLS,
    NamedTool,
    ToolChoice,
    ToolUse,
    TurnBuilder,
    check_tool_results,
    check_tools,
    template_tools,
)
from kvshuttle.services.gateway.turns.reply import Usage, drain, kv_body, kv_headers
from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ANTHROPIC_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})

# -- the request --------------------------------------------------------------------------------------------------

TEXT_ONLY = frozenset({"image", "document", "search_result"})
# Blocks of Anthropic's server-side tools (web search, code execution, MCP connector, ...): this gateway runs none.
SERVER_TOOL_BLOCKS = frozenset({
    "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result",
    "mcp_tool_use", "mcp_tool_result", "container_upload"})


def _supported_block(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        return value  # the block's own validation names what is wrong
    if kind in TEXT_ONLY:
        raise PydanticCustomError("unsupported_block", "{kind} blocks are not supported: this gateway serves a "
                                  "text-only model (send the content as text)", {"kind": kind})
    if kind in SERVER_TOOL_BLOCKS:
        raise PydanticCustomError("unsupported_block", "{kind} blocks are not supported: this gateway runs no "
                                  "server tools", {"kind": kind})
    return value


def _as_blocks(value: Any) -> Any:
    """A string stands for one text block (as Anthropic reads it)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _custom_tool(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise PydanticCustomError("unsupported_tool", "server tool {kind} is not supported: this gateway runs no "
                                  "server tools (declare a client tool: name, description, input_schema)",
                                  {"kind": repr(kind)})
    return value


class CacheControlIn(StrictIn):
    """Accepted and ignored: kvshuttle reuses a conversation's KV without being asked."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockIn(StrictIn):
    KNOWN = frozenset({"citations"})
    NEUTRAL = {"citations": ([],)}
    type: Literal["text"]
    text: str
    cache_control: CacheControlIn | None = None


TextBlocks = Annotated[list[Annotated[TextBlockIn, BeforeValidator(_supported_block)]],
                       BeforeValidator(_as_blocks, json_schema_input_type=str | list[TextBlockIn])]


class ToolUseBlockIn(StrictIn):
    KNOWN = frozenset({"caller", "toolset_name"})
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: CacheControlIn | None = None


class ToolResultBlockIn(StrictIn):
    KNOWN = frozenset({"toolset_name"})
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: TextBlocks = Field(default_factory=list)
    is_error: bool = False  # given to the chat template with the tool message (a template may render it)
    cache_control: CacheControlIn | None = None


class ThinkingBlockIn(StrictIn):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this gateway signs nothing: its answers carry ""


class RedactedThinkingBlockIn(StrictIn):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Annotated[TextBlockIn | ToolUseBlockIn | ToolResultBlockIn | ThinkingBlockIn | RedactedThinkingBlockIn,
              Field(discriminator="type")],
    BeforeValidator(_supported_block)]


class MessageIn(StrictIn):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[ContentBlock])]


class ToolDefIn(StrictIn):
    KNOWN = frozenset({"allowed_callers", "defer_loading", "eager_input_streaming", "input_examples"})
    NEUTRAL = {"defer_loading": (False,), "eager_input_streaming": (False,), "input_examples": ([],)}
    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # given to the template as the chat route gives a function's `strict`
    cache_control: CacheControlIn | None = None

    def function(self) -> FunctionIn:
        """The tool as the chat route's function definition."""
        return FunctionIn(name=self.name, description=self.description, parameters=self.input_schema,
                          strict=self.strict)


class ToolChoiceAutoIn(StrictIn):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAnyIn(StrictIn):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceToolIn(StrictIn):
    type: Literal["tool"]
    name: str = Field(min_length=1, max_length=256)
    disable_parallel_tool_use: bool = False


class ToolChoiceNoneIn(StrictIn):
    type: Literal["none"]


class ThinkingEnabledIn(StrictIn):
    type: Literal["enabled"]
    # Taken only where max_tokens already bounds it (budget_tokens >= max_tokens - 1): the gateway cannot stop the
    # reasoning earlier (a smaller budget is a 400 naming it).
    budget_tokens: int = Field(ge=1, le=2**31 - 1)
    display: Literal["summarized"] | None = None


class ThinkingAdaptiveIn(StrictIn):
    type: Literal["adaptive"]
    display: Literal["summarized"] | None = None


class ThinkingDisabledIn(StrictIn):
    type: Literal["disabled"]


class MetadataIn(StrictIn):
    user_id: str | None = Field(default=None, max_length=256)  # on the turn's span and log line; changes nothing


class PromptIn(StrictIn):
    """What makes the prompt: the fields /v1/messages and /v1/messages/count_tokens share."""

    # Fields of Anthropic's API this gateway does not apply: a 400 naming them, unless null.
    KNOWN = frozenset({"container", "context_management", "mcp_servers", "output_config", "output_format",
                       "inference_geo", "speed", "diagnostics"})
    NEUTRAL = {"speed": ("standard",)}
    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageIn] = Field(min_length=1)
    system: TextBlocks | None = None
    tools: list[Annotated[ToolDefIn, BeforeValidator(_custom_tool)]] | None = Field(default=None,
                                                                                    max_length=MAX_TOOLS)
    tool_choice: Annotated[ToolChoiceAutoIn | ToolChoiceAnyIn | ToolChoiceToolIn | ToolChoiceNoneIn,
                           Field(discriminator="type")] | None = None
    thinking: Annotated[ThinkingEnabledIn | ThinkingAdaptiveIn | ThinkingDisabledIn,
                        Field(discriminator="type")] | None = None
    cache_control: CacheControlIn | None = None  # accepted and ignored, as on blocks


class MessagesIn(PromptIn):
    max_tokens: int = Field(ge=1, le=2**31 - 1)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stream: bool = False
    metadata: MetadataIn | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


class CountTokensIn(PromptIn):
    pass


# -- the request as the chat route gives it to the template --------------------------------------------------------


def chat_messages(body: PromptIn) -> list[dict[str, Any]]:
    """The messages as the chat route gives them to the template (ChatMessageIn.plain()'s shape)."""
    out: list[dict[str, Any]] = []
    system = "\n".join(b.text for b in body.system or [])
    if system:
        out.append({"role": "system", "content": system})
    fields: dict[int, str] = {}  # a tool result's chat message -> its tool_use_id's field
    for i, message in enumerate(body.messages):
        where = f"messages.{i}"
        text: list[str] = []
        if message.role == "assistant":
            thinking: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, block in enumerate(message.content):
                if block.type == "text":
                    text.append(block.text)
                elif block.type == "thinking":
                    thinking.append(block.thinking)
                elif block.type == "tool_use":
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": block.input}})
                elif block.type == "tool_result":
                    raise FieldError(f"{where}.content.{j}", "tool_result blocks belong in user messages")
            assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
            if calls:
                assistant["tool_calls"] = calls
            if thinking:
                assistant["reasoning_content"] = assistant["reasoning"] = "".join(thinking)
            out.append(assistant)
            continue
        results: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            if block.type == "text":
                text.append(block.text)
            elif block.type == "tool_result":
                fields[len(out) + len(results)] = f"{where}.content.{j}.tool_use_id"
                results.append({"role": "tool", "content": "\n".join(b.text for b in block.content),
                                "tool_call_id": block.tool_use_id, **({"is_error": True} if block.is_error else {})})
            else:
                raise FieldError(f"{where}.content.{j}", f"{block.type} blocks belong in assistant messages")
        out.extend(results)
        if text or not results:
            out.append({"role": "user", "content": "\n".join(text)})
    check_tool_results(out, fields, id_name="tool_use_id", call_name="tool_use block")
    return out


def chat_tools(body: PromptIn) -> tuple[list[FunctionIn], ToolChoice, bool]:
    """The tools as the chat route's functions, the ``tool_choice`` (``any`` is ``required``, ``tool`` names one),
    and whether parallel calls are kept."""
    tools = [t.function() for t in body.tools or []]
    choice = body.tool_choice
    neutral: ToolChoice
    if choice is None:
        neutral = None
    elif choice.type == "tool":
        neutral = NamedTool(choice.name)
    else:
        neutral = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return tools, neutral, not getattr(choice, "disable_parallel_tool_use", False)


def template_vars(body: PromptIn, tools: ToolUse) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools.tools:  # given to the template even with tool_choice none, as the chat route gives them
        out["tools"] = tools.tools
    if body.thinking is not None:
        out["enable_thinking"] = body.thinking.type != "disabled"
    return out


# -- the answer -----------------------------------------------------------------------------------------------------


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class ContentBlocks:
    """The answer's blocks (control_plane.answer_blocks, the rules every API shares) as Anthropic's content blocks:
    both the whole ``content`` (``self.content``) and the stream events that build it (``feed`` / ``finish`` return
    ``(event type, payload)`` pairs), so a stream and a whole answer come out the same. ``parallel`` false keeps only
    the first tool call."""

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = tool_use_id):
        self.blocks = AnswerBlocks(parallel_tool_calls=parallel, new_call_id=new_id)
        self.content: list[dict[str, Any]] = []

    @property
    def calls(self) -> int:
        return self.blocks.calls

    def feed(self, events: Iterable[Event]) -> list[tuple[str, dict[str, Any]]]:
        """The stream events for the answer events of the next piece of text (the turn's parse stage)."""
        return self._spell(self.blocks.feed(events))

    def finish(self, events: Iterable[Event] = ()) -> list[tuple[str, dict[str, Any]]]:
        """The stream events for what the parser held back (``events``), once the answer has ended."""
        return self._spell(self.blocks.finish(events))

    def _spell(self, steps: list[Step]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for step, block, text in steps:
            index = block.position
            if step == APPENDED:
                if block.kind == TEXT_BLOCK:
                    self.content[index]["text"] += text
                    delta = {"type": "text_delta", "text": text}
                else:
                    self.content[index]["thinking"] += text
                    delta = {"type": "thinking_delta", "thinking": text}
                out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            elif step == CLOSED:
                out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
            elif block.kind == CALL_BLOCK:
                started = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
                out.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": started}))
                out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": block.arguments}}))
                # the parsers' arguments: a JSON object
                self.content.append({**started, "input": json.loads(block.arguments)})
            else:
                started = ({"type": "text", "text": ""} if block.kind == TEXT_BLOCK
                           else {"type": "thinking", "thinking": "", "signature": ""})
                self.content.append(dict(started))
                out.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": started}))
        return out


def stop_reason(finish_reason: str, text: str, stop: list[str], called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for an answer."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    matched = [s for s in stop if s and text.endswith(s)] if finish_reason == "stop" else []
    if matched:
        return "stop_sequence", max(matched, key=len)
    return "end_turn", None


def usage(used: Usage) -> dict[str, int]:
    """Anthropic's usage: the prompt split into what this turn computed (``input_tokens``) and what it did not
    (``cache_read_input_tokens``: pulled from the decode worker or found in P's prefix cache)."""
    return {"input_tokens": used.prompt - used.cached, "output_tokens": used.completion,
            "cache_read_input_tokens": used.cached, "cache_creation_input_tokens": 0}


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


def anthropic_routes(runner: TurnRunner, served_model: str, default_max_tokens: int, *, tool_call_parser: str = "",
                     reasoning_parser: str = "") -> APIRouter:
    """The Messages API's routes, for ``app.include_router``. The parsers are create_app's (tool_calls.
    TOOL_CALL_PARSERS, reasoning.REASONING_PARSERS; "" leaves that part unparsed, and a request with tools is then
    refused unless tool_choice is none). ``default_max_tokens`` is not used: Anthropic's ``max_tokens`` is required."""
    builder = TurnBuilder(served_model, default_max_tokens, tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser)
    router = APIRouter(route_class=AnthropicRoute, tags=["anthropic"])

    @router.post(MESSAGES_PATH, responses=MESSAGE_RESPONSES, openapi_extra=SESSION_HEADER)
    async def messages(body: MessagesIn, request: Request) -> Response:
        """Anthropic's Messages API (Claude-Code-style agents): one assistant turn, streamed or whole."""
        builder.check_model(body.model, required=True)
        budget = getattr(body.thinking, "budget_tokens", None)
        if budget is not None and budget < body.max_tokens - 1:
            raise FieldError("thinking.budget_tokens", f"thinking.budget_tokens {budget} cannot be enforced (the "
                                                       "workers cannot stop the reasoning early): send max_tokens - 1 "
                                                       f"({body.max_tokens - 1}), or thinking {{\"type\": "
                                                       "\"adaptive\"}")
        functions, choice, parallel = chat_tools(body)
        tools = builder.tools(functions, choice, ANTHROPIC_TOOLS, parallel=parallel)
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
        turn = await runner.prepare(req)
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
    async def count_tokens(body: CountTokensIn) -> Response:
        """The prompt's tokens for the same body, as /v1/messages would render it (no turn runs)."""
        builder.check_model(body.model, required=True)
        functions, choice, _ = chat_tools(body)
        check_tools(functions, choice, ANTHROPIC_TOOLS)  # counted as rendered, whatever the gateway parses
        tools = ToolUse(template_tools(functions))
        messages = chat_messages(body)
        tokenizer = runner.tokenizer
        try:
            text = await asyncio.to_thread(tokenizer.render_chat, messages, True, **template_vars(body, tools))
        except Exception as exc:  # template errors are the caller's input
            raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"cannot render chat: {exc}") from None
        ids = await asyncio.to_thread(tokenizer.encode, text, False)
        return JSONResponse({"input_tokens": len(ids)})

    return router


async def _stream(runner: TurnRunner, turn: TurnContext, model: str, blocks: ContentBlocks,
                  stop: list[str]) -> AsyncIterator[bytes]:
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": f"msg_{turn.id}", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage(Usage.at(len(turn.prompt_ids), 0, turn.kv))}})
    async for event in runner.decode(turn):
        if isinstance(event, Delta):
            for kind, payload in blocks.feed(event.events):
                yield _sse(kind, payload)
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