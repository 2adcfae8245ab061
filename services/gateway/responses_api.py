"""The Responses API with server-held conversations: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A thin translator onto the turn runner, like the chat route: input items (messages, ``function_call``,
``function_call_output``, ``reasoning``) become chat messages for the template; the answer is parsed into output
items (reasoning, message, function calls). A stored response (``store``, the default) is kept in the registry
(tenant-scoped, ``--response-ttl-s`` after its conversation's last stored response) with the items new in its turn,
the response it continues and the session its turn ran in; the conversation is read back along those links (bounded
by ``--response-chain-max-responses`` / ``--response-chain-max-bytes``). A request with
``previous_response_id`` continues that conversation *and that session*: the session's record holds the exact token
ids the decode worker has, so the new prompt continues those ids and pulls them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kvshuttle.control_plane import response_chain as chains
from kvshuttle.control_plane.answer import Event
from kvshuttle.control_plane.answer_blocks import (
    APPENDED,
    CALL_BLOCK,
    OPENED,
    REASONING_BLOCK,
    TEXT_BLOCK,
    AnswerBlocks,
    Block,
    Step,
)
from kvshuttle.control_plane.constraints import Constraint, json_answer
from kvshuttle.control_plane.session import InvalidArgument
from kvshuttle.services.gateway.api_errors import SESSION_HEADER, TURN_RESPONSES
from kvshuttle.services.gateway.chat_tools import MAX_TOOLS, FieldError, FunctionIn, check_schema
from kvshuttle.services.gateway.http_guard import caller
from kvshuttle.services.gateway.input_check import INT32_MAX
from kvshuttle.services.gateway.request_model import SESSION_ID_PATTERN, StrictIn, session_id_of
from kvshuttle.services.gateway.sse import frame, stream_headers, stream_response
from kvshuttle.services.gateway.turns import Delta, Finished, TurnContext, TurnError, TurnRunner
from kvshuttle.services.gateway.turns.builder import RESPONSES_TOOLS, NamedTool, TurnBuilder, check_tool_results
from kvshuttle.services.gateway.turns.reply import Usage, drain, kv_body, kv_headers
from kvshuttle.v1 import registry_pb2
from pydantic import Field

RESPONSE_ID = r"^resp_[A-Za-z0-9]{1,64}$"
DEFAULT_CHAIN_MAX_RESPONSES = 10_000  # the gateway's --response-chain-max-responses
DEFAULT_CHAIN_MAX_BYTES = 3 << 20  # --response-chain-max-bytes (within gRPC's default 4 MiB answer)


# -- the request -----------------------------------------------------------------------------------------------

class FunctionToolIn(FunctionIn):
    """A Responses API function tool: the chat route's function definition, flat, with its type."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        """The tool as the chat template gets it (the chat route's spelling)."""
        return {"type": "function", "function": self.template_dict()}


class NamedFunctionChoice(StrictIn):
    type: Literal["function"]
    name: str


class FormatIn(StrictIn):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextIn(StrictIn):
    KNOWN = frozenset({"verbosity"})
    NEUTRAL = {"verbosity": ("medium",)}
    format: FormatIn | None = None


class ReasoningIn(StrictIn):
    """Accepted only when it asks for nothing (its options null): the model's own chat template decides whether it
    reasons."""

    KNOWN = frozenset({"effort", "summary", "generate_summary"})


class ResponsesIn(StrictIn):
    KNOWN = frozenset({"include", "truncation", "background", "prompt",
                       "service_tier", "top_logprobs", "conversation", "max_tool_calls", "stream_options",
                       "context_management", "prompt_cache_retention"})
    NEUTRAL = {"include": ([],), "truncation": ("disabled",), "background": (False,),
               "service_tier": ("auto", "default"), "top_logprobs": (0,)}
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(default=None, pattern=RESPONSE_ID)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    text: TextIn | None = None
    reasoning: ReasoningIn | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    conversation_id: str | None = Field(default=None, max_length=256, pattern=SESSION_ID_PATTERN)


# -- items <-> chat messages ---------------------------------------------------------------------------------------

def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(where, "content must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError(f"{where}.{j}", f"content part of type {kind!r} is not supported here (only "
                                             f"{', '.join(kinds)})")
        out.append(part["text"])
    return "\n".join(out)


_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}


def normalized_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as canonical items (what is stored and rendered); FieldError naming the bad one."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    items = []
    for i, item in enumerate(raw):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            raise FieldError(f"{where}.type", f"input item of type {kind!r} is not supported (only "
                                              f"{', '.join(_ITEM_KEYS)})")
        extra = sorted(set(item) - _ITEM_KEYS[kind])
        if extra:
            raise FieldError(f"{where}.{extra[0]}", f"unsupported field(s) in a {kind} item: {', '.join(extra)}")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldError(f"{where}.role", f"role must be user, system, developer or assistant, got {role!r}")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            items.append({"type": "message", "role": role, "content": _text_of(item.get("content"),
                                                                                f"{where}.content", kinds)})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
                    raise FieldError(f"{where}.{name}", f"a function_call item needs {name} as a string")
            items.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise FieldError(f"{where}.call_id", "a function_call_output item needs the call_id it answers")
            items.append({"type": "function_call_output", "call_id": item["call_id"],
                          "output": _text_of(item.get("output"), f"{where}.output", ("input_text",))})
        else:
            if item.get("encrypted_content"):
                raise FieldError(f"{where}.encrypted_content", "encrypted reasoning is not supported")
            text = _text_of(item.get("content") or [], f"{where}.content", ("reasoning_text",))
            summary = _text_of(item.get("summary") or [], f"{where}.summary", ("summary_text",))
            items.append({"type": "reasoning", "text": text or summary})
    return items


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation's items as the chat template's messages: consecutive reasoning, assistant text and function
    calls make one assistant message; function outputs are tool messages (each must answer an earlier call)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    fields: dict[int, str] = {}
    turn: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for i, item in enumerate(items):
        kind = item["type"]
        if kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant"):
            turn = turn or {"role": "assistant", "content": ""}
            if kind == "reasoning":
                turn["reasoning_content"] = turn["reasoning"] = turn.get("reasoning_content", "") + item["text"]
            elif kind == "message":
                turn["content"] += item["content"]
            else:
                try:
                    arguments = json.loads(item["arguments"]) if item["arguments"].strip() else {}
                except ValueError as exc:
                    raise FieldError(f"input.{i}.arguments", f"arguments are not valid JSON ({exc})") from None
                if not isinstance(arguments, dict):
                    raise FieldError(f"input.{i}.arguments", "arguments must be a JSON object")
                turn.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": arguments}})
            continue
        flush()
        if kind == "function_call_output":
            fields[len(messages)] = "input"  # the conversation's items: the previous responses' and this input's
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": item["role"], "content": item["content"]})
    flush()
    check_tool_results(messages, fields, id_name="call_id", call_name="function_call")
    return messages


# -- the answer as output items ------------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputBuilder:
    """The answer's blocks (control_plane.answer_blocks, the rules every API shares) as output items, and
    (streaming) as the Responses API's events."""

    def __init__(self, parallel_tool_calls: bool = True):
        self.blocks = AnswerBlocks(parallel_tool_calls=parallel_tool_calls, new_call_id=_call_id)
        self.items: list[dict[str, Any]] = []
        self._sequence = 0

    def event(self, kind: str, **body: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **body}

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def feed(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The stream events for the answer events of the next piece of text (the turn's parse stage)."""
        return self._spell(self.blocks.feed(events))

    def finish(self, events: Iterable[Event] = ()) -> list[dict[str, Any]]:
        """The stream events for what the parser held back (``events``), once the answer has ended."""
        return self._spell(self.blocks.finish(events))

    def _spell(self, steps: list[Step]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for step, block, text in steps:
            index = block.position
            if step == APPENDED:
                item = self.items[index]
                item["content"][0]["text"] += text
                if block.kind == TEXT_BLOCK:
                    out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                           content_index=0, delta=text, logprobs=[]))
                else:
                    out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                           content_index=0, delta=text))
            elif step == OPENED:
                out += self._opened(block)
            elif block.kind != CALL_BLOCK:
                out += self._closed(index)
        return out

    def _opened(self, block: Block) -> list[dict[str, Any]]:
        index = block.position
        if block.kind == CALL_BLOCK:
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": block.call_id, "name": block.name,
                    "arguments": block.arguments, "status": "completed"}
            self.items.append(item)
            return [self.event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=block.arguments),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=block.name, arguments=block.arguments),
                    self.event("response.output_item.done", output_index=index, item=item)]
        if block.kind == REASONING_BLOCK:
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self.items.append(item)
            return [self.event("response.output_item.added", output_index=index, item={**item, "content": []})]
        item = {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "content": []}),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def _closed(self, index: int) -> list[dict[str, Any]]:
        item = self.items[index]
        part = item["content"][0]
        if item["type"] == "reasoning":
            return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self.event("response.output_item.done", output_index=index, item=item)]


def stored_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as conversation items (what normalized_items gives for them when a client sends them back)."""
    out = []
    for item in output:
        if item["type"] == "reasoning":
            out.append({"type": "reasoning", "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            out.append({"type": "message", "role": "assistant", "content": item["content"][0]["text"]})
        else:
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
    return out


# -- the routes ----------------------------------------------------------------------------------------------------

def add_responses_routes(app: FastAPI, runner: TurnRunner, served_model: str, default_max_tokens: int, *,
                         tool_call_parser: str = "", reasoning_parser: str = "", response_ttl_s: int = 86400,
                         chain_max_responses: int = DEFAULT_CHAIN_MAX_RESPONSES,
                         chain_max_bytes: int = DEFAULT_CHAIN_MAX_BYTES) -> None:
    """Adds the Responses API to the gateway's app (errors in OpenAI's shape through the app's handlers). The parsers
    are create_app's; ``chain_max_*`` bound the conversations read back (``previous_response_id``, input items)."""
    builder = TurnBuilder(served_model, default_max_tokens, tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser)

    def check_id(response_id: str) -> None:
        if not re.fullmatch(RESPONSE_ID, response_id):
            raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"response {response_id[:80]!r} not found: not a "
                                                            "response id")

    def refused(exc: grpc.aio.AioRpcError, response_id: str, param: str) -> Exception:
        """The HTTP error for the registry's answer: about the path's response (``param`` 'response_id': 404, or
        400 for a conversation too long to read back) or about a request field (400 naming it)."""
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            message = f"response {response_id!r} not found (unknown, expired, deleted, or not stored)"
        elif code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                      grpc.StatusCode.INVALID_ARGUMENT):
            message = exc.details() or code.name
            if code == grpc.StatusCode.OUT_OF_RANGE:
                message += " (the gateway's --response-chain-max-responses / --response-chain-max-bytes)"
        else:
            return TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                             retry_after_s=1)
        if param != "response_id":
            return FieldError(param, message)
        status = 404 if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION) else 400
        return TurnError(status, code, message)

    async def load(tenant: str, response_id: str, param: str) -> tuple[registry_pb2.StoredResponse, dict[str, Any]]:
        check_id(response_id)
        try:
            found = await runner.registry.GetResponse(registry_pb2.GetResponseRequest(
                response_id=response_id, tenant=tenant), timeout=runner.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise refused(exc, response_id, param) from None
        return found.response, json.loads(found.response.body_json)

    async def load_chain(tenant: str, response_id: str,
                         param: str) -> list[tuple[registry_pb2.StoredResponse, dict[str, Any]]]:
        """The conversation up to ``response_id``, oldest first: each response's entry and body."""
        check_id(response_id)
        try:
            found = await runner.registry.GetResponseChain(registry_pb2.GetResponseChainRequest(
                response_id=response_id, tenant=tenant, max_responses=chain_max_responses,
                max_bytes=chain_max_bytes), timeout=runner.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise refused(exc, response_id, param) from None
        entries = list(found.responses)
        if sum(len(entry.body_json) for entry in entries) < _PARSE_INLINE_BYTES:
            return _parsed(entries)
        return await asyncio.to_thread(_parsed, entries)  # a long conversation: off the event loop

    def structured(body: ResponsesIn) -> Constraint | None:
        """The JSON answer ``text.format`` asks for (None: text)."""
        fmt = body.text.format if body.text else None
        if fmt is None or fmt.type == "text":
            return None
        schema = None
        if fmt.type == "json_schema":
            schema = fmt.schema_ if fmt.schema_ is not None else {}
            check_schema(schema, "text.format.schema", "text.format's schema")
        return json_answer(schema)

    @app.post("/v1/responses", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
    async def create(body: ResponsesIn, request: Request):
        builder.check_model(body.model)
        who = caller(request)
        choice = body.tool_choice
        tools = builder.tools(body.tools or [], NamedTool(choice.name) if isinstance(choice, NamedFunctionChoice)
                              else choice, RESPONSES_TOOLS, parallel=body.parallel_tool_calls)
        history: list[dict[str, Any]] = []
        session = session_id_of(request.headers, body.conversation_id)
        if body.previous_response_id:
            chain = await load_chain(who.tenant, body.previous_response_id, "previous_response_id")
            history = [item for _, stored in chain for item in stored["items"]]
            session = chain[-1][0].session_id
        new_items = normalized_items(body.input)
        items = [*history, *new_items]
        messages = chat_messages(items, body.instructions)
        req = builder.request(tools, session_id=session, tenant=who.tenant, messages=messages,
                              session_source="response" if body.previous_response_id else "",
                              cache_key=body.prompt_cache_key or "", end_user=body.user or "",
                              safety_identifier=body.safety_identifier or "",
                              template_vars={"tools": tools.tools} if tools.tools else {},
                              max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                              constraint=builder.constraint(structured(body), "text.format", tools))
        turn = await runner.prepare(req)
        output = OutputBuilder(parallel_tool_calls=body.parallel_tool_calls)
        response = _response(body, turn, served_model)

        async def finished(event: Finished) -> dict[str, Any]:
            used = await Usage.of(event).with_reasoning(runner.tokenizer, event.answer_events)
            out = {**response, "output": output.items, **_outcome(event, used),
                   "kvshuttle": kv_body(event.kv, event.timings, turn.request)}
            if body.store:  # only what is new in this turn: the conversation before it is the previous responses'
                await _store(runner, out, [*new_items, *stored_items(output.items)], event.kv.session_id or session,
                             who.tenant, response_ttl_s)
            return out

        if body.stream:
            def error_tail(status: int, message: str) -> list[bytes]:
                return [_sse(output.event("error", code=str(status), message=message, param=None))]

            return stream_response(_stream(runner, turn, output, response, finished), turn, error_tail)
        done = await drain(runner, turn)
        output.finish(done.answer_events)  # the events a stream would have carried, in order
        return JSONResponse(await finished(done), headers={**kv_headers(done.kv), **stream_headers(turn)})

    @app.get("/v1/responses/{response_id}", responses={404: TURN_RESPONSES[404]})
    async def get(response_id: str, request: Request):
        who = caller(request)
        _, body = await load(who.tenant, response_id, "response_id")
        return JSONResponse(body["response"])

    @app.get("/v1/responses/{response_id}/input_items", responses={400: TURN_RESPONSES[400],
                                                                    404: TURN_RESPONSES[404]})
    async def input_items(response_id: str, request: Request):
        """The items the response's turn was given, its conversation's earlier ones included (as OpenAI lists them),
        paged: ``after`` (an item id), ``limit`` (1-100, 20), ``order`` (``desc``, the default, or ``asc``)."""
        who = caller(request)
        after, limit, order = _page_query(request)
        chain = await load_chain(who.tenant, response_id, "response_id")
        listed = conversation_items(chain)
        try:
            chosen, more = chains.page([item_id for item_id, _ in listed], after, limit, order)
        except InvalidArgument as exc:
            param = str(exc).split(" ", 1)[0].removesuffix(":")
            raise FieldError(param if param in ("after", "limit", "order") else "after", str(exc)) from None
        data = [api_item(*listed[i]) for i in chosen]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.delete("/v1/responses/{response_id}", responses={404: TURN_RESPONSES[404]})
    async def delete(response_id: str, request: Request):
        who = caller(request)
        if not re.fullmatch(RESPONSE_ID, response_id):
            raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"response {response_id[:80]!r} not found")
        try:
            gone = await runner.registry.DeleteResponse(registry_pb2.DeleteResponseRequest(
                response_id=response_id, tenant=who.tenant), timeout=runner.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                            retry_after_s=1) from None
        if not gone.deleted:
            raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"response {response_id!r} not found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


_PAGE_PARAMS = frozenset({"after", "limit", "order", "include"})
_PARSE_INLINE_BYTES = 256 << 10  # bodies parsed on the event loop up to this many bytes, in a thread beyond


def _parsed(entries: list[registry_pb2.StoredResponse]) -> list[tuple[registry_pb2.StoredResponse, dict[str, Any]]]:
    return [(entry, json.loads(entry.body_json)) for entry in entries]


def _page_query(request: Request) -> tuple[str | None, int, str]:
    """input_items' query: (after, limit, order); FieldError naming a bad or unknown parameter."""
    query = request.query_params
    for name in query:
        if name not in _PAGE_PARAMS and name != "include[]":
            raise FieldError(name, f"unknown query parameter {name[:64]!r} (input_items takes after, limit, order)")
    include = query.getlist("include") + query.getlist("include[]")
    if include:
        raise FieldError("include", f"include {include[0][:64]!r} is not supported here")
    raw = query.get("limit", str(chains.DEFAULT_PAGE_LIMIT))
    try:
        limit = int(raw)
    except ValueError:
        raise FieldError("limit", f"limit must be an integer, got {raw[:32]!r}") from None
    low, high = chains.PAGE_LIMIT_RANGE
    if not low <= limit <= high:
        raise FieldError("limit", f"limit must be between {low} and {high}, got {limit}")
    order = query.get("order", "desc")
    if order not in chains.ORDERS:
        raise FieldError("order", f"order must be 'asc' or 'desc', got {order[:32]!r}")
    return query.get("after"), limit, order


def conversation_items(chain: list[tuple[registry_pb2.StoredResponse, dict[str, Any]]]) -> list[tuple[str, dict]]:
    """(item id, item) for every item the last response's turn was given, oldest first: each earlier response's
    input and output items, then the last one's input. Output items keep their ids; input items are named after their
    response and place (``item_{response}_{n}``), the same on every read."""
    out: list[tuple[str, dict[str, Any]]] = []
    for n, (entry, body) in enumerate(chain):
        items, output = body["items"], body["response"].get("output") or []
        inputs = len(items) - len(output)  # a body's items: its input, then its output (one item per output item)
        tag = entry.response_id.removeprefix("resp_")
        out += [(f"item_{tag}_{i}", item) for i, item in enumerate(items[:inputs])]
        if n < len(chain) - 1:
            out += [(produced.get("id") or f"item_{tag}_{inputs + j}", item)
                    for j, (produced, item) in enumerate(zip(output, items[inputs:], strict=False))]
    return out


def api_item(item_id: str, item: dict[str, Any]) -> dict[str, Any]:
    """A stored conversation item as the Responses API lists it."""
    kind = item["type"]
    if kind == "message":
        text = {"type": "input_text", "text": item["content"]} if item["role"] != "assistant" else {
            "type": "output_text", "text": item["content"], "annotations": []}
        return {"id": item_id, "type": "message", "role": item["role"], "status": "completed", "content": [text]}
    if kind == "function_call":
        return {"id": item_id, "type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        return {"id": item_id, "type": "function_call_output", "call_id": item["call_id"], "output": item["output"],
                "status": "completed"}
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": item["text"]}]}


def _response(body: ResponsesIn, turn: TurnContext, model: str) -> dict[str, Any]:
    """The response object before its output (what response.created carries)."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}
    choice = body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None else \
        body.tool_choice.model_dump()
    return {"id": f"resp_{turn.id.removeprefix('kvs-')}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "previous_response_id": body.previous_response_id,
            "instructions": body.instructions, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": choice or "auto", "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": turn.request.max_tokens,
            "store": body.store, "text": {"format": fmt}, "reasoning": {"effort": None, "summary": None},
            "metadata": body.metadata or {}, "user": body.user, "truncation": "disabled", "error": None,
            "incomplete_details": None, "usage": None}


def _outcome(event: Finished, used: Usage) -> dict[str, Any]:
    """Status and usage of a finished turn (reasoning tokens: the reasoning text re-tokenized, an estimate)."""
    cut = event.finish_reason == "length"
    return {"status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": used.prompt, "input_tokens_details": {"cached_tokens": used.cached},
                      "output_tokens": used.completion,
                      "output_tokens_details": {"reasoning_tokens": used.reasoning}, "total_tokens": used.total}}


async def _store(runner: TurnRunner, response: dict[str, Any], items: list[dict[str, Any]], session_id: str,
                 tenant: str, ttl_s: int) -> None:
    """Keep the response and the items new in its turn, linked to the response it continues (a write that fails
    shows on the response: its ``store`` becomes false and ``kvshuttle.store_error`` says why)."""
    body = json.dumps({"response": response, "items": items}, ensure_ascii=False).encode()
    try:
        await runner.registry.PutResponse(registry_pb2.PutResponseRequest(response=registry_pb2.StoredResponse(
            response_id=response["id"], tenant=tenant, session_id=session_id, body_json=body,
            previous_response_id=response.get("previous_response_id") or ""), ttl_s=ttl_s),
            timeout=runner.control_timeout_s)
    except grpc.aio.AioRpcError as exc:
        response["store"] = False
        response["kvshuttle"]["store_error"] = f"{exc.code().name}: {exc.details()}"


def _sse(event: dict[str, Any]) -> bytes:
    return frame(event, event["type"])


async def _stream(runner: TurnRunner, turn: TurnContext, builder: OutputBuilder, response: dict[str, Any],
                  finished: Callable[[Finished], Any]) -> AsyncIterator[bytes]:
    for event in builder.start(response):
        yield _sse(event)
    async for item in runner.decode(turn):
        if isinstance(item, Delta):
            for event in builder.feed(item.events):
                yield _sse(event)
        elif isinstance(item, Finished):
            for event in builder.finish(item.events):
                yield _sse(event)
            done = await finished(item)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            yield _sse(builder.event(kind, response=done))