"""The embedded HTTP server's socket settings."""

from __future__ import annotations

import socket

from kvshuttle.services.common.http_server import HttpServer


async def test_connections_are_not_delayed_by_nagle():
    """Without TCP_NODELAY every kept-alive request waited ~40 ms for the client's delayed ACK (measured:
    48 ms per /health call instead of 0.2 ms). Accepted connections inherit the listening socket's setting."""
    server = HttpServer(lambda scope, receive, send: None, "127.0.0.1:0")
    try:
        assert server._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        server._sock.close()
