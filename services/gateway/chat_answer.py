"""A chat answer in OpenAI's shape: reasoning, content and tool calls, as one message or as stream deltas.

The parsing itself is pure (kvshuttle.control_plane.answer), run by the turn's parse stage; this module only spells
its events the way OpenAI's
and vLLM's servers do: ``reasoning_content`` (and vLLM's newer ``reasoning``), ``content``, and ``tool_calls``
(streamed as the call's index, id and name first, then its arguments), with ``finish_reason: "tool_calls"`` when
the answer called a tool.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvshuttle.control_plane.answer import Event, ParsedAnswer, Piece
from kvshuttle.control_plane.reasoning import REASONING
from kvshuttle.control_plane.tool_calls import ParsedCall


def tool_call_id() -> str:
    """A tool call's id, spelled as vLLM spells them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class AnswerShape:
    """How one request's answer events (the turn's parse stage) are spelled. ``parsed``: the answer is parsed
    (reasoning or tools; otherwise its text is its content); ``calls``: tool calls are parsed (tools sent, and
    ``tool_choice`` is not ``"none"``); ``include_reasoning``: false drops the reasoning (vLLM's field)."""

    parsed: bool = False
    calls: bool = False
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    new_id: Callable[[], str] = tool_call_id
    _ids: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _blank: str | None = field(default="", init=False, repr=False)  # leading blank content held (None: none left)

    def _kept(self, event: Event) -> bool:
        if isinstance(event, ParsedCall):
            return self.parallel_tool_calls or event.index == 0
        return self.include_reasoning or event.kind != REASONING

    def _call_id(self, index: int) -> str:
        if index not in self._ids:
            self._ids[index] = self.new_id()
        return self._ids[index]

    # -- streaming ------------------------------------------------------------------------------------------

    def deltas(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The stream deltas for the events of the next piece of answer text."""
        return self._spell(events)

    def finish_deltas(self, events: Iterable[Event] = ()) -> list[dict[str, Any]]:
        """The deltas of what the parser held back (``events``), once the answer has ended."""
        out = self._spell(events)
        if self._blank and not self._ids:  # blank content and no call: it is the content
            out.append({"content": self._blank})
        self._blank = None
        return out

    def _spell(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if not self._kept(event):
                continue
            if isinstance(event, Piece):
                if event.kind == REASONING:
                    out.append({"reasoning_content": event.text, "reasoning": event.text})
                    continue
                text = event.text
                if self.calls and self._blank is not None:
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

    def message(self, text: str, events: Iterable[Event]) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole answer (``text``, and ``events``: all its events), and whether it
        called a tool."""
        if not self.parsed:
            return {"role": "assistant", "content": text}, False
        parsed = ParsedAnswer()
        for event in events:
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
