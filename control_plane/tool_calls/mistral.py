"""``mistral``: ``[TOOL_CALLS]`` followed by either a JSON array (or one object) of ``{"name", "arguments"}``
(tokenizers before v11) or ``NAME[ARGS]{...}`` (``NAME{...}`` accepted too; v11 and later, a marker before each
call). vLLM picks the form by the model's tokenizer; here the text after the marker does (``[`` or ``{``: the array).
The array's arguments are re-serialised (kept when a string); an array with an entry that is not a call is content
(vLLM skips the entry), and every marker's array counts (vLLM reads the first). The v11 form's arguments are the JSON
object's text as written, typed by schema.

Forced calls: the v11 form only, ``[TOOL_CALLS]NAME[ARGS]{...}`` for each call, as the v11+ templates (Magistral,
Devstral, Ministral 3) render an echoed call. The older array form is parsed but not forced: no v11+ template renders
it back, the pre-v11 templates render ``[TOOL_CALLS] [`` with a space and an ``"id"`` in each call (so even a model
trained on it would not see its answer re-rendered as written), and allowing both lets a model take the array, which
bounds nothing (a model looped in it up to max_tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvshuttle.control_plane.tool_calls.base import Family, Item, Tools
from kvshuttle.control_plane.tool_calls.calls import Calls
from kvshuttle.control_plane.tool_calls.forced import CallSyntax
from kvshuttle.control_plane.tool_calls.scan import JsonEnd
from kvshuttle.control_plane.tool_calls.schema import typed


class MistralParser(Calls):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``."""

    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | start (after the marker) | array | name | args_start | args
        self._raw = ""
        self._name = ""
        self._json = JsonEnd()

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            state = self._state
            if state == "content":
                if not (yield from self._scan((self.marker,), final=final)):
                    return
                self._raw, self._state = self.marker, "start"
                continue
            if state in ("start", "args_start"):
                self._raw += self._skip_space()
                if not self._held and not final:
                    return
                if state == "start":
                    self._state = "array" if self._held[:1] in ("[", "{") else "name"
                elif self._held.startswith("{"):
                    self._state = "args"
                else:
                    yield from self._unparsed(self._raw)  # [ARGS] without a JSON object
                    self._raw, self._state = "", "content"
                    continue
                if self._state != "name":
                    self._json = JsonEnd()
                continue
            if state == "name":
                got = self._take((self.args_marker, "{"), final=final)
                if got is None:
                    return
                if got[1] == "{":
                    self._held = "{" + self._held
                    self._raw, self._name, self._state = self._raw + got[0], got[0], "args"
                    self._json = JsonEnd()
                    continue
                self._raw += got[0] + got[1]
                if got[1]:
                    self._name, self._state = got[0], "args_start"
                    continue
                yield from self._unparsed(self._raw)  # a name and no arguments: cut off
                self._raw, self._state = "", "content"
                continue
            end = self._json.end(self._held)
            if end < 0 and not final:
                return
            text = self._held if end < 0 else self._held[:end]
            self._held, self._raw = self._held[len(text):], self._raw + text
            if end < 0:
                calls = None
            elif state == "array":
                calls = self._parse_array(text)
            else:
                calls = self._parse_args(self._name, text)
            if calls:
                yield from self._found(calls, keep_ws=state == "array" and self._spoke)
            else:
                yield from self._unparsed(self._raw)
            self._raw, self._state = "", "content"

    @staticmethod
    def _parse_array(text: str) -> list[tuple[str, str]] | None:
        """The calls of the older form's JSON (an array of them, or one); None unless every entry is a call."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = []
        for entry in [value] if isinstance(value, dict) else value:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
                return None
            args = entry.get("arguments")
            calls.append((entry["name"], "{}" if args is None else args if isinstance(args, str)
                          else json.dumps(args, ensure_ascii=False)))
        return calls or None

    def _parse_args(self, name: str, text: str) -> list[tuple[str, str]] | None:
        name = name.strip()
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not name or not isinstance(value, dict):
            return None
        return [(name, typed(text, name, self.tools))]


FORCED = CallSyntax("[TOOL_CALLS]", "[ARGS]", "", "")  # v11 and later
FAMILY = Family(("mistral",), MistralParser, FORCED)
