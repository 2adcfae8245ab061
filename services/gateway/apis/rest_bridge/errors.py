"""How the REST bridge answers failures: ``{"error": {"code": <http>, "status": "<gRPC code>", "message": "..."}}``
with grpc-gateway's gRPC-to-HTTP status map, for a gRPC error (its ``retry-after`` metadata as ``Retry-After``) and
for a request the bridge refuses itself (BridgeError)."""

from __future__ import annotations

import json
from typing import Any

import grpc
from starlette.responses import Response

# grpc-gateway's runtime.HTTPStatusFromCode.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


class BridgeError(Exception):
    """A request the bridge cannot turn into a gRPC call (answered without calling the server)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
                 http_status: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.http_status = http_status or HTTP_STATUS.get(code, 500)


def error_body(http_status: int, code: grpc.StatusCode, message: str) -> dict[str, Any]:
    return {"error": {"code": http_status, "status": code.name, "message": message}}


def error_response(http_status: int, code: grpc.StatusCode, message: str) -> Response:
    return Response(dumps(error_body(http_status, code, message)), status_code=http_status,
                    media_type="application/json")


def rpc_error_response(error: grpc.aio.AioRpcError) -> Response:
    """The call's error as JSON; a ``retry-after`` in its trailing metadata becomes HTTP ``Retry-After``."""
    code = error.code()
    response = error_response(HTTP_STATUS.get(code, 500), code, error.details() or code.name)
    retry = next((v for k, v in error.trailing_metadata() or () if k == "retry-after"), None)
    if isinstance(retry, str) and retry.isdigit():
        response.headers["Retry-After"] = retry
    return response


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
