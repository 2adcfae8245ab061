"""The embedded HTTP server's socket settings and how long it keeps an idle connection."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from kvshuttle.services.common.config import ConfigError, load
from kvshuttle.services.common.http_server import HttpServer
from kvshuttle.services.gateway.server import GatewayConfig


async def test_connections_are_not_delayed_by_nagle():
    """Without TCP_NODELAY every kept-alive request waited ~40 ms for the client's delayed ACK (measured:
    48 ms per /health call instead of 0.2 ms). Accepted connections inherit the listening socket's setting."""
    server = HttpServer(lambda scope, receive, send: None, "127.0.0.1:0")
    try:
        assert server._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        server._sock.close()


async def _idle_connection_closed_after(server: HttpServer, idle_s: float) -> bool:
    """One request on a kept-alive connection, then ``idle_s`` of silence: whether the server closed it meanwhile."""
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 204")
        await asyncio.sleep(idle_s)
        try:
            return await asyncio.wait_for(reader.read(1), 0.5) == b""  # EOF: the server closed it
        except TimeoutError:
            return False
    finally:
        writer.close()


async def test_an_idle_kept_alive_connection_lives_as_long_as_the_server_keeps_it():
    """A client reuses an idle connection until its own expiry (httpx: 5 s); a server that closes sooner races it:
    a request sent as the server closes is lost (seen in bench-gateway at 512 streams: ReadError before any
    response). The gateway keeps idle connections longer than clients do."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    for keep_alive_s, closed in ((0.3, True), (5.0, False)):
        server = HttpServer(app, "127.0.0.1:0", keep_alive_s=keep_alive_s)
        await server.start()
        try:
            assert await _idle_connection_closed_after(server, 1.0) is closed, keep_alive_s
        finally:
            await server.stop()
    assert GatewayConfig().http_keep_alive_s > httpx.Limits().keepalive_expiry


def test_the_gateway_s_keep_alive_must_be_positive():
    with pytest.raises((ConfigError, SystemExit)):
        load(GatewayConfig, ["--model-dir", "x", "--http-keep-alive-s", "0"], prog="test")
