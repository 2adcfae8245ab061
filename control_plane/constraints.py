"""Structured output: the guided-decoding constraint a request asks for, as vLLM's engine takes it.

The constraint is one of vLLM's (``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice``,
``structural_tag``). Two cases are built here rather than passed through:

- **Forced tool calls** (``tool_choice`` ``required`` or a named function): a structural tag (xgrammar's format, which
  vLLM's engine takes) that makes the model write its calls in its *own* syntax, the one its chat template renders
  (hermes: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, calls joined by a newline), with the
  arguments held to the tool's parameter schema. An answer in the model's own syntax re-renders to the same text
  when the client echoes it back, so the next turn still continues the exact token ids (vLLM's own required mode
  has the model write a JSON array instead, which the template then renders differently).
- **A reasoning model** (a reasoning parser is set): the model may think first, so the constraint allows a reasoning
  block before the answer (``<think>``, any text, ``</think>``, a blank line), as vLLM's reasoning-aware structured
  output lets it.

Pure data: the gateway sends the result; the engine compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Constraint:
    """One of vLLM's structured-output constraints: ``kind`` names the SamplingParams field, ``value`` its value (a
    string for the schema, regex, grammar and structural-tag kinds, True for json_object, a list for choice)."""

    kind: str
    value: Any


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes one tool call: ``begin`` + the function's name + ``middle`` + the arguments object + ``end``;
    several calls are joined by ``separator``."""

    begin: str
    middle: str
    end: str
    separator: str


# Tool-call parsers whose syntax can be forced (the others refuse tool_choice required/named).
CALL_SYNTAX: dict[str, CallSyntax] = {
    "hermes": CallSyntax('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n"),
}


def _parameters(tool: dict[str, Any]) -> dict[str, Any] | bool:
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object"}


def _after_reasoning(fmt: dict[str, Any], think: tuple[str, str] | None) -> dict[str, Any]:
    """``fmt``, optionally after a reasoning block (``think``: the reasoning parser's start and end tags). Optional:
    a prompt that has closed the block already (thinking turned off) is answered directly."""
    if think is None:
        return fmt
    start, end = think
    return {"type": "or", "elements": [
        {"type": "sequence", "elements": [
            {"type": "tag", "begin": start, "content": {"type": "any_text"}, "end": end},
            {"type": "const_string", "value": "\n\n"}, fmt]},
        fmt]}


def _structural_tag(fmt: dict[str, Any]) -> Constraint:
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))


def forced_tool_calls(syntax: CallSyntax, tools: list[dict[str, Any]], named: str | None,
                      think: tuple[str, str] | None = None) -> Constraint:
    """``tool_choice`` ``required`` (``named`` None: one or more calls of any of ``tools``) or a named function (exactly
    one call of it)."""
    chosen = [t for t in tools if named is None or t["function"]["name"] == named]
    tags = [{"type": "tag", "begin": syntax.begin + t["function"]["name"] + syntax.middle,
             "content": {"type": "json_schema", "json_schema": _parameters(t)}, "end": syntax.end} for t in chosen]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": syntax.separator, "at_least_one": True,
           "stop_after_first": named is not None}
    return _structural_tag(_after_reasoning(fmt, think))


def json_answer(schema: dict[str, Any] | None, think: tuple[str, str] | None = None) -> Constraint:
    """``response_format`` json_schema (``schema``) or json_object (``schema`` None: any JSON object)."""
    if think is None:
        return Constraint("json_object", True) if schema is None else Constraint("json_schema", json.dumps(schema))
    return _structural_tag(_after_reasoning({"type": "json_schema", "json_schema": schema or {"type": "object"}},
                                            think))
