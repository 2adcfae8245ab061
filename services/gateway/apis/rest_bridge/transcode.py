"""protobuf's JSON mapping for the REST bridge: a request message from the HTTP request (the JSON body, query
parameters, path variables; unknown fields and bad values are BridgeErrors, 400s), and a reply message as JSON
(lowerCamel names, int64 as strings, enum names)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from kvshuttle.services.gateway.apis.rest_bridge.errors import BridgeError
from kvshuttle.services.gateway.apis.rest_bridge.specs import STRING_LIKE_WKT, RouteSpec, resolve_field_path
from kvshuttle.services.gateway.edge import input_check
from starlette.requests import Request

_TRUE = {"true", "True", "TRUE", "t", "T", "1"}
_FALSE = {"false", "False", "FALSE", "f", "F", "0"}



async def request_message(spec: RouteSpec, request: Request, max_body_bytes: int) -> Message:
    """The binding's request message, filled from the body, then the query, then the path."""
    message = spec.request_class()
    if spec.body:
        body = await read_body(request, max_body_bytes)
        if body.strip():
            try:
                value = json.loads(body)
            except (ValueError, RecursionError) as e:
                raise BridgeError(f"malformed JSON body: {e}") from None
            try:
                input_check.check(value)
            except input_check.InputError as e:
                raise BridgeError(str(e)) from None
            if spec.body == "*":
                if not isinstance(value, dict):
                    raise BridgeError("the JSON body must be an object")
                parse_into(value, message)
            else:
                parse_into({spec.body: value}, message)
    query = query_dict(spec, request.query_params.multi_items())
    if query:
        parse_into(query, message)
    path_values: dict[str, Any] = {}
    for group, field_path in spec.template.variables:
        raw = request.path_params[group]
        fields = resolve_field_path(spec.method.input_type, field_path)
        set_nested(path_values, [f.name for f in fields], scalar_json(fields[-1], raw))
    if path_values:
        parse_into(path_values, message)
    return message


def reply_json(spec: RouteSpec, reply: Message, emit_defaults: bool) -> Any:
    """A reply as protobuf JSON (its ``response_body`` field only, when the binding names one)."""
    data = json_format.MessageToDict(reply, always_print_fields_with_no_presence=emit_defaults,
                                     preserving_proto_field_name=False)
    if spec.response_body:
        fd = reply.DESCRIPTOR.fields_by_name[spec.response_body]
        return data.get(fd.json_name)
    return data


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BridgeError(f"request body over {limit} bytes", grpc.StatusCode.RESOURCE_EXHAUSTED, 413)
        chunks.append(chunk)
    return b"".join(chunks)


_NUMBER_TYPES = frozenset(getattr(FieldDescriptor, f"TYPE_{t}") for t in (
    "DOUBLE", "FLOAT", "INT32", "INT64", "UINT32", "UINT64", "SINT32", "SINT64", "FIXED32", "FIXED64", "SFIXED32",
    "SFIXED64", "ENUM"))


def _reject_bool_numbers(value: Any, desc: Descriptor) -> None:
    """protobuf's Python parser takes JSON ``true``/``false`` for numbers (bool is an int in Python); the JSON
    mapping does not."""
    if not isinstance(value, dict):
        return
    for key, item in value.items():
        fd = desc.fields_by_name.get(key) or next((f for f in desc.fields if f.json_name == key), None)
        if fd is None or (fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry):
            continue
        for v in item if fd.is_repeated and isinstance(item, list) else [item]:
            if isinstance(v, bool) and fd.type in _NUMBER_TYPES:
                raise BridgeError(f"field {fd.name}: {str(v).lower()} is not a number")
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                _reject_bool_numbers(v, fd.message_type)


def parse_into(value: dict[str, Any], message: Message) -> None:
    """Merge protobuf-JSON ``value`` into ``message``; any mismatch is a BridgeError (400)."""
    _reject_bool_numbers(value, message.DESCRIPTOR)
    try:
        json_format.ParseDict(value, message, ignore_unknown_fields=False)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
        raise BridgeError(str(e).split("\n")[0]) from None


def query_dict(spec: RouteSpec, items: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Query parameters as a nested protobuf-JSON dict keyed by proto field names."""
    bound = spec.bound_paths()
    grouped: dict[tuple[str, ...], tuple[list[FieldDescriptor], list[str]]] = {}
    for key, raw in items:
        if spec.body == "*":
            raise BridgeError(f"unexpected query parameter {key!r}: this method takes its request from the body")
        try:
            fields = resolve_field_path(spec.method.input_type, tuple(key.split(".")))
        except ValueError as e:
            raise BridgeError(f"unknown query parameter {key!r}: {e}") from None
        names = tuple(f.name for f in fields)
        for b in bound:
            if names[:len(b)] == b or b[:len(names)] == names:
                raise BridgeError(f"query parameter {key!r} names a field bound by the path or body")
        leaf = fields[-1]
        if leaf.type == FieldDescriptor.TYPE_MESSAGE and leaf.message_type.full_name not in STRING_LIKE_WKT:
            raise BridgeError(f"query parameter {key!r} names a message; name one of its fields instead")
        grouped.setdefault(names, (fields, []))[1].append(raw)
    result: dict[str, Any] = {}
    for names, (fields, raws) in grouped.items():
        leaf = fields[-1]
        if leaf.is_repeated:
            value: Any = [scalar_json(leaf, r) for r in raws]
        elif len(raws) > 1:
            raise BridgeError(f"query parameter {'.'.join(names)!r} given {len(raws)} times for a singular field")
        else:
            value = scalar_json(leaf, raws[0])
        set_nested(result, list(names), value)
    return result


def scalar_json(fd: FieldDescriptor, raw: str) -> Any:
    """A path/query string as the JSON value json_format expects for ``fd`` (it takes numbers as strings already)."""
    if fd.type == FieldDescriptor.TYPE_BOOL or (
            fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.full_name == "google.protobuf.BoolValue"):
        if raw in _TRUE:
            return True
        if raw in _FALSE:
            return False
        raise BridgeError(f"field {fd.name}: {raw!r} is not a boolean")
    return raw


def set_nested(target: dict[str, Any], names: list[str], value: Any) -> None:
    for name in names[:-1]:
        target = target.setdefault(name, {})
    target[names[-1]] = value
