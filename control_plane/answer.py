"""What a model's answer means to an agent: its reasoning, its content and its tool calls, parsed as it streams.

The reasoning parser (reasoning.py) runs first; its content goes through the tool-call parser (tool_calls/).
Streaming and whole answers take the same path, so the pieces a stream sends concatenate to what the whole answer
reports (tests/unit/test_answer_parsing.py splits answers at every position to check it).

Harmony (``openai``, gpt-oss) writes reasoning and calls in one syntax: when either parser is Harmony's, one
tool_calls.harmony.HarmonyParser parses the answer, the part whose parser is not set passed on as content as written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvshuttle.control_plane.reasoning import CONTENT, REASONING, Harmony, ReasoningRules, ReasoningSplitter
from kvshuttle.control_plane.tool_calls import HarmonyCalls, ParsedCall, ToolCallParserFactory, Tools
from kvshuttle.control_plane.tool_calls.harmony import HarmonyEvent, HarmonyParser


@dataclass(frozen=True)
class Piece:
    """A piece of the answer's reasoning or content text."""

    kind: str  # REASONING or CONTENT
    text: str


Event = Piece | ParsedCall


def keeps_special_tokens(reasoning: ReasoningRules | None, tools: ToolCallParserFactory | None) -> bool:
    """Whether these parsers need the answer's text with the model's special tokens kept (decoded with
    ``skip_special_tokens=False``, whether or not the request has tools): Harmony's markers are special tokens."""
    return bool(getattr(reasoning, "keeps_special_tokens", False) or getattr(tools, "keeps_special_tokens", False))


class AnswerParser:
    """Parses one answer. ``reasoning``/``tools``: the reasoning parser's rules and the tool-call parser's factory
    (reasoning.REASONING_PARSERS, tool_calls.TOOL_CALL_PARSERS; None: that part is not parsed); ``request_tools``:
    the request's tools, which some tool-call parsers read (the schema types of the arguments). Harmony's parsers
    (``openai_gptoss`` / ``openai``) go together or alone: with another family's, ValueError."""

    def __init__(self, reasoning: ReasoningRules | None = None, tools: ToolCallParserFactory | None = None, *,
                 prompt_text: str = "", request_tools: Tools = None):
        self._reasoning = self._tools = self._harmony = None
        harmony_reasoning, harmony_calls = isinstance(reasoning, Harmony), tools is HarmonyCalls
        if harmony_reasoning or harmony_calls:
            if (reasoning is not None and not harmony_reasoning) or (tools is not None and not harmony_calls):
                raise ValueError("the openai (Harmony) reasoning and tool-call parsers go together, or alone")
            self._harmony = HarmonyParser(request_tools, reasoning=harmony_reasoning, calls=harmony_calls,
                                          prompt_text=prompt_text)
            return
        self._reasoning = ReasoningSplitter(reasoning, prompt_text=prompt_text) if reasoning else None
        self._tools = tools(request_tools) if tools else None

    def feed(self, text: str) -> list[Event]:
        if self._harmony is not None:
            return list(_events(self._harmony.feed(text)))
        pieces = self._reasoning.feed(text) if self._reasoning else ((CONTENT, text),)
        return self._content(pieces, final=False)

    def finish(self) -> list[Event]:
        """What was held back, once the answer has ended."""
        if self._harmony is not None:
            return list(_events(self._harmony.finish()))
        pieces = self._reasoning.finish() if self._reasoning else ()
        return self._content(pieces, final=True)

    def _content(self, pieces: Iterable[tuple[str, str]], *, final: bool) -> list[Event]:
        """A list, not a generator: this runs per streamed token."""
        out: list[Event] = []
        tools = self._tools
        for kind, text in pieces:
            if kind == REASONING or tools is None:
                if text:
                    out.append(Piece(kind, text))
                continue
            for item in tools.feed(text):
                out.append(item if isinstance(item, ParsedCall) else Piece(CONTENT, item))
        if final and tools is not None:
            out.extend(item if isinstance(item, ParsedCall) else Piece(CONTENT, item) for item in tools.finish())
        return out

    @property
    def called_tools(self) -> bool:
        if self._harmony is not None:
            return bool(self._harmony.calls)
        return bool(self._tools and self._tools.calls)


def _events(events: Iterable[HarmonyEvent]) -> Iterator[Event]:
    for event in events:
        yield event if isinstance(event, ParsedCall) else Piece(*event)


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


def parse_answer(text: str, reasoning: ReasoningRules | None = None, tools: ToolCallParserFactory | None = None, *,
                 prompt_text: str = "", request_tools: Tools = None) -> ParsedAnswer:
    """A whole answer, parsed."""
    parser = AnswerParser(reasoning, tools, prompt_text=prompt_text, request_tools=request_tools)
    out = ParsedAnswer()
    for event in [*parser.feed(text), *parser.finish()]:
        out.add(event)
    return out
