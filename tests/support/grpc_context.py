"""A stand-in for grpc.aio.ServicerContext, as far as the gateway's gRPC servicer uses it: ``abort`` raises
``Aborted(code, details)``, so a test reads the status the servicer answered."""

from __future__ import annotations


class Aborted(Exception):
    pass


class Context:
    def invocation_metadata(self):
        return ()

    async def send_initial_metadata(self, metadata):
        pass

    def set_trailing_metadata(self, metadata):
        pass

    async def abort(self, code, details="", trailing_metadata=()):
        raise Aborted(code, details)
