"""The gateway's HTTP front door (ASGI middleware): API key check, then the request body limit, before any route.

* Every path but the open ones (``/health``) needs ``Authorization: Bearer <key>`` when keys are configured:
  otherwise 401 with an OpenAI-style JSON error and ``WWW-Authenticate: Bearer``. The caller (``Principal``) is put in
  the ASGI scope for the routes (``principal(request)``).
* A body over ``max_body_bytes`` is a 413 JSON error: at once when ``Content-Length`` says so (the body is never
  read), otherwise (chunked) as soon as the bytes read pass the limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kvshuttle.services.gateway.auth import OPEN, AuthError, KeyRing, Principal
from starlette.datastructures import Headers
from starlette.requests import Request

SCOPE_KEY = "kvshuttle.principal"


def principal(request: Request) -> Principal | None:
    """The caller the guard let in (None: the app runs without the guard)."""
    return request.scope.get(SCOPE_KEY)


def _error(status: int, message: str, code: str) -> bytes:
    kind = "invalid_request_error" if status != 401 else "authentication_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


class HttpGuard:
    def __init__(self, app: Any, keys: KeyRing, max_body_bytes: int, open_paths: Iterable[str] = ("/health",)):
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["path"] in self.open_paths:
            scope[SCOPE_KEY] = OPEN if not self.keys.enabled else None
        else:
            try:
                auth = headers.get("authorization")
                key = (headers.get("x-api-key") or "").strip() if auth is None else ""  # Anthropic clients' header
                scope[SCOPE_KEY] = self.keys.principal(key) if key else self.keys.from_header(auth)
            except AuthError as exc:
                await _reply(send, 401, _error(401, str(exc), "invalid_api_key"),
                             [(b"www-authenticate", b'Bearer realm="kvshuttle"')])
                return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await _reply(send, 400, _error(400, "Content-Length is not a number", "invalid_content_length"))
                return
            if int(length) > self.max_body_bytes:
                await _reply(send, 413, self._too_large())
                return
            await self.app(scope, receive, send)
            return
        if "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)
            return
        # Chunked: read (and hold) the body up to the limit before the app sees any of it.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _reply(send, 413, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> bytes:
        return _error(413, f"request body over {self.max_body_bytes} bytes (max request body)", "body_too_large")


async def _reply(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
