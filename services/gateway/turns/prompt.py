"""Stage 1, the prompt: render the chat, find the session it continues, and build the exact prompt ids.

The ids continue the session's recorded ids wherever the new text extends the recorded text (never re-tokenizing
the history, which would silently break KV reuse); only the new text is tokenized.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import grpc
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.continuation import plan_continuation, prefix_keys
from kvshuttle.services.gateway.turns.context import TurnContext, TurnError, elapsed_ms
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.v1 import registry_pb2

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.runner import TurnRunner

log = logging.getLogger(__name__)

Known = tuple[registry_pb2.GetSessionResponse | None, dict[str, Any]]


async def build(rt: TurnRunner, ctx: TurnContext, *, fresh: bool = False) -> None:
    """Sets ``ctx.prompt_ids``, ``prompt_text`` ('' for raw ids), ``continued`` (the ids continue recorded ids) and
    ``known_session`` (the session snapshot for the scheduler). ``fresh``: read the record from the registry, not
    this gateway's copy (the text is not rendered again). Timings: ``session_ms`` (and ``find_ms``)."""
    req = ctx.request
    if req.prompt_ids is not None:
        ctx.prompt_ids, ctx.prompt_text, ctx.continued, ctx.known_session = list(req.prompt_ids), "", False, {}
        ctx.history_base = None
        return
    text = ctx.prompt_text if fresh else await _text(rt, req)
    if req.session_id and not req.session_source:
        req.session_source = "client"
    t = time.perf_counter()
    if req.session_id:
        prev, known = await previous(rt, req, fresh=fresh)
    elif rt.find_sessions and req.messages is not None:
        prev, known = await find(rt, req, text)
        ctx.timings["find_ms"] = elapsed_ms(t)
    else:
        prev, known = None, {}
    ctx.timings["session_ms"] = elapsed_ms(t)
    if prev is not None and prev.history_missing:
        rt.degraded["history_missing"] += 1
        log.warning("the session's exact ids are not available (%s): tokenizing its text again (%d such turns)",
                    prev.history_missing, rt.degraded["history_missing"])
    s = prev.session if prev is not None else None
    cont = plan_continuation(s.text_chars, s.text_key, s.token_ids, text) if s else plan_continuation(0, b"", [],
                                                                                                    text)
    suffix_ids = await asyncio.to_thread(rt.tokenizer.encode, cont.suffix_text, False)
    ctx.prompt_ids, ctx.prompt_text = [*cont.prefix_ids, *suffix_ids], text
    ctx.continued, ctx.known_session = cont.continues, known
    ctx.history_base = s if cont.continues else None  # the record stage then sends only the ids after s's


async def _text(rt: TurnRunner, req: TurnRequest) -> str:
    if req.messages is None:
        return req.prompt_text or ""
    try:
        return await asyncio.to_thread(rt.tokenizer.render_chat, req.messages, True, **req.template_vars)
    except Exception as exc:  # template errors are the caller's input
        raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"cannot render chat: {exc}") from None


def without_history(resp: registry_pb2.GetSessionResponse) -> registry_pb2.GetSessionResponse:
    """The snapshot the scheduler gets: it checks the prompt against the prefix digests, not the token ids."""
    out = registry_pb2.GetSessionResponse(expires_in_s=resp.expires_in_s)
    out.session.CopyFrom(resp.session)
    out.session.ClearField("token_ids")
    return out


async def previous(rt: TurnRunner, req: TurnRequest, *, fresh: bool = False) -> Known:
    """The session's record (this gateway's own copy unless ``fresh``), and what to tell the scheduler about it
    (so it need not read it again)."""
    own = None if fresh else rt.own_record(req.tenant, req.session_id)
    if own is not None:
        resp = registry_pb2.GetSessionResponse(session=own, expires_in_s=session_rules.expires_in(own, time.time()))
        return resp, {"session_snapshot": without_history(resp)}
    try:
        resp = await rt.registry.GetSession(
            registry_pb2.GetSessionRequest(session_id=req.session_id, tenant=req.tenant, include_token_ids=True),
            timeout=rt.control_timeout_s)
        return resp, {"session_snapshot": without_history(resp)}
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise TurnError(400, exc.code(), exc.details() or "invalid session id") from None
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None, {"session_not_found": True}
        rt.degraded["session_read_failed"] += 1
        log.warning("registry unavailable reading a session (%s: %s): tokenizing from scratch (%d such reads)",
                    exc.code().name, exc.details(), rt.degraded["session_read_failed"])
        return None, {}


async def find(rt: TurnRunner, req: TurnRequest, text: str) -> Known:
    """A chat without a session id: the session whose recorded text ``text`` extends (found by content key), or
    a new session id. Sets ``req.session_id`` and ``req.session_source``."""
    markers = getattr(rt.tokenizer, "end_markers", None) or []
    keys = prefix_keys(text, markers) if isinstance(markers, list) else []
    found = None
    if keys:
        try:
            found = await rt.registry.FindSession(registry_pb2.FindSessionRequest(
                tenant=req.tenant, text_keys=keys, include_token_ids=True), timeout=rt.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                rt.degraded["session_read_failed"] += 1
                log.warning("registry unavailable finding a session (%s: %s): starting a new one",
                            exc.code().name, exc.details())
    if found is None:
        req.session_id, req.session_source = f"auto-{uuid.uuid4().hex}", "new"
        return None, {"session_not_found": True}
    req.session_id, req.session_source = found.session.session_id, "found"
    rt.sessions_found += 1
    resp = registry_pb2.GetSessionResponse(session=found.session, expires_in_s=found.expires_in_s,
                                           history_missing=found.history_missing)
    return resp, {"session_snapshot": without_history(resp)}
