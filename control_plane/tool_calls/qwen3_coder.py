"""``qwen3_coder`` (Qwen3-Coder; also ``qwen3_xml``): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
\\n</parameter>\\n...</function>\\n</tool_call>``, several functions in a block or ``<function=`` without the block
allowed. A value loses one leading and one trailing newline and is typed by the tool's schema; a parameter left
unclosed before ``</function>`` is dropped, as vLLM does.

Forced calls: one block per call as the template renders it (``<tool_call>\\n<function=NAME>\\n``, the parameters,
``</function>\\n</tool_call>``; calls joined by a newline), each parameter as ``<parameter=KEY>\\nVALUE\\n</parameter>
\\n`` in the schema's order, VALUE as the template writes it (a string as raw text, another scalar with ``| string``:
``True``, ``3``, ``1.5``; forced.XmlArguments). A schema with nested objects, arrays, unions, null, or constraints on a
value (a pattern, a range) falls back to xgrammar's ``qwen_xml`` style, held to the schema but with a whitespace
character allowed around each value, which the template would not render back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from kvshuttle.control_plane.tool_calls.base import Family, Item, Tools
from kvshuttle.control_plane.tool_calls.calls import Calls
from kvshuttle.control_plane.tool_calls.forced import CallSyntax, XmlArguments
from kvshuttle.control_plane.tool_calls.schema import typed

_PARAM_OPEN = r"<\s*parameter\s*=\s*"
# A parameter runs to its closing tag, or to the next parameter's opening one (the model left it unclosed).
_QWEN_PARAM = re.compile(rf"{_PARAM_OPEN}([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?={_PARAM_OPEN}))", re.DOTALL)


def _unwrap_newlines(value: str) -> str:
    """A Qwen3 value without the newline its template puts after the opening tag and before the closing one."""
    return value[value.startswith("\n"):len(value) - value.endswith("\n")] if value else value


class Qwen3CoderParser(Calls):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``."""

    block, block_end = "<tool_call>", "</tool_call>"
    function, function_end = "<function=", "</function>"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._state = "content"  # content | block (before <function=) | name | args
        self._raw = ""  # the current call's text so far: content if it does not parse
        self._name = ""

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if self._state == "content":
                tag = yield from self._scan((self.block, self.function), final=final)
                if not tag:
                    return
                self._raw, self._state = tag, "block" if tag == self.block else "name"
                continue
            if self._state == "block":
                got = self._take((self.block_end, self.function), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                if got[1] == self.function:
                    self._state = "name"
                    continue
                yield from self._unparsed(self._raw)  # a block without a function
            elif self._state == "name":
                got = self._take((">", self.function_end), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                if got[1] == ">":
                    self._name, self._state = got[0], "args"
                    continue
                yield from self._unparsed(self._raw)
            else:
                got = self._take((self.function_end,), final=final)
                if got is None:
                    return
                self._raw += got[0] + got[1]
                call = self._parse(self._name, got[0], closed=bool(got[1]))
                yield from self._found([call]) if call else self._unparsed(self._raw)
            self._raw, self._state = "", "content"

    def _parse(self, name: str, body: str, *, closed: bool) -> tuple[str, str] | None:
        name = name.strip()
        if not name:
            return None
        if not closed and _QWEN_PARAM.sub("", body).strip() not in ("", self.block_end):
            return None  # cut off inside a parameter
        params = {m[1]: _unwrap_newlines(m[2]) for m in _QWEN_PARAM.finditer(body)}
        return name, typed(json.dumps(params, ensure_ascii=False), name, self.tools)


ARGUMENTS = XmlArguments("qwen_xml", lead="\n", key_open="<parameter=", key_close=">\n", value_close="\n</parameter>\n",
                         excludes=("</parameter>", "<parameter=", "</function>"), scalars="python")
FORCED = CallSyntax("<tool_call>\n<function=", ">", "</function>\n</tool_call>", "\n", style=ARGUMENTS)
FAMILY = Family(("qwen3_coder", "qwen3_xml"), Qwen3CoderParser, FORCED)
