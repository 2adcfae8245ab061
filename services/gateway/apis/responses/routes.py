"""The Responses API with server-held conversations: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A thin translator onto the turn runner, like the chat route: input items (messages, ``function_call``,
``function_call_output``, ``reasoning``) become chat messages for the template (items.py); the answer is parsed into
output items (output.py). A stored response (``store``, the default) is kept in the registry (stored.py) with the
items new in its turn; the conversation is read back along its links. A request with ``previous_response_id``
continues that conversation *and that session*: the session's record holds the exact token ids the decode worker
has, so the new prompt continues those ids and pulls them. Errors are answered in OpenAI's shape by the app's
handlers (apis/http_app.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from kvshuttle.control_plane import response_chain as chains
from kvshuttle.control_plane.constraints import Constraint, json_answer
from kvshuttle.control_plane.session import InvalidArgument
from kvshuttle.services.gateway.apis.request_model import session_id_of
from kvshuttle.services.gateway.apis.responses import stored
from kvshuttle.services.gateway.apis.responses.items import (
    api_item,
    chat_messages,
    conversation_items,
    normalized_items,
    stored_items,
)
from kvshuttle.services.gateway.apis.responses.models import NamedFunctionChoice, ResponsesIn
from kvshuttle.services.gateway.apis.responses.output import OutputBuilder, outcome, response_object
from kvshuttle.services.gateway.apis.state import (
    DEFAULT_CHAIN_MAX_BYTES,
    DEFAULT_CHAIN_MAX_RESPONSES,
    DEFAULT_RESPONSE_TTL_S,
    api_state,
    prepare_turn,
)
from kvshuttle.services.gateway.edge.api_errors import SESSION_HEADER, TURN_RESPONSES
from kvshuttle.services.gateway.edge.http_entry import GatewayRoute
from kvshuttle.services.gateway.edge.http_guard import caller
from kvshuttle.services.gateway.edge.sse import frame, stream_headers, stream_response
from kvshuttle.services.gateway.turns import Delta, Finished, TurnContext, TurnRunner
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.reply import Usage, drain, kv_body, kv_headers
from kvshuttle.services.gateway.turns.tools import RESPONSES_TOOLS, NamedTool, check_schema

router = APIRouter(route_class=GatewayRoute)
_PAGE_PARAMS = frozenset({"after", "limit", "order", "include"})


def add_responses_routes(app: FastAPI, *, response_ttl_s: int = DEFAULT_RESPONSE_TTL_S,
                         chain_max_responses: int = DEFAULT_CHAIN_MAX_RESPONSES,
                         chain_max_bytes: int = DEFAULT_CHAIN_MAX_BYTES) -> None:
    """Adds the Responses API to the gateway's app (create_app's: its ApiState's models and parsers), with
    its stored-response settings: ``response_ttl_s``, and ``chain_max_*`` bounding the conversations read back
    (``previous_response_id``, input items)."""
    app.state.api = dataclasses.replace(app.state.api, response_ttl_s=response_ttl_s,
                                        chain_max_responses=chain_max_responses, chain_max_bytes=chain_max_bytes)
    app.include_router(router)


@router.post("/v1/responses", responses=TURN_RESPONSES, openapi_extra=SESSION_HEADER)
async def create(body: ResponsesIn, request: Request):
    state, who = api_state(request), caller(request)
    served = state.model(body.model, who)
    builder, runner = served.builder, served.runner
    choice = body.tool_choice
    tools = builder.tools(body.tools or [], NamedTool(choice.name) if isinstance(choice, NamedFunctionChoice)
                          else choice, RESPONSES_TOOLS, parallel=body.parallel_tool_calls, tenant=who.tenant)
    history: list[dict[str, Any]] = []
    session = session_id_of(request.headers, body.conversation_id)
    if body.previous_response_id:
        chain = await stored.load_chain(state, who.tenant, body.previous_response_id, "previous_response_id")
        history = [item for _, kept in chain for item in kept["items"]]
        session = chain[-1][0].session_id
    new_items = normalized_items(body.input)
    messages = chat_messages([*history, *new_items], body.instructions)
    req = builder.request(tools, session_id=session, tenant=who.tenant, messages=messages,
                          session_source="response" if body.previous_response_id else "",
                          cache_key=body.prompt_cache_key or "", end_user=body.user or "",
                          safety_identifier=body.safety_identifier or "",
                          template_vars={"tools": tools.tools} if tools.tools else {},
                          max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                          constraint=builder.constraint(_structured(body, who.tenant), "text.format", tools))
    turn = await prepare_turn(request, req)
    output = OutputBuilder(parallel_tool_calls=body.parallel_tool_calls)
    response = response_object(body, turn, served.name)

    async def finished(event: Finished) -> dict[str, Any]:
        used = await Usage.of(event).with_reasoning(runner.tokenizer, event.answer_events)
        out = {**response, "output": output.items, **outcome(event, used),
               "kvshuttle": kv_body(event.kv, event.timings, turn.request)}
        if body.store:  # only what is new in this turn: the conversation before it is the previous responses'
            await stored.put(state, out, [*new_items, *stored_items(output.items)], event.kv.session_id or session,
                             who.tenant)
        return out

    if body.stream:
        def error_tail(status: int, message: str) -> list[bytes]:
            return [_sse(output.event("error", code=str(status), message=message, param=None))]

        return stream_response(_stream(runner, turn, output, response, finished), turn, error_tail)
    done = await drain(runner, turn)
    output.finish(done.answer_events)  # the events a stream would have carried, in order
    return JSONResponse(await finished(done), headers={**kv_headers(done.kv), **stream_headers(turn)})


@router.get("/v1/responses/{response_id}", responses={404: TURN_RESPONSES[404]})
async def get(response_id: str, request: Request):
    who = caller(request)
    _, body = await stored.get(api_state(request), who.tenant, response_id, "response_id")
    return JSONResponse(body["response"])


@router.get("/v1/responses/{response_id}/input_items", responses={400: TURN_RESPONSES[400],
                                                                   404: TURN_RESPONSES[404]})
async def input_items(response_id: str, request: Request):
    """The items the response's turn was given, its conversation's earlier ones included (as OpenAI lists them),
    paged: ``after`` (an item id), ``limit`` (1-100, 20), ``order`` (``desc``, the default, or ``asc``)."""
    who = caller(request)
    after, limit, order = _page_query(request)
    chain = await stored.load_chain(api_state(request), who.tenant, response_id, "response_id")
    listed = conversation_items(chain)
    try:
        chosen, more = chains.page([item_id for item_id, _ in listed], after, limit, order)
    except InvalidArgument as exc:
        param = str(exc).split(" ", 1)[0].removesuffix(":")
        raise FieldError(param if param in ("after", "limit", "order") else "after", str(exc)) from None
    data = [api_item(*listed[i]) for i in chosen]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.delete("/v1/responses/{response_id}", responses={404: TURN_RESPONSES[404]})
async def delete(response_id: str, request: Request):
    who = caller(request)
    await stored.delete(api_state(request), who.tenant, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _structured(body: ResponsesIn, tenant: str) -> Constraint | None:
    """The JSON answer ``text.format`` asks for (None: text)."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    schema = None
    if fmt.type == "json_schema":
        schema = fmt.schema_ if fmt.schema_ is not None else {}
        check_schema(schema, "text.format.schema", "text.format's schema", tenant=tenant)
    return json_answer(schema)


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


def _sse(event: dict[str, Any]) -> bytes:
    return frame(event, event["type"])


async def _stream(runner: TurnRunner, turn: TurnContext, builder: OutputBuilder, response: dict[str, Any],
                  finished: Callable[[Finished], Any]) -> AsyncIterator[bytes]:
    for event in builder.start(response):
        yield _sse(event)

    def spell(delta: Delta) -> list[bytes]:  # a delta's events (the express lane's too: context.ExpressLane)
        return [_sse(event) for event in builder.feed(delta.events)]

    turn.express.spell = spell
    async for item in runner.decode(turn):
        if isinstance(item, Delta):
            for frame in spell(item):
                yield frame
        elif isinstance(item, Finished):
            for event in builder.finish(item.events):
                yield _sse(event)
            done = await finished(item)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            yield _sse(builder.event(kind, response=done))