"""Stage 5, the answer's meaning: D's text deltas parsed into reasoning, content and tool calls as they stream
(control_plane.answer, with the request's parsers.AnswerParsing), so the front ends only spell the events in their
API's shape. The runner calls it per delta in its own loop (no generator of its own: one hop less per token)."""

from __future__ import annotations

from kvshuttle.services.gateway.turns.context import Delta, TurnContext
from kvshuttle.services.gateway.turns.parsers import AnswerEvents


class Parsing:
    """One turn's parse stage: ``feed`` sets each of the decode stage's deltas' ``events``; ``finish`` (once the
    answer has ended) sets ``ctx.held_events`` (what the parser held back until then) and ``ctx.answer`` (whose
    ``events`` are every event, in order)."""

    __slots__ = ("ctx", "answer")

    def __init__(self, ctx: TurnContext):
        self.ctx = ctx
        self.answer = AnswerEvents(ctx.request.parsing, ctx.prompt_text)

    def feed(self, delta: Delta) -> Delta:
        delta.events = self.answer.feed(delta.text)
        return delta

    def finish(self) -> None:
        self.ctx.held_events = self.answer.finish()
        self.ctx.answer = self.answer
