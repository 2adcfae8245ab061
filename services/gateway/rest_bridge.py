"""REST bridge: HTTP/JSON routes built from the ``google.api.http`` annotations of gRPC services.

The HttpRule options are read at runtime from the descriptors of the generated modules, and each request is forwarded
over a grpc.aio channel with generic (de)serializers, so an annotated method needs no hand-written route.
The mapping follows google/api/http.proto as grpc-gateway and Envoy's transcoder implement it:

* path template variables (``{session_id}``, nested ``{a.b}``, ``{name=shelves/*}``, ``**``, ``:verb``) fill fields;
* ``body: "*"`` reads the whole request from the JSON body, ``body: "field"`` that one field; every field bound by
  neither comes from query parameters (``?tenant=x``, ``?sampling.maxTokens=5``, repeated ``?stop=a&stop=b``);
* protobuf's JSON mapping both ways: lowerCamel names out (either name in), int64 as strings, enum names,
  unknown fields and bad values are 400s;
* unary methods answer one JSON object; server-streaming methods answer ``application/x-ndjson``, one message per line,
  and a final ``{"error": {...}}`` line if the stream fails after it started;
* failures answer ``{"error": {"code": <http>, "status": "<gRPC code>", "message": "..."}}`` with grpc-gateway's
  gRPC-to-HTTP status map.

Usage::

    app.router.routes.extend(bridge_routes({"kvshuttle.v1.SessionRegistry": registry_channel}))
    install_openapi(app, ["kvshuttle.v1.SessionRegistry"])
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

import grpc
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

# Importing the generated modules registers kvshuttle's services in the default descriptor pool.
from kvshuttle.services.gateway import input_check
from kvshuttle.v1 import gateway_pb2, registry_pb2, scheduler_pb2  # noqa: F401
from starlette.convertors import StringConvertor
from starlette.datastructures import URLPath
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Match, NoMatchFound, Route
from starlette.types import Scope

try:  # Trace context: make the gRPC client span a child of the incoming HTTP request's trace.
    from opentelemetry import context as otel_context
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace
except ImportError:  # pragma: no cover - opentelemetry is a dependency, but the bridge does not need it
    otel_context = otel_propagate = otel_trace = None

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
DEFAULT_FORWARD_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")

# grpc-gateway's runtime.HTTPStatusFromCode.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}

# Message types whose JSON form is a string or number, so a path or query parameter can fill them.
_STRING_LIKE_WKT = {
    "google.protobuf.Timestamp", "google.protobuf.Duration", "google.protobuf.FieldMask",
    "google.protobuf.DoubleValue", "google.protobuf.FloatValue", "google.protobuf.Int64Value",
    "google.protobuf.UInt64Value", "google.protobuf.Int32Value", "google.protobuf.UInt32Value",
    "google.protobuf.BoolValue", "google.protobuf.StringValue", "google.protobuf.BytesValue",
}
_TRUE = {"true", "True", "TRUE", "t", "T", "1"}
_FALSE = {"false", "False", "FALSE", "f", "F", "0"}


@dataclass(frozen=True)
class BridgeOptions:
    """How bridged calls are made.

    ``method_timeouts`` overrides the deadline per method, keyed ``/kvshuttle.v1.Gateway/Complete``; ``None`` there
    or in ``timeout``/``stream_timeout`` means no deadline. ``forward_headers`` are copied, lower-cased, into the
    gRPC metadata. ``emit_defaults`` prints fields that hold their default value (grpc-gateway v2 does).
    ``authorize(request, spec, message)`` runs before each call: it may change the request message (e.g. set the
    caller's tenant, whatever the client sent) or raise BridgeError (e.g. PERMISSION_DENIED). ``redact(request, spec,
    reply)`` may clear fields of a unary reply before it is sent (e.g. worker addresses for non-admins).
    ``metadata`` is added to every call.
    """

    timeout: float | None = 60.0
    stream_timeout: float | None = 600.0
    method_timeouts: Mapping[str, float | None] = field(default_factory=dict)
    forward_headers: tuple[str, ...] = DEFAULT_FORWARD_HEADERS
    emit_defaults: bool = True
    max_body_bytes: int = 4 << 20
    authorize: Callable[[Request, RouteSpec, Message], None] | None = None
    redact: Callable[[Request, RouteSpec, Message], None] | None = None
    metadata: tuple[tuple[str, str], ...] = ()

    def timeout_for(self, spec: RouteSpec) -> float | None:
        if spec.full_method in self.method_timeouts:
            return self.method_timeouts[spec.full_method]
        return self.stream_timeout if spec.server_streaming else self.timeout


class BridgeError(Exception):
    """A request the bridge cannot turn into a gRPC call (answered without calling the server)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
                 http_status: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.http_status = http_status or HTTP_STATUS.get(code, 500)


# ---------------------------------------------------------------------------------------------------------- templates

@dataclass(frozen=True)
class PathTemplate:
    """A compiled google.api.http path template.

    ``variables`` pairs each regex group name with the request field path it fills; ``openapi_path`` is the template
    with every variable written ``{field.path}``.
    """

    template: str
    regex: re.Pattern[str]
    variables: tuple[tuple[str, tuple[str, ...]], ...]
    openapi_path: str

    @classmethod
    def parse(cls, template: str) -> PathTemplate:
        if not template.startswith("/"):
            raise ValueError(f"path template {template!r} must start with '/'")
        path, verb = _split_verb(template)
        regex_parts: list[str] = []
        openapi_parts: list[str] = []
        variables: list[tuple[str, tuple[str, ...]]] = []
        for segment in _split_top(path[1:], "/"):
            if segment.startswith("{"):
                if not segment.endswith("}"):
                    raise ValueError(f"bad variable {segment!r} in {template!r}")
                name, _, pattern = segment[1:-1].partition("=")
                field_path = tuple(name.split("."))
                if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in field_path):
                    raise ValueError(f"bad field path {name!r} in {template!r}")
                group = f"v{len(variables)}"
                inner = "/".join(_segment_regex(s, template) for s in pattern.split("/")) if pattern else "[^/]+"
                regex_parts.append(f"(?P<{group}>{inner})")
                openapi_parts.append("{" + name + "}")
                variables.append((group, field_path))
            else:
                regex_parts.append(_segment_regex(segment, template))
                openapi_parts.append(segment)
        suffix = ":" + verb if verb else ""
        regex = re.compile("^/" + "/".join(regex_parts) + re.escape(suffix) + "$")
        return cls(template, regex, tuple(variables), "/" + "/".join(openapi_parts) + suffix)


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _split_verb(template: str) -> tuple[str, str]:
    """``/v1/x/{id}:cancel`` -> (``/v1/x/{id}``, ``cancel``)."""
    depth, last_slash, colon = 0, -1, -1
    for i, ch in enumerate(template):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0 and ch == "/":
            last_slash, colon = i, -1
        elif depth == 0 and ch == ":":
            colon = i
    if colon > last_slash >= 0:
        return template[:colon], template[colon + 1:]
    return template, ""


def _segment_regex(segment: str, template: str) -> str:
    if segment == "*":
        return "[^/]+"
    if segment == "**":
        return ".+"
    if not segment or any(c in segment for c in "{}*"):
        raise ValueError(f"bad segment {segment!r} in {template!r}")
    return re.escape(segment)


# ------------------------------------------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class RouteSpec:
    """One HTTP binding of one gRPC method (a method has one per HttpRule, plus its additional_bindings)."""

    method: MethodDescriptor
    http_method: str
    template: PathTemplate
    body: str = ""
    response_body: str = ""

    @property
    def full_method(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def server_streaming(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def request_class(self) -> type[Message]:
        return message_factory.GetMessageClass(self.method.input_type)

    @property
    def response_class(self) -> type[Message]:
        return message_factory.GetMessageClass(self.method.output_type)

    def bound_paths(self) -> list[tuple[str, ...]]:
        """Field paths filled by the path and the body (query parameters may not name these)."""
        paths = [fp for _, fp in self.template.variables]
        if self.body and self.body != "*":
            paths.append((self.body,))
        return paths

    def validate(self) -> None:
        if self.method.client_streaming:
            raise ValueError(f"{self.full_method}: client-streaming methods cannot be bridged to REST")
        if self.http_method in ("GET", "DELETE", "HEAD") and self.body:
            # Allowed by the spec for DELETE, but a body on these methods is rarely sent by clients.
            log.warning("%s: %s binding with a body", self.full_method, self.http_method)
        for _, field_path in self.template.variables:
            leaf = _resolve_field_path(self.method.input_type, field_path)[-1]
            if leaf.is_repeated or (leaf.type == FieldDescriptor.TYPE_MESSAGE
                                    and leaf.message_type.full_name not in _STRING_LIKE_WKT):
                raise ValueError(f"{self.full_method}: path variable {'.'.join(field_path)} must be a singular scalar")
        if self.body and self.body != "*":
            _resolve_field_path(self.method.input_type, (self.body,))
        if self.response_body:
            _resolve_field_path(self.method.output_type, (self.response_body,))


def http_rule(method: MethodDescriptor) -> http_pb2.HttpRule | None:
    """The method's ``google.api.http`` option, or None."""
    options = method.GetOptions()
    if not options.HasExtension(annotations_pb2.http):
        return None
    return options.Extensions[annotations_pb2.http]


def specs_from_rule(method: MethodDescriptor, rule: http_pb2.HttpRule) -> list[RouteSpec]:
    """The bindings of one HttpRule (additional_bindings included), validated against the method's messages."""
    kind = rule.WhichOneof("pattern")
    if kind is None:
        raise ValueError(f"{method.full_name}: google.api.http rule without a pattern")
    if kind == "custom":
        http_method, template = rule.custom.kind.upper(), rule.custom.path
    else:
        http_method, template = kind.upper(), getattr(rule, kind)
    spec = RouteSpec(method, http_method, PathTemplate.parse(template), rule.body, rule.response_body)
    spec.validate()
    specs = [spec]
    for extra in rule.additional_bindings:
        if extra.additional_bindings:
            raise ValueError(f"{method.full_name}: additional_bindings may not nest")
        specs.extend(specs_from_rule(method, extra))
    return specs


def service_specs(service: ServiceDescriptor) -> list[RouteSpec]:
    """Every HTTP binding of every annotated method of ``service``."""
    specs: list[RouteSpec] = []
    for method in service.methods:
        rule = http_rule(method)
        if rule is not None:
            specs.extend(specs_from_rule(method, rule))
    return specs


def find_service(name: str, pool: descriptor_pool.DescriptorPool | None = None) -> ServiceDescriptor:
    try:
        return (pool or descriptor_pool.Default()).FindServiceByName(name)
    except KeyError:
        raise ValueError(f"unknown gRPC service {name!r}: import its generated _pb2 module first") from None


# ------------------------------------------------------------------------------------------------------------ routes

def bridge_routes(services: Mapping[str, grpc.aio.Channel], options: BridgeOptions | None = None, *,
                  pool: descriptor_pool.DescriptorPool | None = None) -> list[Route]:
    """Starlette routes (usable in FastAPI: ``app.router.routes.extend(...)``) for every annotated method.

    ``services`` maps full service names to channels that reach a server of that service. Raises ValueError for an
    unknown service, a malformed annotation, or two bindings of the same HTTP method and path.
    """
    options = options or BridgeOptions()
    routes: list[Route] = []
    seen: dict[tuple[str, str], str] = {}
    for name, channel in services.items():
        for spec in service_specs(find_service(name, pool)):
            key = (spec.http_method, spec.template.regex.pattern)
            if key in seen:
                raise ValueError(f"{spec.full_method} and {seen[key]} both bind {spec.http_method} "
                                 f"{spec.template.template}")
            seen[key] = spec.full_method
            routes.append(build_route(spec, channel, options))
    return routes


def build_route(spec: RouteSpec, channel: grpc.aio.Channel, options: BridgeOptions | None = None) -> Route:
    """The route for one binding; also the way to bridge a method with an ad-hoc HttpRule."""
    return _BridgeRoute(spec, _Endpoint(spec, channel, options or BridgeOptions()))


class _BridgeRoute(Route):
    """A Starlette Route that matches with the template's own regex (Starlette's syntax lacks ``*``/``**``)."""

    def __init__(self, spec: RouteSpec, endpoint: _Endpoint):
        super().__init__("/", endpoint.handle, methods=[spec.http_method],
                         name=f"{spec.method.containing_service.name}.{spec.method.name}", include_in_schema=False)
        self.spec = spec
        self.path = spec.template.openapi_path
        self.path_regex = spec.template.regex
        self.path_format = spec.template.openapi_path
        self.param_convertors = {group: StringConvertor() for group, _ in spec.template.variables}

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:  # templates are not reversible in general
        raise NoMatchFound(name, path_params)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        """Matched on the path as sent, each variable percent-decoded after (google/api/http.proto: a client encodes
        a single-segment variable's ``/`` as ``%2F``, so ``/v1/sessions/a%2Fb`` is session ``a/b``, which the method
        refuses by name, not a path with one more segment)."""
        raw = scope.get("raw_path")
        if scope["type"] != "http" or not raw or scope.get("root_path"):
            return super().matches(scope)
        match = self.path_regex.match(raw.decode("latin-1"))
        if not match:
            return Match.NONE, {}
        params = {**scope.get("path_params", {}), **{k: _decoded(v) for k, v in match.groupdict().items()}}
        child = {"endpoint": self.endpoint, "path_params": params}
        return (Match.PARTIAL if self.methods and scope["method"] not in self.methods else Match.FULL), child


def _decoded(raw: str) -> str:
    """A path variable as sent (percent-encoded UTF-8), decoded; bytes that are not UTF-8 become U+FFFD."""
    return unquote_to_bytes(raw.encode("latin-1")).decode("utf-8", "replace")


class _Endpoint:
    def __init__(self, spec: RouteSpec, channel: grpc.aio.Channel, options: BridgeOptions):
        self.spec = spec
        self.options = options
        make = channel.unary_stream if spec.server_streaming else channel.unary_unary
        self.call = make(spec.full_method, request_serializer=spec.request_class.SerializeToString,
                         response_deserializer=spec.response_class.FromString)
        self.request_class = spec.request_class

    async def handle(self, request: Request) -> Response:
        try:
            message = await self._request_message(request)
            if self.options.authorize is not None:
                self.options.authorize(request, self.spec, message)
        except BridgeError as e:
            return error_response(e.http_status, e.code, e.message)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:  # a bug here must still answer JSON, not drop the connection
            log.exception("REST bridge failure reading a request for %s", self.spec.full_method)
            return error_response(500, grpc.StatusCode.INTERNAL, "internal error in the REST bridge")
        metadata = forwarded_metadata(request.headers, self.options.forward_headers)
        for key, value in self.options.metadata:
            metadata.add(key, value)
        timeout = self.options.timeout_for(self.spec)
        try:
            with _incoming_trace(request.headers, self.options.forward_headers):
                if self.spec.server_streaming:
                    return await self._stream(message, timeout, metadata)
                reply = await self.call(message, timeout=timeout, metadata=metadata)
            if self.options.redact is not None:
                self.options.redact(request, self.spec, reply)
            return Response(_dumps(self._to_json(reply)), media_type="application/json")
        except grpc.aio.AioRpcError as e:
            return rpc_error_response(e)
        except Exception:  # a bug here must still answer JSON, not drop the connection
            log.exception("REST bridge failure on %s", self.spec.full_method)
            return error_response(500, grpc.StatusCode.INTERNAL, "internal error in the REST bridge")

    async def _stream(self, message: Message, timeout: float | None, metadata: grpc.aio.Metadata) -> Response:
        call = self.call(message, timeout=timeout, metadata=metadata)
        # Wait for the first message so that an immediate failure still gets its HTTP status.
        try:
            first = await call.read()
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            return Response(b"", media_type=NDJSON)

        async def lines() -> AsyncIterator[bytes]:
            try:
                item = first
                while item is not grpc.aio.EOF:
                    yield _dumps(self._to_json(item)) + b"\n"
                    item = await call.read()
            except grpc.aio.AioRpcError as e:
                yield _dumps(_error_body(HTTP_STATUS.get(e.code(), 500), e.code(), e.details() or "")) + b"\n"
            except Exception:
                log.exception("REST bridge failure while streaming %s", self.spec.full_method)
                yield _dumps(_error_body(500, grpc.StatusCode.INTERNAL, "internal error in the REST bridge")) + b"\n"
            finally:
                call.cancel()  # no-op when finished; stops the server when the HTTP client went away

        return StreamingResponse(lines(), media_type=NDJSON)

    def _to_json(self, reply: Message) -> Any:
        data = json_format.MessageToDict(reply, always_print_fields_with_no_presence=self.options.emit_defaults,
                                         preserving_proto_field_name=False)
        if self.spec.response_body:
            fd = reply.DESCRIPTOR.fields_by_name[self.spec.response_body]
            return data.get(fd.json_name)
        return data

    async def _request_message(self, request: Request) -> Message:
        spec = self.spec
        message = self.request_class()
        if spec.body:
            body = await _read_body(request, self.options.max_body_bytes)
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
                    _parse_into(value, message)
                else:
                    _parse_into({spec.body: value}, message)
        query = _query_dict(spec, request.query_params.multi_items())
        if query:
            _parse_into(query, message)
        path_values: dict[str, Any] = {}
        for group, field_path in spec.template.variables:
            raw = request.path_params[group]
            fields = _resolve_field_path(spec.method.input_type, field_path)
            _set_nested(path_values, [f.name for f in fields], _scalar_json(fields[-1], raw))
        if path_values:
            _parse_into(path_values, message)
        return message


async def _read_body(request: Request, limit: int) -> bytes:
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


def _parse_into(value: dict[str, Any], message: Message) -> None:
    """Merge protobuf-JSON ``value`` into ``message``; any mismatch is a BridgeError (400)."""
    _reject_bool_numbers(value, message.DESCRIPTOR)
    try:
        json_format.ParseDict(value, message, ignore_unknown_fields=False)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
        raise BridgeError(str(e).split("\n")[0]) from None


def _query_dict(spec: RouteSpec, items: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Query parameters as a nested protobuf-JSON dict keyed by proto field names."""
    bound = spec.bound_paths()
    grouped: dict[tuple[str, ...], tuple[list[FieldDescriptor], list[str]]] = {}
    for key, raw in items:
        if spec.body == "*":
            raise BridgeError(f"unexpected query parameter {key!r}: this method takes its request from the body")
        try:
            fields = _resolve_field_path(spec.method.input_type, tuple(key.split(".")))
        except ValueError as e:
            raise BridgeError(f"unknown query parameter {key!r}: {e}") from None
        names = tuple(f.name for f in fields)
        for b in bound:
            if names[:len(b)] == b or b[:len(names)] == names:
                raise BridgeError(f"query parameter {key!r} names a field bound by the path or body")
        leaf = fields[-1]
        if leaf.type == FieldDescriptor.TYPE_MESSAGE and leaf.message_type.full_name not in _STRING_LIKE_WKT:
            raise BridgeError(f"query parameter {key!r} names a message; name one of its fields instead")
        grouped.setdefault(names, (fields, []))[1].append(raw)
    result: dict[str, Any] = {}
    for names, (fields, raws) in grouped.items():
        leaf = fields[-1]
        if leaf.is_repeated:
            value: Any = [_scalar_json(leaf, r) for r in raws]
        elif len(raws) > 1:
            raise BridgeError(f"query parameter {'.'.join(names)!r} given {len(raws)} times for a singular field")
        else:
            value = _scalar_json(leaf, raws[0])
        _set_nested(result, list(names), value)
    return result


def _resolve_field_path(desc: Descriptor, path: tuple[str, ...]) -> list[FieldDescriptor]:
    """Field descriptors along ``path`` (proto or JSON names); every step but the last must be a singular message."""
    fields: list[FieldDescriptor] = []
    for i, name in enumerate(path):
        if desc is None:
            raise ValueError(f"{'.'.join(path[:i])} is not a message")
        fd = desc.fields_by_name.get(name) or next((f for f in desc.fields if f.json_name == name), None)
        if fd is None:
            raise ValueError(f"{desc.full_name} has no field {name!r}")
        if i < len(path) - 1 and (fd.is_repeated or fd.type != FieldDescriptor.TYPE_MESSAGE):
            raise ValueError(f"{'.'.join(path[:i + 1])} is not a singular message")
        fields.append(fd)
        desc = fd.message_type
    return fields


def _scalar_json(fd: FieldDescriptor, raw: str) -> Any:
    """A path/query string as the JSON value json_format expects for ``fd`` (it takes numbers as strings already)."""
    if fd.type == FieldDescriptor.TYPE_BOOL or (
            fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.full_name == "google.protobuf.BoolValue"):
        if raw in _TRUE:
            return True
        if raw in _FALSE:
            return False
        raise BridgeError(f"field {fd.name}: {raw!r} is not a boolean")
    return raw


def _set_nested(target: dict[str, Any], names: list[str], value: Any) -> None:
    for name in names[:-1]:
        target = target.setdefault(name, {})
    target[names[-1]] = value


# ---------------------------------------------------------------------------------------------- metadata and tracing

def forwarded_metadata(headers: Mapping[str, str], names: Iterable[str]) -> grpc.aio.Metadata:
    """The configured HTTP headers as gRPC metadata (ASCII values only; ``-bin`` headers are skipped)."""
    metadata = grpc.aio.Metadata()
    for name in names:
        key = name.lower()
        if key.endswith("-bin") or key.startswith("grpc-"):
            continue
        for value in headers.getlist(key) if hasattr(headers, "getlist") else [headers.get(key)]:
            if value is not None and value.isascii() and value.isprintable():
                metadata.add(key, value)
    return metadata


@contextlib.contextmanager
def _incoming_trace(headers: Mapping[str, str], forward: tuple[str, ...]) -> Iterator[None]:
    """Use the request's W3C trace context while calling, unless a server span (e.g. an instrumented app) is current.

    Without this, an OpenTelemetry-instrumented channel would replace the forwarded ``traceparent`` with a new trace.
    """
    if otel_trace is None or "traceparent" not in forward or "traceparent" not in headers \
            or otel_trace.get_current_span().get_span_context().is_valid:
        yield
        return
    token = otel_context.attach(otel_propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


# ------------------------------------------------------------------------------------------------------------ errors

def _error_body(http_status: int, code: grpc.StatusCode, message: str) -> dict[str, Any]:
    return {"error": {"code": http_status, "status": code.name, "message": message}}


def error_response(http_status: int, code: grpc.StatusCode, message: str) -> Response:
    return Response(_dumps(_error_body(http_status, code, message)), status_code=http_status,
                    media_type="application/json")


def rpc_error_response(error: grpc.aio.AioRpcError) -> Response:
    """The call's error as JSON; a ``retry-after`` in its trailing metadata becomes HTTP ``Retry-After``."""
    code = error.code()
    response = error_response(HTTP_STATUS.get(code, 500), code, error.details() or code.name)
    retry = next((v for k, v in error.trailing_metadata() or () if k == "retry-after"), None)
    if isinstance(retry, str) and retry.isdigit():
        response.headers["Retry-After"] = retry
    return response


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------------------------------------- OpenAPI

_SCALAR_SCHEMAS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float"},
    FieldDescriptor.TYPE_INT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "uint64"},
    FieldDescriptor.TYPE_SINT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_FIXED64: {"type": "string", "format": "uint64"},
    FieldDescriptor.TYPE_SFIXED64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
}
_WKT_SCHEMAS: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "example": "1.5s"},
    "google.protobuf.FieldMask": {"type": "string"},
    "google.protobuf.Empty": {"type": "object"},
    "google.protobuf.Struct": {"type": "object", "additionalProperties": True},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array", "items": {}},
    "google.protobuf.Any": {"type": "object", "properties": {"@type": {"type": "string"}},
                            "additionalProperties": True},
    "google.protobuf.DoubleValue": {"type": "number", "format": "double"},
    "google.protobuf.FloatValue": {"type": "number", "format": "float"},
    "google.protobuf.Int64Value": {"type": "string", "format": "int64"},
    "google.protobuf.UInt64Value": {"type": "string", "format": "uint64"},
    "google.protobuf.Int32Value": {"type": "integer", "format": "int32"},
    "google.protobuf.UInt32Value": {"type": "integer", "format": "int64", "minimum": 0},
    "google.protobuf.BoolValue": {"type": "boolean"},
    "google.protobuf.StringValue": {"type": "string"},
    "google.protobuf.BytesValue": {"type": "string", "format": "byte"},
}
ERROR_SCHEMA_NAME = "kvshuttle.bridge.Error"
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "status", "message"], "properties": {
        "code": {"type": "integer", "description": "HTTP status"},
        "status": {"type": "string", "description": "gRPC status code name, e.g. NOT_FOUND"},
        "message": {"type": "string"}}}},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


class _SchemaCollector:
    """``constraints``: extra JSON Schema keywords by full proto name, merged into that message's or field's schema
    (a repeated field's: into the array; an ``items`` entry into its items) for what the server checks beyond types."""

    def __init__(self, constraints: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.schemas: dict[str, Any] = {}
        self.constraints = constraints or {}

    def message(self, desc: Descriptor) -> dict[str, Any]:
        if desc.full_name in _WKT_SCHEMAS:
            return dict(_WKT_SCHEMAS[desc.full_name])
        if desc.full_name not in self.schemas:
            self.schemas[desc.full_name] = {}  # placeholder first: recursive messages terminate
            self.schemas[desc.full_name] = {
                "type": "object",
                "properties": {fd.json_name: self.field(fd) for fd in desc.fields},
                **self.constraints.get(desc.full_name, {}),
            }
        return _ref(desc.full_name)

    def field(self, fd: FieldDescriptor) -> dict[str, Any]:
        if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            return {"type": "object", "additionalProperties": self.single(fd.message_type.fields_by_name["value"])}
        single = self.single(fd)
        schema = {"type": "array", "items": single} if fd.is_repeated else single
        extra = dict(self.constraints.get(fd.full_name, {}))
        if isinstance(extra.get("items"), Mapping) and fd.is_repeated:
            schema["items"] = {**single, **extra.pop("items")}
        return {**schema, **extra}

    def single(self, fd: FieldDescriptor) -> dict[str, Any]:
        if fd.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            return self.message(fd.message_type)
        if fd.type == FieldDescriptor.TYPE_ENUM:  # protobuf's JSON parser takes a value's name or its number
            values = fd.enum_type.values
            return {"type": ["string", "integer"], "enum": [v.name for v in values] + [v.number for v in values]}
        return dict(_SCALAR_SCHEMAS[fd.type])


def _query_parameters(spec: RouteSpec, collector: _SchemaCollector) -> list[dict[str, Any]]:
    if spec.body == "*":
        return []
    bound = spec.bound_paths()
    params: list[dict[str, Any]] = []

    def walk(desc: Descriptor, prefix: tuple[str, ...], json_prefix: tuple[str, ...], seen: frozenset[str]) -> None:
        for fd in desc.fields:
            names = (*prefix, fd.name)
            if any(names[:len(b)] == b for b in bound):
                continue
            is_message = fd.type == FieldDescriptor.TYPE_MESSAGE
            if is_message and fd.message_type.full_name not in _STRING_LIKE_WKT:
                if not fd.is_repeated and fd.message_type.full_name not in seen:
                    walk(fd.message_type, names, (*json_prefix, fd.json_name),
                         seen | {fd.message_type.full_name})
                continue
            params.append({"name": ".".join((*json_prefix, fd.json_name)), "in": "query", "required": False,
                           "schema": collector.field(fd), **({"explode": True} if fd.is_repeated else {})})

    walk(spec.method.input_type, (), (), frozenset({spec.method.input_type.full_name}))
    return params


def openapi_parts(service_names: Iterable[str], pool: descriptor_pool.DescriptorPool | None = None,
                  constraints: Mapping[str, Mapping[str, Any]] | None = None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenAPI 3 ``paths`` and ``components.schemas`` for the bridged routes of ``service_names``.

    ``constraints``: extra JSON Schema keywords by full proto message or field name (``pkg.Msg.field``), e.g. the
    ``pattern`` of an id the server validates; without them the document only knows the proto's types."""
    collector = _SchemaCollector(constraints)
    collector.schemas[ERROR_SCHEMA_NAME] = _ERROR_SCHEMA
    paths: dict[str, Any] = {}
    request_roots: set[str] = set()
    for name in service_names:
        service = find_service(name, pool)
        per_method: dict[str, int] = {}
        for spec in service_specs(service):
            method = spec.method
            index = per_method[method.name] = per_method.get(method.name, -1) + 1
            parameters = []
            for _, field_path in spec.template.variables:
                leaf = _resolve_field_path(method.input_type, field_path)[-1]
                parameters.append({"name": ".".join(field_path), "in": "path", "required": True,
                                   "schema": collector.field(leaf)})
            parameters += _query_parameters(spec, collector)
            response_schema = collector.message(method.output_type)
            if spec.response_body:
                response_schema = collector.field(method.output_type.fields_by_name[spec.response_body])
            media = NDJSON if spec.server_streaming else "application/json"
            operation: dict[str, Any] = {
                "operationId": f"{service.name}_{method.name}" + (f"_{index}" if index else ""),
                "tags": [service.name],
                "summary": f"{service.full_name}/{method.name} (gRPC)",
                "parameters": parameters,
                "responses": {
                    "200": {"description": "OK" + (" (one JSON message per line)" if spec.server_streaming else ""),
                            "content": {media: {"schema": response_schema}}},
                    "default": {"description": "Error",
                                "content": {"application/json": {"schema": _ref(ERROR_SCHEMA_NAME)}}},
                },
            }
            if spec.body:
                body_schema = (collector.message(method.input_type) if spec.body == "*"
                               else collector.field(method.input_type.fields_by_name[spec.body]))
                operation["requestBody"] = {"required": spec.body != "*",
                                            "content": {"application/json": {"schema": body_schema}}}
                request_roots.update(_refs_in(body_schema))
            paths.setdefault(spec.template.openapi_path, {})[spec.http_method.lower()] = operation
    _null_in_requests(collector.schemas, request_roots)
    return paths, collector.schemas


def _refs_in(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            yield ref.rsplit("/", 1)[1]
        for value in schema.values():
            yield from _refs_in(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _refs_in(value)


def _null_in_requests(schemas: dict[str, Any], roots: Iterable[str]) -> None:
    """protobuf's JSON parser takes ``null`` for any field (the default value): say so in the messages a request body
    may hold, except for the fields a constraint requires."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name not in seen and name in schemas:
            seen.add(name)
            stack.extend(_refs_in(schemas[name]))
    for name in seen:
        schema = schemas[name]
        required = set(schema.get("required", ()))
        schema["properties"] = {key: value if key in required else _or_null(value)
                                for key, value in schema.get("properties", {}).items()}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    if "type" not in schema:
        return schema
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    nullable = {**schema, "type": [*types, "null"]}
    if "enum" in schema:
        nullable["enum"] = [*schema["enum"], None]
    return nullable


def openapi_paths(service_names: Iterable[str], pool: descriptor_pool.DescriptorPool | None = None) -> dict[str, Any]:
    """The OpenAPI ``paths`` object for the bridged routes (schemas: see :func:`openapi_parts`)."""
    return openapi_parts(service_names, pool)[0]


def install_openapi(app: Any, service_names: Iterable[str],
                    pool: descriptor_pool.DescriptorPool | None = None,
                    constraints: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Merge the bridged routes into a FastAPI app's generated OpenAPI document (``app.openapi()``); ``constraints``:
    see :func:`openapi_parts`."""
    names = list(service_names)
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app, "_bridge_openapi", None) is None:
            document = dict(original())
            paths, schemas = openapi_parts(names, pool, constraints)
            merged_paths = dict(document.get("paths", {}))
            for path, operations in paths.items():
                merged_paths.setdefault(path, {}).update(operations)
            document["paths"] = merged_paths
            components = dict(document.get("components", {}))
            components["schemas"] = {**components.get("schemas", {}), **schemas}
            document["components"] = components
            app._bridge_openapi = document
        return app._bridge_openapi

    app.openapi = openapi
