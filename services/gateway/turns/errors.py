"""How a turn fails: TurnError (the turn cannot run; an HTTP status and a gRPC code for the front ends), FieldError
(a request field that cannot be used as given: a 400 naming it) and WorkerDown (a worker failed a call; the runner
moves the turn to another worker)."""

from __future__ import annotations

import grpc
from kvshuttle.services.engine.client import EngineError


class TurnError(Exception):
    """A turn that cannot run; carries both an HTTP status and a gRPC code for the two front ends, and the OpenAI
    error code where OpenAI names one (``api_code``, e.g. ``model_not_found``; else the status)."""

    def __init__(self, http_status: int, code: grpc.StatusCode, message: str, retry_after_s: int | None = None,
                 api_code: str | None = None):
        super().__init__(message)
        self.http_status, self.code, self.message, self.retry_after_s = http_status, code, message, retry_after_s
        self.api_code = api_code


class FieldError(ValueError):
    """A request field that cannot be used as given (tools, tool history, structured output): a 400 naming
    ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class WorkerDown(Exception):
    """A worker failed a call (unreachable, crashed, timed out, engine dead): the turn goes on elsewhere."""

    def __init__(self, worker_id: str, error: EngineError):
        super().__init__(f"{worker_id}: {error}")
        self.worker_id, self.error = worker_id, error


class SnapshotStale(Exception):
    """The scheduler found the turn's session snapshot out of date (another gateway changed the record): the runner
    reads the record again, builds the prompt again and plans once more."""


class DecodeFailed(Exception):
    """D failed mid-answer (unreachable, crashed, stalled): the runner resumes the answer on another D, the decode
    stage's state (what was already streamed) kept."""

    def __init__(self, worker_id: str, error: EngineError):
        super().__init__(f"{worker_id}: {error}")
        self.worker_id, self.error = worker_id, error
