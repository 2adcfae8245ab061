"""``hermes`` (Hermes 2 Pro, Qwen 2.5 / Qwen3, the offline agent test model; also ``qwen3_json``, vLLM's alias):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them; arguments re-serialised as vLLM does.
Unlike the other families it keeps the whitespace before a call in the content, and a call tag that does not parse
still ends the content (the text after it is dropped).

Forced calls: as the chat template renders them (``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``,
calls joined by a newline), so an echoed call re-renders to the text the model wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from kvshuttle.control_plane.tool_calls.base import Family, Item, ParsedCall, Tools
from kvshuttle.control_plane.tool_calls.forced import CallSyntax
from kvshuttle.control_plane.tool_calls.scan import partial_tail


def _parse_hermes(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's body; None when it is not a call. Arguments are re-serialised as vLLM
    does (``json.dumps(..., ensure_ascii=False)``), so an echoed call renders back to the same text."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if arguments is None:
        arguments = {}
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class HermesParser:
    """``<tool_call>{json}</tool_call>``: the content is the text before the first call tag."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, tools: Tools = None):
        self.tools = list(tools or [])
        self._held = ""
        self._in_call = False
        self._called = False  # a call has started: later text outside calls is not content
        self.calls = 0

    def feed(self, text: str) -> Iterable[Item]:
        if not self._held and not self._in_call and "<" not in text:  # plain text: per streamed token, no generator
            return [] if self._called or not text else [text]
        return self._feed(text)

    def _feed(self, text: str) -> Iterator[Item]:
        self._held += text
        while self._held:
            if self._in_call:
                at = self._held.find(self.end)
                if at < 0:
                    return
                body, self._held = self._held[:at], self._held[at + len(self.end):]
                self._in_call = False
                yield from self._call(body, closed=True)
                continue
            at = self._held.find(self.start)
            if at >= 0:
                if at and not self._called:
                    yield self._held[:at]
                self._held = self._held[at + len(self.start):]
                self._in_call = self._called = True
                continue
            keep = partial_tail(self._held, self.start)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            if out and not self._called:
                yield out
            return

    def finish(self) -> Iterator[Item]:
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            yield from self._call(held, closed=False)
        elif held and not self._called:
            yield held

    def _call(self, body: str, *, closed: bool) -> Iterator[Item]:
        parsed = _parse_hermes(body.strip())
        if parsed is None:
            yield self.start + body + (self.end if closed else "")
            return
        yield ParsedCall(self.calls, *parsed)
        self.calls += 1


FORCED = CallSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n")
FAMILY = Family(("hermes", "qwen3_json"), HermesParser, FORCED)
