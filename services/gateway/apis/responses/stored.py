"""Stored responses, as the Responses API reads and writes them in the session registry (tenant-scoped): get one,
load a conversation's chain, store a response, delete one. A response is kept ``response_ttl_s`` after its
conversation's last stored response, with the items new in its turn, the response it continues and the session its
turn ran in; a chain read back is bounded by ``chain_max_responses`` / ``chain_max_bytes`` (ApiState's).

Registry errors become the API's: an unknown, expired or deleted response is a 404 (or, for a request field such as
``previous_response_id``, a 400 naming it); a conversation too long to read back is a 400; an unreachable registry
is a 503.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import grpc
from kvshuttle.services.gateway.apis.responses.models import RESPONSE_ID
from kvshuttle.services.gateway.apis.state import ApiState
from kvshuttle.services.gateway.turns import TurnError
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.v1 import registry_pb2

Stored = tuple[registry_pb2.StoredResponse, dict[str, Any]]  # a response's registry entry and its parsed body
_PARSE_INLINE_BYTES = 256 << 10  # bodies parsed on the event loop up to this many bytes, in a thread beyond


async def get(state: ApiState, tenant: str, response_id: str, param: str) -> Stored:
    """One stored response (``param``: the request field that named it)."""
    _check_id(response_id)
    runner = state.runner
    try:
        found = await runner.registry.GetResponse(registry_pb2.GetResponseRequest(
            response_id=response_id, tenant=tenant), timeout=runner.control_timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise _refused(exc, response_id, param) from None
    return found.response, json.loads(found.response.body_json)


async def load_chain(state: ApiState, tenant: str, response_id: str, param: str) -> list[Stored]:
    """The conversation up to ``response_id``, oldest first: each response's entry and body."""
    _check_id(response_id)
    runner = state.runner
    try:
        found = await runner.registry.GetResponseChain(registry_pb2.GetResponseChainRequest(
            response_id=response_id, tenant=tenant, max_responses=state.chain_max_responses,
            max_bytes=state.chain_max_bytes), timeout=runner.control_timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise _refused(exc, response_id, param) from None
    entries = list(found.responses)
    if sum(len(entry.body_json) for entry in entries) < _PARSE_INLINE_BYTES:
        return _parsed(entries)
    return await asyncio.to_thread(_parsed, entries)  # a long conversation: off the event loop


async def put(state: ApiState, response: dict[str, Any], items: list[dict[str, Any]], session_id: str,
              tenant: str) -> None:
    """Keep the response and the items new in its turn, linked to the response it continues (a write that fails
    shows on the response: its ``store`` becomes false and ``kvshuttle.store_error`` says why)."""
    runner = state.runner
    body = json.dumps({"response": response, "items": items}, ensure_ascii=False).encode()
    try:
        await runner.registry.PutResponse(registry_pb2.PutResponseRequest(response=registry_pb2.StoredResponse(
            response_id=response["id"], tenant=tenant, session_id=session_id, body_json=body,
            previous_response_id=response.get("previous_response_id") or ""), ttl_s=state.response_ttl_s),
            timeout=runner.control_timeout_s)
    except grpc.aio.AioRpcError as exc:
        response["store"] = False
        response["kvshuttle"]["store_error"] = f"{exc.code().name}: {exc.details()}"


async def delete(state: ApiState, tenant: str, response_id: str) -> None:
    """Delete a stored response; 404 when there is none to delete."""
    if not re.fullmatch(RESPONSE_ID, response_id):
        raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"response {response_id[:80]!r} not found")
    runner = state.runner
    try:
        gone = await runner.registry.DeleteResponse(registry_pb2.DeleteResponseRequest(
            response_id=response_id, tenant=tenant), timeout=runner.control_timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise TurnError(503, grpc.StatusCode.UNAVAILABLE, f"session registry unavailable: {exc.details()}",
                        retry_after_s=1) from None
    if not gone.deleted:
        raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"response {response_id!r} not found")


def _check_id(response_id: str) -> None:
    if not re.fullmatch(RESPONSE_ID, response_id):
        raise TurnError(404, grpc.StatusCode.NOT_FOUND, f"response {response_id[:80]!r} not found: not a "
                                                        "response id")


def _refused(exc: grpc.aio.AioRpcError, response_id: str, param: str) -> Exception:
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


def _parsed(entries: list[registry_pb2.StoredResponse]) -> list[Stored]:
    return [(entry, json.loads(entry.body_json)) for entry in entries]
