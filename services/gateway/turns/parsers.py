"""The gateway's answer parsers (Parsers, by vLLM's names), what they mean for one request (AnswerParsing), and one
answer's parser (AnswerEvents), which the parse stage (parse.py) runs over D's deltas.

A turn whose request parses nothing gets its text as content events, so every front end reads events alike. The
pieces of a stream concatenate to what the whole answer reports: the same parser runs over the same deltas.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvshuttle.control_plane.answer import AnswerParser, Event, Piece, keeps_special_tokens
from kvshuttle.control_plane.reasoning import CONTENT, REASONING_PARSERS, ReasoningRules, ThinkTags
from kvshuttle.control_plane.tool_calls import TOOL_CALL_PARSERS, ToolCallParserFactory, Tools


@dataclass(frozen=True)
class AnswerParsing:
    """How a turn's answer is parsed: the reasoning parser's rules and the tool-call parser's factory (None: that
    part is not parsed), and the request's tools (OpenAI's dicts), which some tool-call parsers read."""

    reasoning: ReasoningRules | None = None
    tools: ToolCallParserFactory | None = None
    request_tools: Tools = None


class AnswerEvents:
    """One turn's parser (``prompt_text``: the rendered prompt, which says whether the answer starts inside a
    reasoning block). ``feed`` a delta's text, ``finish`` once the answer has ended; ``events`` has them all.

    A piece is kept as a plain (kind, text) tuple, which the collector stops tracking at its first pass: a long
    answer's thousands of pieces never reach the old generation, whose full collections walk every object there
    (measured on the token path, docs/performance.md)."""

    def __init__(self, parsing: AnswerParsing | None, prompt_text: str):
        active = parsing is not None and (parsing.reasoning is not None or parsing.tools is not None)
        self._parser = AnswerParser(parsing.reasoning, parsing.tools, prompt_text=prompt_text,
                                    request_tools=parsing.request_tools) if active and parsing else None
        self._kept: list[tuple[str, str] | Event] = []
        self._finished = False
        self._events: list[Event] | None = None  # ``events`` once the answer has ended, made at the first read

    @property
    def events(self) -> list[Event]:
        """Every event so far, in order."""
        if self._events is not None:
            return self._events
        events = [Piece(*e) if type(e) is tuple else e for e in self._kept]
        if self._finished:
            self._events = events
        return events

    def feed(self, text: str) -> list[Event]:
        if self._parser is None:
            if not text:
                return []
            self._kept.append((CONTENT, text))
            return [Piece(CONTENT, text)]
        return self._keep(self._parser.feed(text))

    def finish(self) -> list[Event]:
        self._finished = True
        return self._keep(self._parser.finish()) if self._parser is not None else []

    def _keep(self, events: Iterable[Event]) -> list[Event]:
        out = list(events)
        self._kept.extend((e.kind, e.text) if type(e) is Piece else e for e in out)
        return out


@dataclass(frozen=True)
class Parsers:
    """The gateway's answer parsers, by vLLM's names (``--tool-call-parser``, ``--reasoning-parser``; "": that part
    is not parsed), and what they mean for a request: its AnswerParsing, whether the answer must keep the model's
    special tokens, and where the gateway's own constraints (forced calls, JSON answers) go."""

    tool_call_parser: str = ""
    reasoning_parser: str = ""

    def problem(self) -> str | None:
        """Why this pair cannot run together (None: it can). Harmony (gpt-oss) carries reasoning and calls in one
        syntax: its two parsers go together, and with no other family."""
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            return f"unknown --tool-call-parser {self.tool_call_parser!r}"
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            return f"unknown --reasoning-parser {self.reasoning_parser!r}"
        harmony = [bool(getattr(part, "keeps_special_tokens", False)) for part in (self.tools, self.reasoning)]
        if any(harmony) and not all(harmony):
            return ("gpt-oss's Harmony format carries reasoning and tool calls in one syntax: use --tool-call-parser "
                    "openai with --reasoning-parser openai_gptoss (or openai), or neither")
        return None

    @property
    def tools(self) -> ToolCallParserFactory | None:
        return TOOL_CALL_PARSERS[self.tool_call_parser] if self.tool_call_parser else None

    @property
    def reasoning(self) -> ReasoningRules | None:
        return REASONING_PARSERS[self.reasoning_parser] if self.reasoning_parser else None

    @property
    def keeps_special_tokens(self) -> bool:
        """The answer is decoded keeping special tokens whatever the request asks (Harmony's markers are some)."""
        return keeps_special_tokens(self.reasoning, self.tools)

    @property
    def think_tags(self) -> tuple[str, str] | None:
        """The reasoning block's (start, end) tags, after which the gateway places its own constraints (None: no
        reasoning parser, or one without tags)."""
        rules = self.reasoning
        return (rules.start, rules.end) if isinstance(rules, ThinkTags) else None

    @property
    def constrains(self) -> bool:
        """Whether the gateway can build its constraints (forced calls, JSON answers) for this model's answers:
        not for Harmony's, whose channels a grammar from the first token would forbid."""
        return not self.keeps_special_tokens

    def parsing(self, calls: bool, request_tools: Tools = None) -> AnswerParsing:
        """A request's parsing: reasoning always (when configured); tool calls when ``calls`` (tools sent and
        tool_choice not none)."""
        return AnswerParsing(self.reasoning, self.tools if calls else None, request_tools if calls else None)
