"""Serve an ASGI app with uvicorn inside an already running asyncio loop (next to a grpc.aio server)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):  # the host process owns SIGINT/SIGTERM
        return contextlib.nullcontext()


class HttpServer:
    """Binds ``address`` (port 0 picks a free port) on construction so ``address`` is known before start().

    ``tls``: (certificate file, key file) to serve HTTPS instead of HTTP.
    """

    def __init__(self, app, address: str, tls: tuple[str, str] | None = None):
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
        self._server = _EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                      timeout_graceful_shutdown=5, **ssl))
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
