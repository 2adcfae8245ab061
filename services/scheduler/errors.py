"""Why the scheduler refuses a request: typed errors, each with the gRPC status it is answered with.

:class:`~kvshuttle.services.scheduler.planning.PlanningService` raises them; its adapters turn them into what their
callers see: the gRPC servicer into ``context.abort(error.code, error.message)``, the in-process stub into the
``grpc.aio.AioRpcError`` a client of the servicer would get (same code, same details).
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class PlanningError(Exception):
    """A refused request: ``code`` (the gRPC status) and ``message`` (its details)."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(PlanningError):
    """The request itself is wrong (prompt, session reference, history_match_tokens, policy, outcome): retrying it
    unchanged cannot help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unavailable(PlanningError):
    """The scheduler cannot plan now; a retry (or another replica) may."""

    code = grpc.StatusCode.UNAVAILABLE


class WorkersNotReady(Unavailable):
    """No worker list from the registry yet (the scheduler just started, or the registry is away)."""

    def __init__(self, message: str = "no worker list from the registry yet"):
        super().__init__(message)


class NoLiveWorker(Unavailable):
    """No live worker of ``role`` ("prefill" or "decode") outside the request's exclusions (serving ``model``, when
    the request names one)."""

    def __init__(self, role: str, model: str = ""):
        super().__init__(f"no live {role} worker" + (f" serving model {model!r}" if model else ""))
        self.role = role
