"""The gateway's HTTP front door (ASGI middleware): API key check, the tenant's requests per second, admin-only paths,
then the request body (its limit and its receipt timeout), before any route.

* Every path but the open ones (``/health``) needs ``Authorization: Bearer <key>`` when keys are configured:
  otherwise 401 with an OpenAI-style JSON error and ``WWW-Authenticate: Bearer``. The caller (``Principal``) is put in
  the ASGI scope for the routes (``caller(request)``; a route that finds none answers 401, never full rights).
* A tenant over its requests per second (the keys file's limits) gets 429 with ``Retry-After``, in OpenAI's error
  shape (Anthropic's on ``/v1/messages``).
* ``admin_paths`` (``/metrics`` on the HTTP port when keys are configured) need an admin key: else 403.
* A body over ``max_body_bytes`` is a 413 JSON error: at once when ``Content-Length`` says so (the body is never
  read), otherwise (chunked) as soon as the bytes read pass the limit. The body is read here in full before the
  route runs; one that has not arrived whole ``receipt_timeout_s`` after the headers is a 408 and the connection is
  closed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import Any

from fastapi import HTTPException
from kvshuttle.services.gateway.edge.auth import OPEN, AuthError, KeyRing, Principal
from kvshuttle.services.gateway.edge.tenant_limits import TenantQuotas
from starlette.datastructures import Headers
from starlette.requests import Request

SCOPE_KEY = "kvshuttle.principal"


def principal(request: Request) -> Principal | None:
    """The caller the guard let in (None: the app runs without the guard)."""
    return request.scope.get(SCOPE_KEY)


def caller(request: Request) -> Principal:
    """The caller the guard let in; a request without one (no guard in front of the app) is a 401, never full
    rights."""
    found = principal(request)
    if found is None:
        raise HTTPException(401, "no caller identity: the request did not pass the API key check")
    return found


def _error(status: int, message: str, code: str, path: str = "", kind: str | None = None) -> bytes:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):  # Anthropic's shape
        types = {401: "authentication_error", 403: "permission_error", 408: "timeout_error", 429: "rate_limit_error"}
        return json.dumps({"type": "error", "error": {"type": types.get(status, "invalid_request_error"),
                                                      "message": message}}).encode()
    kind = kind or {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


class HttpGuard:
    def __init__(self, app: Any, keys: KeyRing, max_body_bytes: int, open_paths: Iterable[str] = ("/health",),
                 *, quotas: TenantQuotas | None = None, admin_paths: Iterable[str] = (),
                 receipt_timeout_s: float = 0.0):
        """``receipt_timeout_s``: 0, no limit on how long a body may take to arrive."""
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.open_paths = frozenset(open_paths)
        self.quotas = quotas
        self.admin_paths = frozenset(admin_paths)
        self.receipt_timeout_s = receipt_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path = scope["path"]
        if path in self.open_paths:
            scope[SCOPE_KEY] = OPEN if not self.keys.enabled else None
        else:
            try:
                auth = headers.get("authorization")
                key = (headers.get("x-api-key") or "").strip() if auth is None else ""  # Anthropic clients' header
                scope[SCOPE_KEY] = who = self.keys.principal(key) if key else self.keys.from_header(auth)
            except AuthError as exc:
                await _reply(send, 401, _error(401, str(exc), "invalid_api_key", path),
                             [(b"www-authenticate", b'Bearer realm="kvshuttle"')])
                return
            refused = self.quotas.check_request(who.tenant) if self.quotas is not None else None
            if refused is not None:
                await _reply(send, 429, _error(429, refused.message, "rate_limit_exceeded", path, refused.openai_type),
                             [(b"retry-after", str(refused.retry_after_s).encode())])
                return
            if path in self.admin_paths and not who.admin:
                await _reply(send, 403, _error(403, f"{path} needs an admin API key", "permission_denied", path))
                return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await _reply(send, 400, _error(400, "Content-Length is not a number", "invalid_content_length",
                                               path))
                return
            if int(length) > self.max_body_bytes:
                await _reply(send, 413, self._too_large(path))
                return
            if int(length) == 0:
                await self.app(scope, receive, send)
                return
        elif "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)
            return
        # Read (and hold) the body up to the limit, within the receipt timeout, before the app sees any of it.
        chunks, size = [], 0
        deadline = time.monotonic() + self.receipt_timeout_s if self.receipt_timeout_s else None
        while True:
            try:
                message = await (receive() if deadline is None
                                 else asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                await _reply(send, 408, _error(408, f"the request body did not arrive within "
                                                    f"{self.receipt_timeout_s:g} s", "request_timeout", path),
                             [(b"connection", b"close")])
                return
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _reply(send, 413, self._too_large(path))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _too_large(self, path: str) -> bytes:
        return _error(413, f"request body over {self.max_body_bytes} bytes (max request body)", "body_too_large",
                      path)


async def _reply(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
