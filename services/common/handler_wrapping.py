"""A gRPC server interceptor base that wraps each method's handler once and reuses the wrapped handler on every
later call (as long as the server hands out the same handler), so the per-call cost is one dict lookup."""

from __future__ import annotations

import grpc


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Subclasses say which methods they wrap (``wraps``) and how (``wrap``)."""

    def __init__(self) -> None:
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wraps(self, method: str) -> bool:
        return True

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or not self.wraps(method):
            return handler
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, method)
        self._handlers[method] = (handler, wrapped)
        return wrapped
