"""The registry's and the scheduler's gRPC servers authorize every call by the caller's certificate (mutual TLS): a
server interceptor that reads the peer certificate's Common Name, maps it to a service identity and applies
control_plane/service_access.py's per-method rules. A refused call ends with PERMISSION_DENIED and a message saying
which identities may call the method (counted by the metrics interceptor under its status code)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import grpc
from kvshuttle.control_plane.service_access import WORKER_FIELDS, Caller, caller_of, governed, refusal
from kvshuttle.services.common.handler_wrapping import WrappingInterceptor

log = logging.getLogger(__name__)


def peer_caller(context: grpc.aio.ServicerContext) -> Caller | None:
    """The caller's service identity, from its verified client certificate; None without one."""
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name") or []
    return caller_of(names[0].decode("utf-8", "replace")) if names else None


def _worker_named(method: str, request: Any) -> str | None:
    path = WORKER_FIELDS.get(method)
    if path is None:
        return None
    value = request
    for field in path:
        value = getattr(value, field, "")
    return value if isinstance(value, str) else ""


class CallerCheck(WrappingInterceptor):
    """Refuses governed calls (service_access.governed) whose caller the rules do not allow. The checking handler is
    built once per method (the metrics interceptor, outside this one, then reuses its own per method too)."""

    def wraps(self, method: str) -> bool:
        return governed(method)

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return _checked(handler, method)


def _checked(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` behind the check of its caller."""

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        caller = peer_caller(context)
        why = refusal(method, caller, _worker_named(method, request))
        if why:
            log.warning("refused %s to %s: %s", method, caller or "a caller without identity", why)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            await check(request, context)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            await check(request, context)
            result = inner_us(request, context)
            if hasattr(result, "__aiter__"):  # an async generator servicer
                async with contextlib.aclosing(result):
                    async for item in result:
                        yield item
            else:  # a coroutine that writes with context.write
                await result

        return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    # No governed method streams its requests (tests/unit/test_service_access.py checks the protos): one that
    # did would be refused to everyone rather than passed through unchecked.
    async def refused(request_iterator, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: client-streaming calls are not "
                                                               "authorized by this server")

    return grpc.stream_unary_rpc_method_handler(refused, handler.request_deserializer,
                                                handler.response_serializer)
