"""The error shapes of the gateway's HTTP APIs, in one place: OpenAI's (the chat, completions and Responses
routes) and Anthropic's (the Messages routes), with their OpenAPI schemas and the session header the turn routes
document."""

from __future__ import annotations

from typing import Any

from kvshuttle.control_plane.session import ID_PATTERN as SESSION_ID_PATTERN

# -- OpenAI's -------------------------------------------------------------------------------------------------------


def error_body(status: int, message: str, kind: str | None = None, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; ``param``: the request field at fault."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    error = {"message": message, "type": kind, "code": code or status}
    if param is not None:
        error["param"] = param
    return {"error": error}


_ERROR_STATUSES = [(400, "Invalid request"), (401, "Missing or unknown API key"), (404, "Unknown model"),
                   (413, "Request body too large"), (429, "Over a rate limit of the caller's tenant (Retry-After: seconds)"), (503, "No worker could serve it"),
                   (504, "A deadline passed")]
_OPENAI_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "param": {"type": "string"}}}}}
# What a turn can answer, for the OpenAI routes' OpenAPI document (validation errors are 400s, not FastAPI's 422).
TURN_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer; with `stream: true`, server-sent events (JSON chunks, then `[DONE]`)",
          "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                       "properties": {"data": {"type": "string"}}}}}},
    **{status: {"description": text, "content": {"application/json": {"schema": _OPENAI_ERROR_SCHEMA}}}
       for status, text in _ERROR_STATUSES},
}
SESSION_HEADER = {"parameters": [{
    "name": "X-Session-ID", "in": "header", "required": False,
    "description": "Conversation id (else the body's conversation_id): turns with the same id reuse each other's KV",
    "schema": {"type": "string", "maxLength": 256, "pattern": SESSION_ID_PATTERN}}]}

# -- Anthropic's ----------------------------------------------------------------------------------------------------

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


_ANTHROPIC_ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": text, "content": {"application/json": {"schema": _ANTHROPIC_ERROR_SCHEMA}}}
    for status, text in _ERROR_STATUSES}
