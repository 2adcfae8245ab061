"""The answer as the Responses API spells it: output items (reasoning, message, function calls) and, streaming, the
events that build them (OutputBuilder); the response object around them, and a finished turn's status and usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

from kvshuttle.control_plane.answer import Event
from kvshuttle.control_plane.answer_blocks import (
    APPENDED,
    CALL_BLOCK,
    OPENED,
    REASONING_BLOCK,
    TEXT_BLOCK,
    AnswerBlocks,
    Block,
    Step,
)
from kvshuttle.services.gateway.apis.responses.models import ResponsesIn
from kvshuttle.services.gateway.turns import Finished, TurnContext
from kvshuttle.services.gateway.turns.reply import Usage


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputBuilder:
    """The answer's blocks (control_plane.answer_blocks, the rules every API shares) as output items, and
    (streaming) as the Responses API's events."""

    def __init__(self, parallel_tool_calls: bool = True):
        self.blocks = AnswerBlocks(parallel_tool_calls=parallel_tool_calls, new_call_id=_call_id)
        self.items: list[dict[str, Any]] = []
        self._sequence = 0

    def event(self, kind: str, **body: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **body}

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def feed(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The stream events for the answer events of the next piece of text (the turn's parse stage)."""
        return self._spell(self.blocks.feed(events))

    def finish(self, events: Iterable[Event] = ()) -> list[dict[str, Any]]:
        """The stream events for what the parser held back (``events``), once the answer has ended."""
        return self._spell(self.blocks.finish(events))

    def _spell(self, steps: list[Step]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for step, block, text in steps:
            index = block.position
            if step == APPENDED:
                item = self.items[index]
                item["content"][0]["text"] += text
                if block.kind == TEXT_BLOCK:
                    out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                           content_index=0, delta=text, logprobs=[]))
                else:
                    out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                           content_index=0, delta=text))
            elif step == OPENED:
                out += self._opened(block)
            elif block.kind != CALL_BLOCK:
                out += self._closed(index)
        return out

    def _opened(self, block: Block) -> list[dict[str, Any]]:
        index = block.position
        if block.kind == CALL_BLOCK:
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": block.call_id, "name": block.name,
                    "arguments": block.arguments, "status": "completed"}
            self.items.append(item)
            return [self.event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=block.arguments),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=block.name, arguments=block.arguments),
                    self.event("response.output_item.done", output_index=index, item=item)]
        if block.kind == REASONING_BLOCK:
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self.items.append(item)
            return [self.event("response.output_item.added", output_index=index, item={**item, "content": []})]
        item = {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "content": []}),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def _closed(self, index: int) -> list[dict[str, Any]]:
        item = self.items[index]
        part = item["content"][0]
        if item["type"] == "reasoning":
            return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self.event("response.output_item.done", output_index=index, item=item)]


def response_object(body: ResponsesIn, turn: TurnContext, model: str) -> dict[str, Any]:
    """The response object before its output (what response.created carries)."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}
    choice = body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None else \
        body.tool_choice.model_dump()
    return {"id": f"resp_{turn.id.removeprefix('kvs-')}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "previous_response_id": body.previous_response_id,
            "instructions": body.instructions, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": choice or "auto", "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": turn.request.max_tokens,
            "store": body.store, "text": {"format": fmt}, "reasoning": {"effort": None, "summary": None},
            "metadata": body.metadata or {}, "user": body.user, "truncation": "disabled", "error": None,
            "incomplete_details": None, "usage": None}


def outcome(event: Finished, used: Usage) -> dict[str, Any]:
    """Status and usage of a finished turn (reasoning tokens: the reasoning text re-tokenized, an estimate)."""
    cut = event.finish_reason == "length"
    return {"status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": used.prompt, "input_tokens_details": {"cached_tokens": used.cached},
                      "output_tokens": used.completion,
                      "output_tokens_details": {"reasoning_tokens": used.reasoning}, "total_tokens": used.total}}
