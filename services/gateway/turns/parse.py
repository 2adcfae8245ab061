"""Stage 5, the answer's meaning: D's text deltas parsed into reasoning, content and tool calls as they stream
(control_plane.answer, with the request's parsers.AnswerParsing), so the front ends only spell the events in their
API's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvshuttle.services.gateway.turns.context import Delta, TurnContext
from kvshuttle.services.gateway.turns.parsers import AnswerEvents


async def run(ctx: TurnContext, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The stage: sets each of the decode stage's deltas' ``events``; once the answer has ended, ``ctx.held_events``
    (what the parser held back until then) and ``ctx.answer_events`` (every event, in order)."""
    answer = AnswerEvents(ctx.request.parsing, ctx.prompt_text)
    async for delta in deltas:
        delta.events = answer.feed(delta.text)
        yield delta
    ctx.held_events = answer.finish()
    ctx.answer_events = answer.events
