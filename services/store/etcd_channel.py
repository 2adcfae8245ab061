"""The gRPC channel to etcd: plaintext or TLS (optionally with a client certificate), and etcd's user/password auth.

etcd's auth hands out a token (``Auth.Authenticate``) that every call must carry as ``token`` metadata; it expires
(simple tokens after ``--auth-token-ttl`` idle, 300 s by default; JWTs after their TTL) and is invalidated when etcd's
auth store changes. ``TokenAuth``'s client interceptors add the token to every call on the channel (unary and
streaming), and when a unary call is refused for an expired or outdated token it authenticates again and retries
that call once. Streams (watches, lease keep-alives) fail instead, and their owners start them again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence

import grpc
import grpc.aio
from etcd3aio._protobuf import AuthenticateRequest, AuthStub
from kvshuttle.services.common.tls import EtcdSecurity

log = logging.getLogger(__name__)

_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
# etcd's answers that a new token fixes (ErrInvalidAuthToken, ErrAuthOldRevision).
_REFRESH_ON = ("invalid auth token", "revision of auth store is old")


class EtcdAuthError(Exception):
    """etcd refused the configured user name and password (or auth is not enabled on it)."""


class TokenAuth:
    """Adds etcd's auth token to every call; authenticates lazily and again when the token is refused.

    ``interceptors()`` are the channel's (grpc.aio files an interceptor under one call kind only, so one per kind).
    """

    def __init__(self, username: str, password: str, timeout_s: float = 5.0):
        self.username = username
        self._password = password
        self._timeout_s = timeout_s
        self._token: str | None = None
        self._lock = asyncio.Lock()
        self._stub: AuthStub | None = None

    def bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = AuthStub(channel)

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [_UnaryUnary(self), _UnaryStream(self), _StreamStream(self)]

    def __repr__(self) -> str:  # never the password or the token
        return f"TokenAuth(user={self.username!r})"

    async def authenticate(self, stale: str | None = None) -> str:
        """A valid token: the current one unless it is ``stale`` (refused by etcd), else a new one.

        Raises EtcdAuthError when etcd refuses the credentials, grpc.aio.AioRpcError when it cannot be reached.
        """
        async with self._lock:
            if self._token is not None and self._token != stale:
                return self._token
            assert self._stub is not None, "TokenAuth.bind(channel) first"
            try:
                resp = await self._stub.Authenticate(
                    AuthenticateRequest(name=self.username, password=self._password), timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                    raise EtcdAuthError(f"etcd refused user {self.username!r}: {exc.details() or exc.code().name} "
                                        "(check --etcd-username and the password)") from None
                raise
            self._token = resp.token
            log.info("authenticated to etcd as %r", self.username)
            return self._token

    async def with_token(self, details: grpc.aio.ClientCallDetails) -> tuple[grpc.aio.ClientCallDetails, str]:
        try:
            token = await self.authenticate()
        except EtcdAuthError as exc:  # as a gRPC error, so callers map it like any refusal
            raise _AuthRefused(str(exc)) from None
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata["token"] = token
        return details._replace(metadata=metadata), token


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, auth: TokenAuth):
        self.auth = auth

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        if client_call_details.method in (_AUTHENTICATE, _AUTHENTICATE.encode()):
            return await continuation(client_call_details, request)
        details, token = await self.auth.with_token(client_call_details)
        call = await continuation(details, request)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if not any(s in (exc.details() or "") for s in _REFRESH_ON):
                raise
        await self.auth.authenticate(stale=token)  # the token expired: a new one, and this call once more
        details, _ = await self.auth.with_token(client_call_details)
        return await (await continuation(details, request))


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, auth: TokenAuth):
        self.auth = auth

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        details, _ = await self.auth.with_token(client_call_details)
        return await continuation(details, request)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, auth: TokenAuth):
        self.auth = auth

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        details, _ = await self.auth.with_token(client_call_details)
        return await continuation(details, request_iterator)


class _AuthRefused(grpc.aio.AioRpcError):
    """etcd refused the credentials, as the gRPC error a call would have failed with."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


def grpc_target(endpoints: Sequence[str]) -> str:
    """The gRPC target for etcd ``endpoints`` (``host:port``): ``ipv4:h1:p1,h2:p2`` (round robin) when every host is
    an IPv4 address (``localhost`` counts as 127.0.0.1), else ``dns:///host:port`` for one name (a Kubernetes
    Service; gRPC resolves it again when connections fail). Several names: resolve them first
    (:func:`resolved_endpoints`)."""
    literal = [e.replace("localhost", "127.0.0.1", 1) if e.startswith("localhost:") else e for e in endpoints]
    if all(_is_ipv4(e.rsplit(":", 1)[0]) for e in literal):
        return "ipv4:" + ",".join(literal)
    if len(endpoints) == 1:
        return f"dns:///{endpoints[0]}"
    raise ValueError(f"several etcd endpoints that are not all IPv4 addresses: {', '.join(endpoints)} (resolve them "
                     "first)")


async def resolved_endpoints(endpoints: Sequence[str]) -> list[str]:
    """``endpoints`` with host names resolved to IPv4 addresses (for a list of several members given by name)."""
    if len(endpoints) == 1 or all(_is_ipv4(e.rsplit(":", 1)[0]) for e in endpoints):
        return list(endpoints)
    loop, out = asyncio.get_running_loop(), []
    for endpoint in endpoints:
        host, port = endpoint.rsplit(":", 1)
        infos = await loop.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
        out.extend(f"{info[4][0]}:{port}" for info in infos[:1])
    return out


def _is_ipv4(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def etcd_channel(target: str, options: Sequence[tuple[str, object]], security: EtcdSecurity | None,
                 first_host: str) -> tuple[grpc.aio.Channel, TokenAuth | None]:
    """A channel to ``target`` (etcd3aio's ``ipv4:h1:p1,h2:p2``) with ``options``; TLS when ``security.ca`` is set
    (verifying ``security.server_name`` or ``first_host``), and a bound ``TokenAuth`` when it names a user."""
    auth = None
    interceptors = []
    if security is not None and security.username:
        auth = TokenAuth(security.username, security.password)
        interceptors = auth.interceptors()
    if security is None or security.ca is None:
        channel = grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors or None)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=security.ca, private_key=security.key,
                                                   certificate_chain=security.cert)
        name = security.server_name or first_host
        channel = grpc.aio.secure_channel(target, credentials,
                                          options=[*options, ("grpc.ssl_target_name_override", name)],
                                          interceptors=interceptors or None)
    if auth is not None:
        auth.bind(channel)
    return channel, auth
