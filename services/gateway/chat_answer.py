"""A chat answer in OpenAI's shape: reasoning, content and tool calls, as one message or as stream deltas.

The parsing itself is pure (kvshuttle.control_plane.answer); this module only spells its events the way OpenAI's
and vLLM's servers do: ``reasoning_content`` (and vLLM's newer ``reasoning``), ``content``, and ``tool_calls``
(streamed as the call's index, id and name first, then its arguments), with ``finish_reason: "tool_calls"`` when
the answer called a tool.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvshuttle.control_plane.answer import AnswerParser, Event, ParsedAnswer, Piece
from kvshuttle.control_plane.reasoning import REASONING, ThinkTags
from kvshuttle.control_plane.tool_calls import ParsedCall, ToolCallParserFactory, Tools


def tool_call_id() -> str:
    """A tool call's id, spelled as vLLM spells them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class AnswerShape:
    """How one request's answer is parsed and spelled. ``tools``: None when tool calls are not parsed
    (no tools, or ``tool_choice: "none"``); ``request_tools``: the request's tools (OpenAI's dicts), which some
    tool-call parsers read; ``include_reasoning``: false drops the reasoning (vLLM's field)."""

    reasoning: ThinkTags | None = None
    tools: ToolCallParserFactory | None = None
    request_tools: Tools = None
    prompt_text: str = ""
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    new_id: Callable[[], str] = tool_call_id
    _parser: AnswerParser | None = field(default=None, init=False, repr=False)
    _ids: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _blank: str | None = field(default="", init=False, repr=False)  # leading blank content held (None: none left)

    @property
    def plain(self) -> bool:
        """Nothing to parse: the answer's text is its content."""
        return self.reasoning is None and self.tools is None

    def _stream_parser(self) -> AnswerParser:
        if self._parser is None:
            self._parser = AnswerParser(self.reasoning, self.tools, prompt_text=self.prompt_text,
                                        request_tools=self.request_tools)
        return self._parser

    def _kept(self, event: Event) -> bool:
        if isinstance(event, ParsedCall):
            return self.parallel_tool_calls or event.index == 0
        return self.include_reasoning or event.kind != REASONING

    def _call_id(self, index: int) -> str:
        if index not in self._ids:
            self._ids[index] = self.new_id()
        return self._ids[index]

    # -- streaming ------------------------------------------------------------------------------------------

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The stream deltas for the next piece of answer text."""
        if self.plain:
            return [{"content": text}] if text else []
        return self._spell(self._stream_parser().feed(text))

    def finish_deltas(self) -> list[dict[str, Any]]:
        """The deltas of what the parser held back, once the answer has ended."""
        if self.plain:
            return []
        out = self._spell(self._stream_parser().finish())
        if self._blank and not self._ids:  # blank content and no call: it is the content
            out.append({"content": self._blank})
        self._blank = None
        return out

    def _spell(self, events) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if not self._kept(event):
                continue
            if isinstance(event, Piece):
                if event.kind == REASONING:
                    out.append({"reasoning_content": event.text, "reasoning": event.text})
                    continue
                text = event.text
                if self.tools is not None and self._blank is not None:
                    # Leading blank content (the blank line after the reasoning) is no content when calls follow,
                    # as vLLM reports it: held until text or the answer's end says which.
                    if not (self._blank + text).strip():
                        self._blank += text
                        continue
                    text, self._blank = self._blank + text, None
                out.append({"content": text})
                continue
            self._blank = None
            out.append({"tool_calls": [{"index": event.index, "id": self._call_id(event.index), "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        return out

    @property
    def streamed_calls(self) -> bool:
        return bool(self._ids)

    # -- whole answers --------------------------------------------------------------------------------------

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole answer, and whether it called a tool."""
        if self.plain:
            return {"role": "assistant", "content": text}, False
        parser = AnswerParser(self.reasoning, self.tools, prompt_text=self.prompt_text,
                              request_tools=self.request_tools)
        parsed = ParsedAnswer()
        for event in [*parser.feed(text), *parser.finish()]:
            if self._kept(event):
                parsed.add(event)
        content = parsed.content
        if parsed.tool_calls and content is not None and not content.strip():
            content = None  # only the blank line before the calls (as vLLM reports it)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": self._call_id(c.index), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.tool_calls]
        return message, bool(parsed.tool_calls)


def finish_reason(engine_reason: str, called_tools: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the answer called a tool (as vLLM reports it)."""
    return "tool_calls" if called_tools else engine_reason
