"""Forced-call syntaxes (base.ForcedCalls) that the families are built from: structural-tag formats in xgrammar's
terms, which vLLM's engine takes (``structured_outputs.structural_tag``); constraints.py wraps them into a
constraint.

JSON arguments are xgrammar's ``json_schema`` format. XML arguments (qwen3_coder, glm45, glm47) are written out here
as the family's template renders them (XmlArguments): xgrammar's own XML styles allow a whitespace character around
every value, even an enum's, which the parser keeps and the template does not render back, so an echoed call would no
longer be what the model wrote."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvshuttle.control_plane.tool_calls.schema import function_of, parameters_schema

# The most whitespace characters in a row that the arguments may hold (xgrammar's ``max_whitespace_cnt``; 0 is not
# allowed): every template writes at most one between the tags or JSON tokens (a newline or a space), and without a
# bound a model not trained on the syntax can write whitespace up to max_tokens (seen with qwen_xml and glm_xml). It
# does not bound the text of a string value (qwen_xml / glm_xml raw text, JSON strings).
MAX_WHITESPACE = 1


def _name(tool: dict[str, Any]) -> str:
    return (function_of(tool) or {}).get("name", "")


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _regex(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


# Number texts that read back (schema.typed: float, an int when whole) and render (``| string`` or ``tojson``) as the
# very same text: no sign on zero, no exponent, no trailing zero, at most 15 significant digits (each one a double
# holds), nothing below 1e-4 (Python writes that with an exponent).
_INTEGER = r"0|-?[1-9][0-9]{0,14}"
_NUMBER = _INTEGER + r"|-?[1-9][0-9]{0,5}\.[0-9]{0,8}[1-9]|-?0\.0{0,3}[1-9]([0-9]{0,7}[1-9])?"
# Schema keywords that only describe a value; any other keyword on a value (a pattern, a range, a length, a union...)
# is a constraint XmlArguments cannot write out, and the tool's arguments fall back to xgrammar's own XML style.
_DESCRIPTIVE = {"type", "enum", "const", "description", "title", "default", "examples", "deprecated"}
_SCALARS = {"boolean", "integer", "number", "null", "string"}


@dataclass(frozen=True)
class XmlArguments:
    """XML arguments exactly as a family's template writes them: ``lead``, then per parameter ``key_open`` + KEY +
    ``key_close`` + VALUE + ``value_close``, in the schema's property order (the required ones always, the others
    optional; no other keys). VALUE is written as the template renders it: a string as raw text (without
    ``excludes``, where the parser would cut it), a scalar that is not a string as ``| string`` does
    (``scalars="python"``: ``True``, ``None``) or as ``tojson`` does (``"json"``), an enum or const as one of its values
    so rendered. xgrammar's ``style`` is the fallback for a schema that says more than that (nested objects, arrays,
    unions, patterns, ranges): it holds the arguments to the schema but allows one whitespace character around a
    value, which would not re-render."""

    style: str  # xgrammar's json_schema style: the fallback
    lead: str
    key_open: str
    key_close: str
    value_close: str
    excludes: tuple[str, ...]
    scalars: Literal["python", "json"]

    def format(self, schema: dict[str, Any] | bool) -> dict[str, Any] | None:
        """The arguments' format; None when the schema asks for more than this layout writes (use ``style``)."""
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            return None
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        if not isinstance(properties, dict) or not isinstance(required, list) or set(required) - set(properties):
            return None
        if set(schema) - {"type", "properties", "required", "additionalProperties", "description", "title",
                          "$schema"}:
            return None
        elements = [_const(self.lead)] if self.lead else []
        for key, sub in properties.items():
            value = self._value(sub)
            if value is None or not isinstance(key, str) or not key or any(x in key for x in ("<", ">", "\n")):
                return None
            tag = {"type": "tag", "begin": self.key_open + key + self.key_close, "content": value,
                   "end": self.value_close}
            elements.append(tag if key in required else {"type": "optional", "content": tag})
        if not elements:
            return _const("")
        return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}

    def _value(self, schema: Any) -> dict[str, Any] | None:
        if schema is True or schema == {}:
            schema = {"type": "string"}
        if not isinstance(schema, dict) or set(schema) - _DESCRIPTIVE:
            return None
        choices = [schema["const"]] if "const" in schema else schema.get("enum")
        if choices is not None:
            if not isinstance(choices, list) or not choices:
                return None
            texts = list(dict.fromkeys(map(self._render, choices)))
            if any(not t or any(x in t for x in self.excludes) for t in texts):
                return None
            return _const(texts[0]) if len(texts) == 1 else {"type": "or", "elements": [_const(t) for t in texts]}
        kind = schema.get("type", "string")
        if kind not in _SCALARS:
            return None
        if kind == "string":
            return {"type": "any_text", "excludes": list(self.excludes)}
        if kind == "integer":
            return _regex(_INTEGER)
        if kind == "number":
            return _regex(_NUMBER)
        if kind == "boolean":
            return {"type": "or", "elements": [_const(self._render(True)), _const(self._render(False))]}
        return _const(self._render(None)) if self.scalars == "json" else None  # null: ``None`` does not read back

    def _render(self, value: Any) -> str:
        """A value as the template writes it."""
        if isinstance(value, str):
            return value
        if isinstance(value, (dict, list)) or self.scalars == "json":
            return json.dumps(value, ensure_ascii=False)
        return str(value)


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes one tool call: ``begin`` + the function's name + ``middle`` + the arguments + ``end``;
    several calls are joined by ``separator``, all of them between ``opening`` and ``closing``.

    ``style``: how the arguments are written, as xgrammar's ``json_schema`` format names it: ``json`` (a JSON object),
    or an XmlArguments layout, which writes the template's own text (its xgrammar style is the fallback); either way
    held to the tool's parameter schema, with at most ``MAX_WHITESPACE`` whitespace characters in a row where xgrammar
    writes the arguments. Where a template writes one whitespace character at the edge of the arguments (a newline
    before the first ``<parameter=``), it belongs to the arguments (XmlArguments.lead) rather than to ``middle``: fixed
    there, xgrammar's style could add one more."""

    begin: str
    middle: str
    end: str
    separator: str
    style: str | XmlArguments = "json"
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
        schema = parameters_schema(tool)
        style = self.style
        if isinstance(style, XmlArguments):
            exact = style.format(schema)
            if exact is not None:
                return exact
            style = style.style
        content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
        return content if style == "json" else {**content, "style": style}


@dataclass(frozen=True)
class EitherSyntax:
    """Calls written in any one of ``syntaxes`` (a family whose parser reads several forms; the model writes the one
    it was trained on). No family uses it today: a form the template does not render back makes the echoed answer
    differ from what the model wrote (see mistral.py)."""

    syntaxes: tuple[CallSyntax, ...]

    def format(self, tools: list[dict[str, Any]], named: str | None, *, one_call: bool = False) -> dict[str, Any]:
        return {"type": "or", "elements": [s.format(tools, named, one_call=one_call) for s in self.syntaxes]}
