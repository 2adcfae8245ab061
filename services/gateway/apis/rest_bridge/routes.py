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

The bindings are specs.py's, the JSON mapping transcode.py's, the error answers errors.py's, the OpenAPI document
openapi.py's. Usage::

    app.router.routes.extend(bridge_routes({"kvshuttle.v1.SessionRegistry": registry_channel}))
    install_openapi(app, ["kvshuttle.v1.SessionRegistry"])  # openapi.py
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import Message
from kvshuttle.services.gateway.apis.rest_bridge.errors import (
    HTTP_STATUS,
    BridgeError,
    dumps,
    error_body,
    error_response,
    rpc_error_response,
)
from kvshuttle.services.gateway.apis.rest_bridge.specs import NDJSON, RouteSpec, find_service, service_specs
from kvshuttle.services.gateway.apis.rest_bridge.transcode import reply_json, request_message
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


DEFAULT_FORWARD_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")



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

    async def handle(self, request: Request) -> Response:
        try:
            message = await request_message(self.spec, request, self.options.max_body_bytes)
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
            return Response(self._json(reply), media_type="application/json")
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
                    yield self._json(item) + b"\n"
                    item = await call.read()
            except grpc.aio.AioRpcError as e:
                yield dumps(error_body(HTTP_STATUS.get(e.code(), 500), e.code(), e.details() or "")) + b"\n"
            except Exception:
                log.exception("REST bridge failure while streaming %s", self.spec.full_method)
                yield dumps(error_body(500, grpc.StatusCode.INTERNAL, "internal error in the REST bridge")) + b"\n"
            finally:
                call.cancel()  # no-op when finished; stops the server when the HTTP client went away

        return StreamingResponse(lines(), media_type=NDJSON)

    def _json(self, reply: Message) -> bytes:
        return dumps(reply_json(self.spec, reply, self.options.emit_defaults))


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
