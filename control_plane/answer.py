"""What a model's answer means to an agent: its reasoning, its content and its tool calls, parsed as it streams.

The reasoning parser (reasoning.py) runs first; its content goes through the tool-call parser (tool_calls.py).
Streaming and whole answers take the same path, so the pieces a stream sends concatenate to what the whole answer
reports (tests/unit/test_answer_parsing.py splits answers at every position to check it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvshuttle.control_plane.reasoning import CONTENT, REASONING, ReasoningSplitter, ThinkTags
from kvshuttle.control_plane.tool_calls import ParsedCall, ToolCallParserFactory, Tools


@dataclass(frozen=True)
class Piece:
    """A piece of the answer's reasoning or content text."""

    kind: str  # REASONING or CONTENT
    text: str


Event = Piece | ParsedCall


class AnswerParser:
    """Parses one answer. ``reasoning``/``tools``: the reasoning parser's rules and the tool-call parser's factory
    (tool_calls.TOOL_CALL_PARSERS; None: that part is not parsed); ``request_tools``: the request's tools, which some
    tool-call parsers read (the schema types of the arguments)."""

    def __init__(self, reasoning: ThinkTags | None = None, tools: ToolCallParserFactory | None = None, *,
                 prompt_text: str = "", request_tools: Tools = None):
        self._reasoning = ReasoningSplitter(reasoning, prompt_text=prompt_text) if reasoning else None
        self._tools = tools(request_tools) if tools else None

    def feed(self, text: str) -> Iterator[Event]:
        pieces = self._reasoning.feed(text) if self._reasoning else [(CONTENT, text)]
        yield from self._content(pieces, final=False)

    def finish(self) -> Iterator[Event]:
        """What was held back, once the answer has ended."""
        pieces = self._reasoning.finish() if self._reasoning else []
        yield from self._content(pieces, final=True)

    def _content(self, pieces: Iterable[tuple[str, str]], *, final: bool) -> Iterator[Event]:
        for kind, text in pieces:
            if kind == REASONING or self._tools is None:
                if text:
                    yield Piece(kind, text)
                continue
            for item in self._tools.feed(text):
                yield item if isinstance(item, ParsedCall) else Piece(CONTENT, item)
        if final and self._tools is not None:
            for item in self._tools.finish():
                yield item if isinstance(item, ParsedCall) else Piece(CONTENT, item)

    @property
    def called_tools(self) -> bool:
        return bool(self._tools and self._tools.calls)


@dataclass
class ParsedAnswer:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ParsedCall] = field(default_factory=list)

    def add(self, event: Event) -> None:
        if isinstance(event, ParsedCall):
            self.tool_calls.append(event)
        elif event.kind == REASONING:
            self.reasoning = (self.reasoning or "") + event.text
        else:
            self.content = (self.content or "") + event.text


def parse_answer(text: str, reasoning: ThinkTags | None = None, tools: ToolCallParserFactory | None = None, *,
                 prompt_text: str = "", request_tools: Tools = None) -> ParsedAnswer:
    """A whole answer, parsed."""
    parser = AnswerParser(reasoning, tools, prompt_text=prompt_text, request_tools=request_tools)
    out = ParsedAnswer()
    for event in [*parser.feed(text), *parser.finish()]:
        out.add(event)
    return out
