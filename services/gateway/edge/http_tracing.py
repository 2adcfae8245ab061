"""The gateway's HTTP server spans (ASGI middleware): one SERVER span per request, continuing the caller's W3C trace
context (``traceparent`` / ``tracestate`` headers), with OpenTelemetry's HTTP server attributes.

Secrets stay out: no header but ``User-Agent`` is recorded (API keys travel in ``Authorization``), no query string,
and ``url.path`` only when the matched route has no parameters (the REST bridge's paths carry session ids);
``http.route`` is the route's template (``/v1/sessions/{session_id}``).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import propagate, trace
from starlette.datastructures import Headers

# HTTP methods as OpenTelemetry knows them; any other is recorded as "_OTHER" (http.request.method_original keeps it).
KNOWN_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"})
# Probes and scrapes: a span every few seconds per prober that says nothing about turns.
UNTRACED_PATHS = frozenset({"/health", "/metrics"})


class HttpTracing:
    """Wraps an ASGI app; spans end when the response (a stream included) is finished. Probes and scrapes
    (``UNTRACED_PATHS``) get no span."""

    def __init__(self, app: Any, tracer: trace.Tracer | None = None):
        self.app = app
        self.tracer = tracer or trace.get_tracer("kvshuttle.gateway.http")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        own = keep_server_send(scope, send)
        headers = Headers(scope=scope)
        method = scope["method"] if scope["method"] in KNOWN_METHODS else "_OTHER"
        span = self.tracer.start_span(method, context=propagate.extract(headers), kind=trace.SpanKind.SERVER,
                                      attributes=request_attributes(scope, headers, method))
        send_and_note, status = noting_status(send)
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                await self.app(scope, receive, send_and_note)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_attribute("error.type", type(exc).__qualname__)
            span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}")
            raise
        finally:
            if own:
                del scope[SERVER_SEND]
            _finish(span, scope, method, status[0] if status else None)
            span.end()


# The scope key of the server's own ``send``, set by the outermost layer: a stream's body chunks go there directly
# (sse.py), past the layers in between, which all watch only the response's start (its status), never its body.
SERVER_SEND = "kvshuttle.server_send"


def keep_server_send(scope, send) -> bool:
    """Set ``SERVER_SEND`` unless an outer layer has: whether this layer did, and then must delete it once the
    request is done (uvicorn's send is its cycle's method, and the cycle holds the scope: left there, the pair is a
    reference cycle that only the collector's full pass frees, with all the request holds)."""
    if SERVER_SEND in scope:
        return False
    scope[SERVER_SEND] = send
    return True


def noting_status(send):
    """``send`` wrapped to note the response's status code: (the wrapped send, a list that receives the status)."""
    status: list[int] = []

    async def send_and_note(message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        await send(message)

    return send_and_note, status


def request_attributes(scope, headers: Headers, method: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {"http.request.method": method, "url.scheme": scope.get("scheme", "http"),
                             "network.protocol.version": scope.get("http_version", "1.1")}
    if method == "_OTHER":
        attrs["http.request.method_original"] = scope["method"]
    server, client = scope.get("server"), scope.get("client")
    if server:
        attrs["server.address"] = server[0]
        if server[1] is not None:
            attrs["server.port"] = server[1]
    if client:
        attrs["client.address"] = client[0]
    if "user-agent" in headers:
        attrs["user_agent.original"] = headers["user-agent"]
    return attrs


def _finish(span, scope, method: str, status: int | None) -> None:
    """The route (known once the app has routed the request), the span's name and the response status."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if template:
        span.set_attribute("http.route", template)
        span.update_name(f"{method} {template}")
        if not getattr(route, "param_convertors", None):
            span.set_attribute("url.path", scope["path"])
    if status is None:
        return
    span.set_attribute("http.response.status_code", status)
    if status >= 500:  # 4xx are the client's errors, not the server's (OpenTelemetry's HTTP server conventions)
        span.set_attribute("error.type", str(status))
        span.set_status(trace.StatusCode.ERROR, f"HTTP {status}")
