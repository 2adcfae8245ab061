"""Every HTTP request the gateway answers, counted by method, route template and status code (ASGI middleware,
outermost: API-key refusals, oversized bodies and malformed requests count too, which the turn metrics cannot see).

It also stamps the request's arrival in the scope (``ARRIVED``): a turn's ``request_ms`` timing is from there to
the turn's start (the body read, the input check, validation, the key and the tenant's limits).

Labels stay bounded: the route is the matched route's template (``/v1/sessions/{session_id}``, never the path), or
``unmatched``; methods outside HTTP's own set are ``_OTHER``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvshuttle.services.common import metrics
from kvshuttle.services.gateway.edge.http_tracing import KNOWN_METHODS, SERVER_SEND, keep_server_send, noting_status
from starlette.routing import Match

UNMATCHED = "unmatched"
ARRIVED = "kvshuttle.arrived"  # the scope key: when the request reached the gateway's ASGI front (perf_counter)


def route_template(scope: dict, routes: Sequence[Any]) -> str:
    """The template of the route that served (or would have served) the request."""
    route = scope.get("route")
    if route is None:  # refused before routing (a missing key, a body over the limit): find the route it was for
        route = next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)
    return getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED


class HttpMetrics:
    """Wraps the gateway's ASGI front; ``routes`` are the app's (to name requests refused before routing)."""

    def __init__(self, app: Any, routes: Sequence[Any]):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault(ARRIVED, time.perf_counter())  # a turn's request_ms counts from here
        own = keep_server_send(scope, send)
        send_and_note, status = noting_status(send)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if own:
                del scope[SERVER_SEND]
            method = scope["method"] if scope["method"] in KNOWN_METHODS else "_OTHER"
            # No status sent: the app failed before answering (the server answers 500) or the client went away.
            code = str(status[0]) if status else "500"
            metrics.HTTP_REQUESTS.labels(method, route_template(scope, self.routes), code).inc()
