"""Prometheus metrics over HTTP: ``GET /metrics`` on a listener of its own, or as a route of the gateway's app.

Both serve the text exposition format of one :class:`prometheus_client.CollectorRegistry` (see
:func:`kvshuttle.services.common.metrics.registry_for`). The exposition is built in the event loop (a few dozen series, well under a
millisecond, and the collectors read the loop's own objects), or in a thread when ``in_thread`` (the worker agent:
vLLM's metrics are read from files).
"""

from __future__ import annotations

import asyncio
import logging

from kvshuttle.services.common.config import require
from kvshuttle.services.common.http_server import HttpServer
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

log = logging.getLogger(__name__)
PATH = "/metrics"


def check_listen(value: str, flag: str = "--metrics-listen") -> None:
    """``value`` is empty or host:port (port 0: a free port)."""
    if not value:
        return
    host, sep, port = value.rpartition(":")
    require(bool(sep and host and port.isdigit() and int(port) < 65536), f"{flag} must be host:port, got {value!r}")


async def _exposition(registry: CollectorRegistry, in_thread: bool) -> bytes:
    return await asyncio.to_thread(generate_latest, registry) if in_thread else generate_latest(registry)


def metrics_app(registry: CollectorRegistry, *, in_thread: bool = False):
    """An ASGI app answering ``GET /metrics`` (404 elsewhere, 405 for other methods)."""
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        status, body, ctype = 200, b"", CONTENT_TYPE_PLAIN_0_0_4
        if scope["path"] != PATH:
            status, body, ctype = 404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8"
        elif scope["method"] not in ("GET", "HEAD"):
            status, ctype = 405, "text/plain; charset=utf-8"
        else:
            body = await _exposition(registry, in_thread)
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
    return app


def metrics_route(registry: CollectorRegistry) -> Route:
    """``GET /metrics`` as a Starlette route (the gateway's HTTP port; not in the OpenAPI document)."""
    async def endpoint(_: Request) -> Response:
        return Response(await _exposition(registry, False), media_type=CONTENT_TYPE_PLAIN_0_0_4)
    return Route(PATH, endpoint, methods=["GET"], include_in_schema=False)


class MetricsServer:
    """``GET /metrics`` on ``address`` (bound on construction, so port 0's choice is known: logged at start)."""

    def __init__(self, address: str, registry: CollectorRegistry, *, name: str, in_thread: bool = False):
        self.name = name
        self._http = HttpServer(metrics_app(registry, in_thread=in_thread), address)
        self.address = self._http.address
        self.url = f"http://{self.address}{PATH}"

    async def start(self) -> None:
        await self._http.start()
        log.info("%s metrics on %s", self.name, self.url)

    async def stop(self) -> None:
        await self._http.stop()
