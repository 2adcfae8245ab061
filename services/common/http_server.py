"""Serve an ASGI app with uvicorn inside an already running asyncio loop (next to a grpc.aio server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):  # the host process owns SIGINT/SIGTERM
        return contextlib.nullcontext()


def _refuse(transport: asyncio.Transport, status: int, reason: str, message: str) -> None:
    """Answer ``status`` with a JSON error and close the connection (no request is read)."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "code": status}}).encode()
    transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
                    "\r\nconnection: close\r\n\r\n".encode() + body)
    transport.close()


def _guarded_protocol(max_connections: int, receipt_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a connection cap (past it: 503, closed) and a deadline for each request's headers
    (past it: 408, closed): the first request's from the connection's start, a kept-alive connection's next from its
    first byte (uvicorn's own keep-alive timeout ends an idle connection, but not one that trickles a header); 0
    turns either off. The body's deadline is the app's (the gateway's HttpGuard)."""

    class Guarded(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _receipt_timer: asyncio.TimerHandle | None = None
        _timed_after: object = None  # the request cycle whose successor's headers the timer waits for (None: the first)

        def connection_made(self, transport) -> None:
            over = bool(max_connections) and len(self.connections) >= max_connections
            super().connection_made(transport)
            if over:
                _refuse(transport, 503, "Service Unavailable", f"over {max_connections} open connections")
            elif receipt_timeout_s:
                self._arm()

        def _arm(self) -> None:
            if self._receipt_timer is not None:
                self._receipt_timer.cancel()
            self._timed_after = self.cycle
            self._receipt_timer = asyncio.get_running_loop().call_later(receipt_timeout_s, self._too_slow)

        def data_received(self, data: bytes) -> None:
            # a kept-alive connection's next request begins: time its headers as the first request's were
            if (receipt_timeout_s and self.cycle is not None and self.cycle.response_complete
                    and self._timed_after is not self.cycle):
                self._arm()
            super().data_received(data)

        def _too_slow(self) -> None:
            self._receipt_timer = None
            # no request's headers arrived whole since the timer was set
            if self.cycle is self._timed_after and not self.transport.is_closing():
                _refuse(self.transport, 408, "Request Timeout",
                        f"the request headers did not arrive within {receipt_timeout_s:g} s")

        def connection_lost(self, exc) -> None:
            if self._receipt_timer is not None:
                self._receipt_timer.cancel()
            super().connection_lost(exc)

    return Guarded


class HttpServer:
    """Binds ``address`` (port 0 picks a free port) on construction so ``address`` is known before start().

    ``tls``: (certificate file, key file) to serve HTTPS instead of HTTP. ``max_connections``: open connections
    past it are answered 503 and closed; ``receipt_timeout_s``: a request whose headers have not arrived by then (from
    the connection's start, or a kept-alive connection's next request's first byte) is answered 408 and the connection
    closed (0: neither); ``keep_alive_s``: how long a kept-alive connection may stay idle between requests before
    the server closes it.
    """

    def __init__(self, app, address: str, tls: tuple[str, str] | None = None, *, max_connections: int = 0,
                 receipt_timeout_s: float = 0.0, keep_alive_s: float = 5.0):
        host, port = address.rsplit(":", 1)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this. Without it every response after the first on a kept-alive connection
        # waited ~40 ms: uvicorn writes headers and body separately, Nagle holds the body until the client's
        # delayed ACK.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, int(port)))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        guarded = ({"http": _guarded_protocol(max_connections, receipt_timeout_s)}
                   if max_connections or receipt_timeout_s else {})
        self._server = _EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                      timeout_graceful_shutdown=5, timeout_keep_alive=keep_alive_s,
                                                      **ssl, **guarded))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                await self._task  # raises the startup error
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close()
