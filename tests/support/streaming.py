"""Feeding an answer to a parser in pieces, as a stream would (the parser tests split answers at every position)."""

from __future__ import annotations

from kvshuttle.control_plane.answer import AnswerParser, Event, ParsedAnswer


def streamed(parser: AnswerParser, text: str, cuts: list[int]) -> tuple[ParsedAnswer, list[Event]]:
    """``text`` fed to ``parser`` cut at ``cuts`` (positions, ascending), then finished: the answer its events make,
    and the events."""
    out, events = ParsedAnswer(), []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        events.extend(parser.feed(text[a:b]))
    events.extend(parser.finish())
    for event in events:
        out.add(event)
    return out, events
