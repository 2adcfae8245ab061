"""Structured output: the guided-decoding constraint a request asks for, as vLLM's engine takes it.

The constraint is one of vLLM's (``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice``,
``structural_tag``). Two cases are built here rather than passed through:

- **Forced tool calls** (``tool_choice`` ``required`` or a named function): a structural tag (xgrammar's format, which
  vLLM's engine takes) that makes the model write its calls in its *own* syntax, the one its chat template renders
  (hermes: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, calls joined by a newline), with the
  arguments held to the tool's parameter schema. Each tool-call family knows its syntax (control_plane/tool_calls/,
  ``CALL_SYNTAX``); one whose syntax cannot be forced says why (``not_forced``). An answer in the model's own syntax
  re-renders to the same text when the client echoes it back, so the next turn still continues the exact token ids
  (vLLM's own required mode has the model write a JSON array instead, which the template then renders differently).
- **A reasoning model** (a reasoning parser is set): :func:`after_reasoning` places the constraint after the reasoning
  the rendered prompt leaves room for (none when the prompt closed the reasoning block, as vLLM does).

Pure data: the gateway sends the result; the engine compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvshuttle.control_plane.tool_calls import FORCED_CALLS, ForcedCalls, not_forced

__all__ = ["CALL_SYNTAX", "Constraint", "after_reasoning", "forced_tool_calls", "json_answer", "not_forced"]


@dataclass(frozen=True)
class Constraint:
    """One of vLLM's structured-output constraints: ``kind`` names the SamplingParams field, ``value`` its value (a
    string for the schema, regex, grammar and structural-tag kinds, True for json_object, a list for choice)."""

    kind: str
    value: Any


# The tool-call parsers whose calls can be forced, by name: each family's own syntax (tool_calls.FORCED_CALLS). A
# parser missing here refuses tool_choice required/named; tool_calls.not_forced(parser) says why.
CALL_SYNTAX: dict[str, ForcedCalls] = FORCED_CALLS


def _structural_tag(fmt: dict[str, Any]) -> Constraint:
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False))


def forced_tool_calls(syntax: ForcedCalls, tools: list[dict[str, Any]], named: str | None, *,
                      one_call: bool = False) -> Constraint:
    """``tool_choice`` ``required`` (``named`` None: one or more calls of any of ``tools``; exactly one with
    ``one_call``, which a request with ``parallel_tool_calls`` false asks for) or a named function (exactly one call of
    it), in the family's syntax (``CALL_SYNTAX[parser]``). Without ``one_call`` the number of calls is not bounded: a
    model that goes on writing calls stops at max_tokens, the last one cut off."""
    return _structural_tag(syntax.format(tools, named, one_call=one_call))


def json_answer(schema: dict[str, Any] | None) -> Constraint:
    """``response_format`` json_schema (``schema``) or json_object (``schema`` None: any JSON object)."""
    return Constraint("json_object", True) if schema is None else Constraint("json_schema", json.dumps(schema))


def _format(constraint: Constraint) -> dict[str, Any] | None:
    """The constraint as a structural-tag format (None for kinds that are not built here)."""
    if constraint.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(constraint.value)}
    if constraint.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if constraint.kind == "structural_tag":
        return json.loads(constraint.value)["format"]
    return None


def after_reasoning(constraint: Constraint, think: tuple[str, str], prompt_text: str) -> Constraint:
    """``constraint`` placed after the reasoning the prompt leaves room for (``think``: the reasoning parser's start and
    end tags):

    - the prompt ends with a closed reasoning block (thinking turned off): the constraint as it is, from the first
      token, as vLLM applies it;
    - the prompt opened a reasoning block: the model finishes it first (any text, the end tag, a blank line);
    - otherwise: an optional reasoning block first (vLLM would apply the constraint at once, so a reasoning model could
      not think before a forced call or a JSON answer).

    Constraints of other kinds (a client's own regex, grammar, choice) are left as given."""
    fmt = _format(constraint)
    start, end = think
    if fmt is None or prompt_text.rstrip().endswith(end):
        return constraint
    reasoning_then = [{"type": "const_string", "value": "\n\n"}, fmt]
    if prompt_text.rfind(start) > prompt_text.rfind(end):  # inside a reasoning block the prompt opened
        return _structural_tag({"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end}, *reasoning_then]})
    return _structural_tag({"type": "or", "elements": [
        {"type": "sequence", "elements": [
            {"type": "tag", "begin": start, "content": {"type": "any_text"}, "end": end}, *reasoning_then]},
        fmt]})
