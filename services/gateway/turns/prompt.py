"""Stage 1, the prompt: render the chat, find the session it continues, and build the exact prompt ids.

The ids continue the session's recorded ids wherever the new text extends the recorded text (never re-tokenizing
the history, which would silently break KV reuse); only the new text is tokenized.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc
from kvshuttle.control_plane import session as session_rules
from kvshuttle.control_plane.continuation import (
    Boundary,
    Continuation,
    common_prefix,
    last_message_end,
    plan_continuation,
    prefix_keys,
)
from kvshuttle.services.gateway.tokens import off_loop
from kvshuttle.services.gateway.turns.context import KnownSession, TurnContext, elapsed_ms
from kvshuttle.services.gateway.turns.errors import TurnError
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.v1 import common_pb2, registry_pb2

if TYPE_CHECKING:
    from kvshuttle.services.gateway.turns.services import TurnServices

log = logging.getLogger(__name__)

Known = tuple[registry_pb2.GetSessionResponse | None, KnownSession]


async def build(rt: TurnServices, ctx: TurnContext, *, fresh: bool = False) -> None:
    """Sets ``ctx.prompt_ids``, ``prompt_text`` ('' for raw ids), ``continued`` (the ids continue recorded ids),
    ``known_session`` (the session snapshot for the scheduler, and how many of its ids the prompt repeats) and the
    cuts the turn's record keeps (``text_cuts``). ``fresh``: read the record from the registry, not this gateway's
    copy (the text is not rendered again). Timings: ``session_ms`` (and ``find_ms``)."""
    req = ctx.request
    if req.prompt_ids is not None:
        ctx.prompt_ids, ctx.prompt_text, ctx.continued, ctx.known_session = list(req.prompt_ids), "", False, KnownSession()
        ctx.history_base, ctx.history_kept, ctx.text_cuts = None, 0, []
        return
    text = ctx.prompt_text if fresh else await _text(rt, req)
    if req.session_id and not req.session_source:
        req.session_source = "client"
    t = time.perf_counter()
    if req.session_id:
        prev, known = await previous(rt, req, fresh=fresh)
    elif req.cache_key:
        prev, known = await by_cache_key(rt, req, text)
        ctx.timings["find_ms"] = elapsed_ms(t)
    elif rt.find_sessions and req.messages is not None:
        prev, known = await find(rt, req, text)
        ctx.timings["find_ms"] = elapsed_ms(t)
    else:
        prev, known = None, KnownSession()
    ctx.timings["session_ms"] = elapsed_ms(t)
    if prev is not None and prev.session.model != req.model:
        # Another model's record (a client's session id sent to another model): none of its ids (another tokenizer's)
        # are continued, and the scheduler, which still gets the snapshot, reuses none of its KV (other_model).
        prev = None
    if prev is not None and prev.history_missing:
        rt.degraded["history_missing"] += 1
        log.warning("the session's exact ids are not available (%s): tokenizing its text again (%d such turns)",
                    prev.history_missing, rt.degraded["history_missing"])
    s = prev.session if prev is not None else None
    cont = (plan_continuation(s.text_chars, s.text_key, s.token_ids, text, boundaries(s)) if s
            else Continuation((), text))
    cut = last_message_end(text, end_markers(rt)) if req.messages is not None else 0
    # a new conversation's first message (system prompt, tools) from the gateway's cache of them
    known_ids, skip = cont.prefix_ids, 0
    if req.messages is not None and not cont.prefix_chars:
        known_ids, skip = await off_loop.first_message(rt.tokenizer, req.tenant, text)
    rest = cont.suffix_text[skip:] if skip else cont.suffix_text
    at = cut - cont.prefix_chars - skip
    if at <= 0:  # the rest holds no whole message (or its last one ends where the known ids do)
        suffix_ids = await off_loop.encode(rt.tokenizer, rest)
        cut_tokens = len(known_ids) if at == 0 and (cont.continues or skip) else 0
    else:  # tokenized in two parts, so that the record knows the ids of the text up to the last message's end
        head, tail = await off_loop.encode_split(rt.tokenizer, rest, at)
        suffix_ids, cut_tokens = [*head, *tail], len(known_ids) + len(head)
    ctx.prompt_ids, ctx.prompt_text = [*known_ids, *suffix_ids], text
    ctx.continued, ctx.known_session = cont.continues, known
    ctx.history_base = s if cont.continues else None  # the record stage then sends only the ids after the kept ones
    ctx.history_kept = len(cont.prefix_ids)
    ctx.text_cuts = text_cuts(cont, s, (cut, cut_tokens) if cut_tokens else None, answers_a_query(req.messages))
    if s is not None and s.token_ids and known.snapshot is not None:
        # how far the prompt repeats the record's ids (by construction at least the continued ones): the scheduler
        # may pull the whole blocks of that many, where the record's digests prove fewer
        known.history_match_tokens = common_prefix(ctx.prompt_ids, s.token_ids, len(cont.prefix_ids))


def end_markers(rt: TurnServices) -> list[str]:
    markers = getattr(rt.tokenizer, "end_markers", None)
    return markers if isinstance(markers, list) else []


def boundaries(s: common_pb2.Session) -> list[Boundary]:
    return [Boundary(b.key, b.chars, b.tokens, b.loop_start) for b in s.text_boundaries]


def answers_a_query(messages: list[dict] | None) -> bool:
    """Whether the turn answers a user query (its last message is the user's, not a tool result), which starts a
    new tool loop. As Qwen3's template tells its last query: a user message that is not a wrapped tool response."""
    if not messages or messages[-1].get("role") != "user":
        return False
    content = messages[-1].get("content")
    return not (isinstance(content, str) and content.startswith("<tool_response>")
                and content.endswith("</tool_response>"))


def text_cuts(cont: Continuation, record: common_pb2.Session | None, cut: tuple[int, int] | None,
              new_loop: bool) -> list[tuple[int, int, bool]]:
    """The cuts (chars, tokens, loop_start) the turn's record keeps: where the prompt's last message ends (``cut``),
    and where the answer to the conversation's last user query began: that same cut when this turn answers one
    (``new_loop``), else the previous record's loop start while the prompt still holds it (its ids continued)."""
    out: dict[int, tuple[int, int, bool]] = {}
    if cut is not None:
        out[cut[0]] = (*cut, new_loop)
    loop = None if new_loop or record is None else next((b for b in record.text_boundaries if b.loop_start), None)
    if (loop is not None and loop.tokens <= len(cont.prefix_ids) and loop.chars <= cont.prefix_chars
            and out.get(loop.chars, (0, loop.tokens))[1] == loop.tokens):
        out[loop.chars] = (loop.chars, loop.tokens, True)
    return [out[c] for c in sorted(out)]


async def _text(rt: TurnServices, req: TurnRequest) -> str:
    if req.messages is None:
        return req.prompt_text or ""
    try:
        return await off_loop.render_chat(rt.tokenizer, req.messages, **req.template_vars)
    except Exception as exc:  # template errors are the caller's input
        raise TurnError(400, grpc.StatusCode.INVALID_ARGUMENT, f"cannot render chat: {exc}") from None


def without_history(resp: registry_pb2.GetSessionResponse) -> registry_pb2.GetSessionResponse:
    """The snapshot the scheduler gets: it checks the prompt against the prefix digests, not the token ids."""
    out = registry_pb2.GetSessionResponse(expires_in_s=resp.expires_in_s)
    out.session.CopyFrom(resp.session)
    out.session.ClearField("token_ids")
    return out


async def previous(rt: TurnServices, req: TurnRequest, *, fresh: bool = False) -> Known:
    """The session's record (this gateway's own copy unless ``fresh``), and what to tell the scheduler about it
    (so it need not read it again)."""
    own = None if fresh else rt.own_record(req.tenant, req.session_id)
    if own is not None:
        resp = registry_pb2.GetSessionResponse(session=own, expires_in_s=session_rules.expires_in(own, time.time()))
        return resp, KnownSession(without_history(resp))
    try:
        resp = await rt.registry.GetSession(
            registry_pb2.GetSessionRequest(session_id=req.session_id, tenant=req.tenant, include_token_ids=True),
            timeout=rt.control_timeout_s)
        return resp, KnownSession(without_history(resp))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise TurnError(400, exc.code(), exc.details() or "invalid session id") from None
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None, KnownSession(not_found=True)
        rt.degraded["session_read_failed"] += 1
        log.warning("registry unavailable reading a session (%s: %s): tokenizing from scratch (%d such reads)",
                    exc.code().name, exc.details(), rt.degraded["session_read_failed"])
        return None, KnownSession()


async def by_cache_key(rt: TurnServices, req: TurnRequest, text: str) -> Known:
    """A request without a session id but with a prompt_cache_key: the session the key names when the prompt
    continues its record (whole or at a boundary); else the session found by content, or a new one (under the
    key's id when the key names no session yet). A key many conversations share so finds each its own."""
    keyed = req.cache_key_session
    req.session_id = keyed
    prev, known = await previous(rt, req)
    s = prev.session if prev is not None else None
    if s is not None and plan_continuation(s.text_chars, s.text_key, s.token_ids, text, boundaries(s)).continues:
        req.session_source = "prompt_cache_key"
        return prev, known
    req.session_id = ""
    new_id = keyed if known.not_found else ""
    if rt.find_sessions and req.messages is not None:
        return await find(rt, req, text, new_id)
    req.session_id, req.session_source = new_id or f"auto-{uuid.uuid4().hex}", "new"
    return None, KnownSession(not_found=True)


async def find(rt: TurnServices, req: TurnRequest, text: str, new_id: str = "") -> Known:
    """A chat without a session id: the session whose recorded text ``text`` extends, whole or up to one of its
    boundaries (found by content key), or a new session (``new_id``, else a new id). Sets ``req.session_id`` and
    ``req.session_source``.

    A conversation's first turn (no assistant message yet) never continues a session at a boundary: a chat that
    merely starts as another one did (the same system prompt and first question) starts its own session rather than
    taking that one over. A later turn does: its history up to there is the other session's (a fork). Nor can a
    first turn continue a record's whole text, which ends with an answer its prompt does not hold: a first turn
    starts a new session without asking the registry."""
    first_turn = not any(m.get("role") == "assistant" for m in req.messages or [])
    keys = [] if first_turn else prefix_keys(text, end_markers(rt))
    found = None
    if keys:
        try:
            found = await rt.registry.FindSession(registry_pb2.FindSessionRequest(
                tenant=req.tenant, text_keys=keys, include_token_ids=True, model=req.model),
                timeout=rt.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                rt.degraded["session_read_failed"] += 1
                log.warning("registry unavailable finding a session (%s: %s): starting a new one",
                            exc.code().name, exc.details())
    if found is None:
        req.session_id, req.session_source = new_id or f"auto-{uuid.uuid4().hex}", "new"
        return None, KnownSession(not_found=True)
    req.session_id, req.session_source = found.session.session_id, "found"
    rt.sessions_found += 1
    resp = registry_pb2.GetSessionResponse(session=found.session, expires_in_s=found.expires_in_s,
                                           history_missing=found.history_missing)
    return resp, KnownSession(without_history(resp))
