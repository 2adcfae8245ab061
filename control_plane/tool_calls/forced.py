"""Forced-call syntaxes (base.ForcedCalls) that the families are built from: structural-tag formats in xgrammar's
terms, which vLLM's engine takes (``structured_outputs.structural_tag``); constraints.py wraps them into a
constraint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshuttle.control_plane.tool_calls.schema import function_of, parameters_schema

# The most whitespace characters in a row that the arguments may hold (xgrammar's ``max_whitespace_cnt``; 0 is not
# allowed): every template writes at most one between the tags or JSON tokens (a newline or a space), and without a
# bound a model not trained on the syntax can write whitespace up to max_tokens (seen with qwen_xml and glm_xml). It
# does not bound the text of a string value (qwen_xml / glm_xml raw text, JSON strings).
MAX_WHITESPACE = 1


def _name(tool: dict[str, Any]) -> str:
    return (function_of(tool) or {}).get("name", "")


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes one tool call: ``begin`` + the function's name + ``middle`` + the arguments + ``end``;
    several calls are joined by ``separator``, all of them between ``opening`` and ``closing``.

    ``style``: how the arguments are written, as xgrammar's ``json_schema`` format names it: ``json`` (a JSON object),
    ``qwen_xml`` (``<parameter=KEY>VALUE</parameter>``...), ``glm_xml`` (``<arg_key>KEY</arg_key><arg_value>VALUE
    </arg_value>``...); either way held to the tool's parameter schema, with at most ``MAX_WHITESPACE`` whitespace
    characters in a row. Where a template writes one whitespace character at the edge of the arguments (a newline
    before the first ``<parameter=``), the syntax leaves it to the arguments' whitespace rather than to ``middle``:
    fixed there, the arguments could add one more."""

    begin: str
    middle: str
    end: str
    separator: str
    style: str = "json"
    opening: str = ""
    closing: str = ""

    def format(self, tools: list[dict[str, Any]], named: str | None, *, one_call: bool = False) -> dict[str, Any]:
        chosen = [t for t in tools if named is None or _name(t) == named]
        tags = [{"type": "tag", "begin": self.begin + _name(t) + self.middle, "content": self._arguments(t),
                 "end": self.end} for t in chosen]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
                 "stop_after_first": named is not None or one_call}
        if not self.opening and not self.closing:
            return calls
        return {"type": "sequence", "elements": [
            *([{"type": "const_string", "value": self.opening}] if self.opening else []), calls,
            *([{"type": "const_string", "value": self.closing}] if self.closing else [])]}

    def _arguments(self, tool: dict[str, Any]) -> dict[str, Any]:
        content = {"type": "json_schema", "json_schema": parameters_schema(tool), "max_whitespace_cnt": MAX_WHITESPACE}
        return content if self.style == "json" else {**content, "style": self.style}


@dataclass(frozen=True)
class EitherSyntax:
    """Calls written in any one of ``syntaxes`` (a family whose parser reads several forms; the model writes the one
    it was trained on). No family uses it today: a form the template does not render back makes the echoed answer
    differ from what the model wrote (see mistral.py)."""

    syntaxes: tuple[CallSyntax, ...]

    def format(self, tools: list[dict[str, Any]], named: str | None, *, one_call: bool = False) -> dict[str, Any]:
        return {"type": "or", "elements": [s.format(tools, named, one_call=one_call) for s in self.syntaxes]}
