"""Server-sent events for every HTTP API (OpenAI chat and completions, Anthropic Messages, Responses), once: the
framing, the stream's headers, and its error tail.

A stream's headers are sent before the turn's answer, so a failure after them cannot be a status code: the API's
own error event ends the stream instead (``error_tail(status, message)``: OpenAI's error object and ``[DONE]``,
Anthropic's ``error`` event, Responses' ``error`` event), for a TurnError (its status and message) and for any
other exception (500, "internal error"; the traceback goes to the log). No stream ends in a dropped connection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from fastapi.responses import StreamingResponse
from kvshuttle.services.gateway.turns import TurnContext, TurnError
from kvshuttle.services.gateway.turns.reply import kv_headers

log = logging.getLogger(__name__)

ErrorTail = Callable[[int, str], Iterable[bytes]]


def frame(data: Mapping[str, Any] | str, event: str = "") -> bytes:
    """One event: ``data`` as compact JSON (a string as it is, e.g. ``[DONE]``), named ``event`` when given."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {text}\n\n".encode() if event else f"data: {text}\n\n".encode()


def stream_headers(turn: TurnContext, **extra: str) -> dict[str, str]:
    """A turn's stream headers: its KV report (as a whole answer's), the session, no caching."""
    return {**kv_headers(turn.kv), "X-Session-ID": turn.request.session_id, "Cache-Control": "no-cache", **extra}


def stream_response(frames: AsyncIterator[bytes], turn: TurnContext, error_tail: ErrorTail,
                    **headers: str) -> StreamingResponse:
    """The turn's event stream: ``frames``, ended by ``error_tail`` when they fail."""
    return StreamingResponse(_guarded(frames, error_tail, turn.id), media_type="text/event-stream",
                             headers=stream_headers(turn, **headers))


async def _guarded(frames: AsyncIterator[bytes], error_tail: ErrorTail, turn_id: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in frames:
            yield chunk
    except TurnError as exc:
        log.warning("stream of turn %s failed: %s", turn_id, exc.message)
        for chunk in error_tail(exc.http_status, exc.message):
            yield chunk
    except Exception:
        log.exception("stream of turn %s failed", turn_id)
        for chunk in error_tail(500, "internal error"):
            yield chunk
