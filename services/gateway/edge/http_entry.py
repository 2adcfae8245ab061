"""The one entry of the gateway's HTTP front ends (OpenAI chat and completions, Responses, Anthropic Messages):
GatewayRoute runs input_check on the decoded body before FastAPI validates it, and answers any unexpected exception
with a 500 in the API's error shape (the traceback goes to the log), so no request ends in a dropped connection.
A stream whose headers are already sent ends with its API's error event instead (sse.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from kvshuttle.services.gateway.edge import input_check
from kvshuttle.services.gateway.edge.api_errors import error_body
from kvshuttle.services.gateway.edge.input_check import Api, InputError
from kvshuttle.services.gateway.turns.errors import FieldError, TurnError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

log = logging.getLogger(__name__)

# What each route's body is (input_check.Api: where its schemas are, its integer ranges); others: GENERIC.
ROUTE_APIS: dict[str, Api] = {
    "/v1/chat/completions": input_check.CHAT, "/v1/completions": input_check.COMPLETIONS,
    "/v1/responses": input_check.RESPONSES, "/v1/messages": input_check.MESSAGES,
    "/v1/messages/count_tokens": input_check.MESSAGES}
# Errors the app's (or a subclass's) own handlers answer.
HANDLED = (HTTPException, RequestValidationError, FieldError, TurnError, ClientDisconnect)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def checked_body(request: Request, api: Api) -> None:
    """InputError for a JSON body no request may hold. A body that is not JSON is left to FastAPI, which answers
    it; the decoded body stays cached on the request, so FastAPI does not decode it twice."""
    if request.method not in _BODY_METHODS or not (await request.body()).strip():
        return
    try:
        data = await request.json()
    except (ValueError, RecursionError):
        return
    input_check.check(data, api)


class GatewayRoute(APIRoute):
    """A route of the OpenAI-shaped front ends; AnthropicRoute overrides the error shape."""

    def refusal(self, exc: InputError) -> Response:
        return JSONResponse(error_body(400, str(exc), param=exc.param), status_code=400)

    def internal_error(self) -> Response:
        return JSONResponse(error_body(500, "internal error"), status_code=500)

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        api = ROUTE_APIS.get(self.path, input_check.GENERIC)

        async def route(request: Request) -> Response:
            try:
                try:
                    await checked_body(request, api)
                except InputError as exc:
                    return self.refusal(exc)
                return await handler(request)
            except HANDLED:
                raise
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                return self.internal_error()

        return route
