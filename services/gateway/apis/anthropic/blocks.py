"""The answer as Anthropic's content blocks (``thinking``, ``text``, ``tool_use``), its ``stop_reason`` and its
usage.

``stop_reason``: ``tool_use`` (a call was parsed), ``max_tokens``, ``stop_sequence`` (the answer's text ends with the
stop sequence that matched; it is kept in the text, as the chat route keeps it) or ``end_turn``. ``usage`` follows
Anthropic's accounting: ``cache_read_input_tokens`` are the prompt tokens this turn did not compute (pulled or
cached), ``input_tokens`` the rest, so their sum is the prompt; ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from kvshuttle.control_plane.answer import Event
from kvshuttle.control_plane.answer_blocks import APPENDED, CALL_BLOCK, CLOSED, TEXT_BLOCK, AnswerBlocks, Step
from kvshuttle.services.gateway.turns.reply import Usage


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class ContentBlocks:
    """The answer's blocks (control_plane.answer_blocks, the rules every API shares) as Anthropic's content blocks:
    both the whole ``content`` (``self.content``) and the stream events that build it (``feed`` / ``finish`` return
    ``(event type, payload)`` pairs), so a stream and a whole answer come out the same. ``parallel`` false keeps only
    the first tool call."""

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = tool_use_id):
        self.blocks = AnswerBlocks(parallel_tool_calls=parallel, new_call_id=new_id)
        self.content: list[dict[str, Any]] = []

    @property
    def calls(self) -> int:
        return self.blocks.calls

    def feed(self, events: Iterable[Event]) -> list[tuple[str, dict[str, Any]]]:
        """The stream events for the answer events of the next piece of text (the turn's parse stage)."""
        return self._spell(self.blocks.feed(events))

    def finish(self, events: Iterable[Event] = ()) -> list[tuple[str, dict[str, Any]]]:
        """The stream events for what the parser held back (``events``), once the answer has ended."""
        return self._spell(self.blocks.finish(events))

    def _spell(self, steps: list[Step]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for step, block, text in steps:
            index = block.position
            if step == APPENDED:
                if block.kind == TEXT_BLOCK:
                    self.content[index]["text"] += text
                    delta = {"type": "text_delta", "text": text}
                else:
                    self.content[index]["thinking"] += text
                    delta = {"type": "thinking_delta", "thinking": text}
                out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            elif step == CLOSED:
                out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
            elif block.kind == CALL_BLOCK:
                started = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
                out.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": started}))
                out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": block.arguments}}))
                # the parsers' arguments: a JSON object
                self.content.append({**started, "input": json.loads(block.arguments)})
            else:
                started = ({"type": "text", "text": ""} if block.kind == TEXT_BLOCK
                           else {"type": "thinking", "thinking": "", "signature": ""})
                self.content.append(dict(started))
                out.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": started}))
        return out


def stop_reason(finish_reason: str, text: str, stop: list[str], called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for an answer."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    matched = [s for s in stop if s and text.endswith(s)] if finish_reason == "stop" else []
    if matched:
        return "stop_sequence", max(matched, key=len)
    return "end_turn", None


def usage(used: Usage) -> dict[str, int]:
    """Anthropic's usage: the prompt split into what this turn computed (``input_tokens``) and what it did not
    (``cache_read_input_tokens``: pulled from the decode worker or found in P's prefix cache)."""
    return {"input_tokens": used.prompt - used.cached, "output_tokens": used.completion,
            "cache_read_input_tokens": used.cached, "cache_creation_input_tokens": 0}
