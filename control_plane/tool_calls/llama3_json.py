"""``llama3_json`` (Llama 3.x; also ``llama4_json``): JSON objects ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), ``<|python_tag|>`` optional, several separated by ``;``. vLLM looks for them anywhere in the text and,
if it finds any, reports no content; here the text before the first one stays content (a stream cannot take back
what it sent). An object that is not a call is content; unlike vLLM, which then reports the whole answer as content,
the calls around it are still calls. A ``{`` not followed by a key (prose, code) is content at once.

Forced calls: ``{"name": "NAME", "parameters": {...}}`` as Llama 3's template renders a call, without the optional
``<|python_tag|>``; several joined by ``; ``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvshuttle.control_plane.tool_calls.base import Family, Item, Tools
from kvshuttle.control_plane.tool_calls.calls import Calls
from kvshuttle.control_plane.tool_calls.forced import CallSyntax
from kvshuttle.control_plane.tool_calls.scan import JsonEnd


class Llama3JsonParser(Calls):
    """``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``: any JSON object naming a function is a call."""

    python_tag = "<|python_tag|>"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | tag (after the python tag) | object
        self._raw = ""
        self._json = JsonEnd()

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if self._state == "content":
                tag = yield from self._scan((self.python_tag, "{"), final=final)
                if not tag:
                    return
                if tag == "{":
                    self._held, self._raw, self._state = "{" + self._held, "", "object"
                    self._json = JsonEnd()
                else:
                    self._raw, self._state = tag, "tag"
                continue
            if self._state == "tag":
                self._raw += self._skip_space()
                if not self._held and not final:
                    return
                if self._held.startswith("{"):
                    self._state, self._json = "object", JsonEnd()
                    continue
                yield from self._unparsed(self._raw)  # the tag, then no call: content
                self._raw, self._state = "", "content"
                continue
            if self._json.fresh:  # a call's object starts with a key: other braces (prose, code) are content at once
                key = self._held[1:].lstrip()[:1]
                if not key and not final:
                    return
                if key != '"':
                    self._held = self._held[1:]
                    yield from self._unparsed(self._raw + "{")
                    self._raw, self._state = "", "content"
                    continue
            end = self._json.end(self._held)
            if end < 0 and not final:
                return
            text = self._held if end < 0 else self._held[:end]
            self._held, self._raw = self._held[len(text):], self._raw + text
            call = self._parse(text) if end >= 0 else None
            yield from self._found([call]) if call else self._unparsed(self._raw)
            self._raw, self._state = "", "content"

    @staticmethod
    def _parse(text: str) -> tuple[str, str] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
        if key is None:
            return None
        return value["name"], json.dumps(value[key], ensure_ascii=False)


FORCED = CallSyntax('{"name": "', '", "parameters": ', "}", "; ")
FAMILY = Family(("llama3_json", "llama4_json"), Llama3JsonParser, FORCED)
