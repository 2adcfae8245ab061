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
from typing import Any

from kvshuttle.control_plane.answer import Event
from kvshuttle.control_plane.answer_blocks import (
    APPENDED,
    CALL_BLOCK,
    OPENED,
    REASONING_BLOCK,
    TEXT_BLOCK,
    AnswerBlocks,
    Step,
)


def tool_call_id() -> str:
    """A tool call's id, spelled as vLLM spells them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class AnswerShape:
    """How one request's answer is spelled in chat's shape, over the answer's blocks (control_plane.answer_blocks:
    which calls are kept, blank text and the finish reason are decided there, as for every API). ``parsed``: the
    answer is parsed (reasoning or tools; otherwise its whole text is its content); ``include_reasoning``: false
    drops the reasoning (vLLM's field)."""

    def __init__(self, parsed: bool = False, parallel_tool_calls: bool = True, include_reasoning: bool = True,
                 new_id: Callable[[], str] = tool_call_id):
        self.parsed = parsed
        self.blocks = AnswerBlocks(parallel_tool_calls=parallel_tool_calls, include_reasoning=include_reasoning,
                                   new_call_id=new_id)

    # -- streaming ------------------------------------------------------------------------------------------

    def deltas(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The stream deltas for the events of the next piece of answer text."""
        return _deltas(self.blocks.feed(events)) if events else []

    def finish_deltas(self, events: Iterable[Event] = ()) -> list[dict[str, Any]]:
        """The deltas of what the parser held back (``events``), once the answer has ended."""
        return _deltas(self.blocks.finish(events))

    def finish_reason(self, engine_reason: str) -> str:
        return self.blocks.finish_reason(engine_reason)

    # -- whole answers --------------------------------------------------------------------------------------

    def message(self, text: str, events: Iterable[Event]) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole answer (``text``, and ``events``: all its events), and whether it kept
        a call."""
        if not self.parsed:
            return {"role": "assistant", "content": text}, False
        blocks = self.blocks
        blocks.whole(events)
        message: dict[str, Any] = {"role": "assistant", "content": blocks.joined(TEXT_BLOCK)}
        reasoning = blocks.joined(REASONING_BLOCK)
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        calls = blocks.kept_calls
        if calls:
            message["tool_calls"] = [{"id": c.call_id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, bool(calls)


def _deltas(steps: list[Step]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for step, block, text in steps:
        if step == APPENDED:
            if block.kind == TEXT_BLOCK:
                out.append({"content": text})
            else:
                out.append({"reasoning_content": text, "reasoning": text})
        elif step == OPENED and block.kind == CALL_BLOCK:
            out.append({"tool_calls": [{"index": block.call_index, "id": block.call_id, "type": "function",
                                        "function": {"name": block.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": block.call_index, "function": {"arguments": block.arguments}}]})
    return out

