"""``glm45`` (GLM-4.5/4.6) and ``glm47`` (GLM-4.7, GLM-5), one parser: ``<tool_call>NAME<arg_key>K</arg_key>
<arg_value>V</arg_value>...</tool_call>`` (newlines between the tags or not); values typed by schema; with tools given, a name that is not one of
them is no call (vLLM's rule).

Forced calls, one syntax per template (the parser reads both), each argument as the template writes it, in the
schema's order, a value that is not a string with ``tojson`` (forced.XmlArguments):

- ``glm45`` (GLM-4.5/4.6's template): every call as ``\\n<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V
  </arg_value>\\n</tool_call>``, a newline before each call (the first one too) and none between calls;
- ``glm47`` (GLM-4.7's, GLM-5's): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``, nothing
  between calls.

A schema with nested objects, arrays, unions or constraints on a value (a pattern, a range) falls back to xgrammar's
``glm_xml`` style, held to the schema but with a whitespace character allowed around each value, which the template
would not render back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from kvshuttle.control_plane.tool_calls.base import Family, Item, Tools
from kvshuttle.control_plane.tool_calls.calls import Calls
from kvshuttle.control_plane.tool_calls.forced import CallSyntax, XmlArguments
from kvshuttle.control_plane.tool_calls.schema import tool_names, typed

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(Calls):
    """``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``."""

    start, end, first_arg = "<tool_call>", "</tool_call>", "<arg_key>"

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self._in_call = False
        self._names = tool_names(self.tools)

    def _run(self, *, final: bool) -> Iterator[Item]:
        while True:
            if not self._in_call:
                if not (yield from self._scan((self.start,), final=final)):
                    return
                self._in_call = True
            got = self._take((self.end,), final=final)
            if got is None:
                return
            self._in_call = False
            call = self._parse(got[0], closed=bool(got[1]))
            yield from self._found([call]) if call else self._unparsed(self.start + got[0] + got[1])

    def _parse(self, body: str, *, closed: bool) -> tuple[str, str] | None:
        at = body.find(self.first_arg)
        name, args = (body, "") if at < 0 else (body[:at], body[at:])
        name = name.strip()
        if not name or (self._names and name not in self._names):
            return None
        if not closed and (at < 0 or _GLM_ARG.sub("", args).strip()):
            return None  # cut off before its arguments, or inside one
        params = {m[1].strip(): m[2] for m in _GLM_ARG.finditer(args)}
        return name, typed(json.dumps(params, ensure_ascii=False), name, self.tools)


_EXCLUDES = ("</arg_value>", "</tool_call>")
FORCED = CallSyntax("\n<tool_call>", "", "</tool_call>", "", style=XmlArguments(  # GLM-4.5
    "glm_xml", lead="\n", key_open="<arg_key>", key_close="</arg_key>\n<arg_value>", value_close="</arg_value>\n",
    excludes=_EXCLUDES, scalars="json"))
FORCED_47 = CallSyntax("<tool_call>", "", "</tool_call>", "", style=XmlArguments(  # GLM-4.7
    "glm_xml", lead="", key_open="<arg_key>", key_close="</arg_key><arg_value>", value_close="</arg_value>",
    excludes=_EXCLUDES, scalars="json"))
FAMILY = Family(("glm45",), Glm45Parser, FORCED)
GLM47 = Family(("glm47",), Glm45Parser, FORCED_47)
