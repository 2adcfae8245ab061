"""The gateway's HTTP app: FastAPI with the state its route handlers share (apis/state.py), the handlers that answer
every error in OpenAI's shape (the OpenAI and Responses routes; Anthropic's routes answer their own), and an OpenAPI
document without FastAPI's 422s. ``create_app`` serves the OpenAI routes; ``add_anthropic_routes`` and
``add_responses_routes`` (in their API's folder) add the others."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kvshuttle.services.gateway.apis.openai.routes import router as openai_router
from kvshuttle.services.gateway.apis.request_model import UNSUPPORTED
from kvshuttle.services.gateway.apis.state import ApiState
from kvshuttle.services.gateway.edge.api_errors import error_body
from kvshuttle.services.gateway.edge.http_entry import GatewayRoute
from kvshuttle.services.gateway.turns import TurnError, TurnRunner
from kvshuttle.services.gateway.turns.builder import TurnBuilder
from kvshuttle.services.gateway.turns.catalog import AdapterSource, ModelCatalog, ServedModel
from kvshuttle.services.gateway.turns.errors import FieldError
from starlette.exceptions import HTTPException as StarletteHTTPException


def create_app(runner: TurnRunner, served_model: str, default_max_tokens: int,
               extra_routes: list | None = None, *, tool_call_parser: str = "", reasoning_parser: str = "",
               more_models: Sequence[ServedModel] = (), adapters: AdapterSource | None = None) -> FastAPI:
    """The app for ``served_model`` on ``runner`` (the default of a request that names no model), and
    ``more_models``, and the adapters of these that ``adapters`` lists. ``tool_call_parser`` / ``reasoning_parser``: the parsers' names (tool_calls.TOOL_CALL_PARSERS,
    reasoning.REASONING_PARSERS); "" leaves tool calls (a request with tools is then refused) or reasoning
    unparsed. ``extra_routes`` (the REST bridge's, /metrics) go before the APIs' routes."""
    app = FastAPI(title="kvshuttle gateway", version="0.1.0",
                  description="OpenAI-compatible API over P/D-disaggregated vLLM with KV reuse across turns.",
                  exception_handlers=EXCEPTION_HANDLERS)
    first = ServedModel(served_model, runner, TurnBuilder(served_model, default_max_tokens,
                                                          tool_call_parser=tool_call_parser,
                                                          reasoning_parser=reasoning_parser))
    app.state.api = ApiState(ModelCatalog([first, *more_models], adapters))
    app.router.route_class = GatewayRoute  # input_check on every body, and a JSON 500 for what nothing else answers
    for route in extra_routes or []:
        app.router.routes.append(route)
    app.openapi = _without_422(app.openapi)
    app.include_router(openai_router)
    return app


def _without_422(openapi: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """FastAPI documents a 422 on every route with a body; the gateway answers those errors with a 400."""
    def document() -> dict[str, Any]:
        doc = openapi()
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        return doc
    return document


async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body its model refuses: a 400 naming the first refused field as OpenAI's ``param``."""
    parts, param = [], None
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == UNSUPPORTED:  # name the first refused field in full, as OpenAI's `param`
            first = err.get("ctx", {}).get("first", "")
            param = param or (f"{where}.{first}" if where else first)
        elif err.get("type") == "extra_forbidden":
            param = param or where
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    if param is None and parts:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return JSONResponse(error_body(400, "; ".join(parts) or "invalid request", param=param), status_code=400)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # Starlette's Allow names only the first route on the path (GET, not DELETE)
        path = request.scope["path"]
        headers["Allow"] = ", ".join(sorted({m for r in request.app.router.routes if getattr(r, "methods", None)
                                             and r.path_regex.match(path) for m in r.methods}))
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=headers)


async def field_error(_: Request, exc: FieldError) -> JSONResponse:
    return JSONResponse(error_body(400, str(exc), param=exc.param), status_code=400)


async def turn_error(_: Request, exc: TurnError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    limit = getattr(exc, "openai_type", None)  # tenant_limits.RateLimited: OpenAI's rate-limit shape
    code = "rate_limit_exceeded" if limit else exc.api_code
    return JSONResponse(error_body(exc.http_status, exc.message, limit, code),
                        status_code=exc.http_status, headers=headers)


EXCEPTION_HANDLERS = {RequestValidationError: invalid_body, StarletteHTTPException: http_error,
                      FieldError: field_error, TurnError: turn_error}
