"""Server-sent events for every HTTP API (OpenAI chat and completions, Anthropic Messages, Responses), once: the
framing, the stream's headers, and its error tail.

A stream's headers are sent before the turn's answer, so a failure after them cannot be a status code: the API's
own error event ends the stream instead (``error_tail(status, message)``: OpenAI's error object and ``[DONE]``,
Anthropic's ``error`` event, Responses' ``error`` event), for a TurnError (its status and message) and for any
other exception (500, "internal error"; the traceback goes to the log). No stream ends in a dropped connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from kvshuttle.services.gateway.edge.http_tracing import SERVER_SEND
from kvshuttle.services.gateway.turns import TurnContext, TurnError
from kvshuttle.services.gateway.turns.context import ExpressLane
from kvshuttle.services.gateway.turns.reply import kv_headers
from starlette.responses import Response

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
                    **headers: str) -> EventStream:
    """The turn's event stream: ``frames``, ended by ``error_tail`` when they fail."""
    return EventStream(frames, turn.id, error_tail, stream_headers(turn, **headers), turn.express)


class _PumpState:
    __slots__ = ("streaming", "gone")

    def __init__(self) -> None:
        self.streaming, self.gone = True, False


class EventStream(Response):
    """An SSE response written from the stream's own task: the response's start goes through the app's layers (they
    note its status); the frames are written by a task of their own (``_pump``) straight to the server's send
    (``SERVER_SEND``: the layers in between watch only the start). A token then wakes that task alone: the app's
    layers (middleware, router, guard: a dozen coroutines) wait on it once, not once per token. A watcher task per
    stream cancels the pump when the client goes away (``http.disconnect``), and ``frames`` is closed however the
    stream ends, so D's call is cancelled with it."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], turn_id: str, error_tail: ErrorTail, headers: Mapping[str, str],
                 lane: ExpressLane | None = None):
        self.frames, self.turn_id, self.error_tail, self.lane = frames, turn_id, error_tail, lane
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        except BaseException:
            if self.lane is not None:
                self.lane.close()
            await self.frames.aclose()
            raise
        state = _PumpState()
        pump = asyncio.create_task(self._pump(scope.get(SERVER_SEND, send), state))

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            state.gone = True
            if state.streaming:  # only the frames' loop is interrupted: the end and the close run to completion
                pump.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await pump  # cancelling this task (e.g. shutdown) cancels the pump with it
        finally:
            watcher.cancel()

    async def _pump(self, body, state: _PumpState) -> None:
        frames, task = self.frames, asyncio.current_task()
        assert task is not None
        writer = ChunkWriter.of(body)
        lane = self.lane
        if writer is not None and lane is not None:  # D's plain tokens may be written from their read
            lane.ready, lane.write = writer.ready, writer.put
        try:
            tail: Iterable[bytes] = ()
            try:
                if writer is not None:
                    ready, put = writer.ready, writer.put
                    async for chunk in frames:
                        if ready():
                            put(chunk)
                        else:  # the server's transport is paused (or the client gone): its send waits (or drops)
                            await body({"type": "http.response.body", "body": chunk, "more_body": True})
                else:
                    async for chunk in frames:
                        await body({"type": "http.response.body", "body": chunk, "more_body": True})
            except TurnError as exc:
                log.warning("stream of turn %s failed: %s", self.turn_id, exc.message)
                tail = self.error_tail(exc.http_status, exc.message)
            except Exception:
                log.exception("stream of turn %s failed", self.turn_id)
                tail = self.error_tail(500, "internal error")
            state.streaming = False
            await body({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
        except asyncio.CancelledError:  # also one the watcher asked for just as the frames ended
            if not state.gone or task.uncancel() > 0:  # cancelled from elsewhere (e.g. shutdown): stays cancelled
                raise
            log.info("turn %s: the client went away mid-stream", self.turn_id)
        finally:
            state.streaming = False
            if lane is not None:
                lane.close()
            await frames.aclose()


class ChunkWriter:
    """A chunked response's body chunks written straight to uvicorn's httptools transport (``send``: its
    RequestResponseCycle's own send, once the response has started), framed as that send frames them
    (``b"%x\\r\\n" chunk "\\r\\n"``), with no ASGI message and coroutine per chunk. ``of`` is None for any other
    server or response (h11, a HEAD, a length-delimited body): the ASGI send then writes every chunk."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any):
        self._cycle, self._flow, self._transport = cycle, cycle.flow, cycle.transport

    @classmethod
    def of(cls, send: Any) -> ChunkWriter | None:
        cycle = getattr(send, "__self__", None)
        if (type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl"
                or getattr(cycle, "chunked_encoding", None) is not True
                or not getattr(cycle, "response_started", False) or getattr(cycle, "response_complete", True)
                or cycle.scope.get("method") == "HEAD" or not hasattr(cycle, "flow")
                or not hasattr(cycle, "transport")):
            return None
        return cls(cycle)

    def ready(self) -> bool:
        """Whether a chunk may be written now: the transport is not paused and the client is still there (else the
        ASGI send must take it: it waits for the transport to drain, or drops what a gone client would get)."""
        cycle = self._cycle
        return not (self._flow.write_paused or cycle.disconnected or cycle.response_complete)

    def put(self, chunk: bytes) -> None:
        """Write ``chunk`` (a chunk that follows one ``ready`` allowed: a paused transport buffers it)."""
        cycle = self._cycle
        if chunk and not (cycle.disconnected or cycle.response_complete):
            self._transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
