"""``deepseek_v3`` (DeepSeek-V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; arguments are the text in the fence as written (which must be a
JSON object here; vLLM passes on any text, and takes only one-line arguments). Unlike most families it keeps the
whitespace before the calls in the content, as vLLM's parser does.

Forced calls: the block as the template renders it, calls joined by a newline inside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvshuttle.control_plane.tool_calls.base import Family, Item, Tools
from kvshuttle.control_plane.tool_calls.calls import Calls
from kvshuttle.control_plane.tool_calls.forced import CallSyntax


class DeepSeekV3Parser(Calls):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
    ...<｜tool▁calls▁end｜>``."""

    calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    fence, fence_end = "\n```json\n", "\n```"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | block (between calls) | call
        self._raw = ""  # the block's text since its start or its last call: content if no call follows

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if self._state == "content":
                if not (yield from self._scan((self.calls_begin,), final=final)):
                    return
                self._raw, self._state = self.calls_begin, "block"
                continue
            if self._state == "block":
                got = self._take((self.call_begin, self.calls_end), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                if got[1] == self.call_begin:
                    self._state = "call"
                    continue
                yield from self._unparsed("" if self._called else self._raw)  # a block without calls
                self._raw, self._state = "", "content"
                continue
            got = self._take((self.call_end,), final=final)
            if got is None:
                return
            self._raw += got[0] + got[1]
            call = self._parse(got[0]) if got[1] else None
            yield from self._found([call], keep_ws=True) if call else self._unparsed(self._raw)
            self._raw, self._state = "", "block"

    def _parse(self, body: str) -> tuple[str, str] | None:
        kind, sep, rest = body.partition(self.sep)
        name, fence, args = rest.partition(self.fence)
        if kind != "function" or not sep or not fence or not name or "\n" in name or not args.endswith(self.fence_end):
            return None
        args = args[:-len(self.fence_end)]
        try:
            value = json.loads(args)
        except ValueError:
            return None
        return (name, args) if isinstance(value, dict) else None


FORCED = CallSyntax(DeepSeekV3Parser.call_begin + "function" + DeepSeekV3Parser.sep, DeepSeekV3Parser.fence,
                    DeepSeekV3Parser.fence_end + DeepSeekV3Parser.call_end, "\n",
                    opening=DeepSeekV3Parser.calls_begin, closing=DeepSeekV3Parser.calls_end)
FAMILY = Family(("deepseek_v3",), DeepSeekV3Parser, FORCED)
