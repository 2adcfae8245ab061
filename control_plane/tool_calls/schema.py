"""The request's tools, and typing a call's argument values by the tool's JSON schema (as vLLM's engine parsers do:
``qwen3_coder``, ``glm45`` and mistral's ``[ARGS]`` form)."""

from __future__ import annotations

import json
import math
from typing import Any

from kvshuttle.control_plane.tool_calls.base import Tools

# -- the request's tools --------------------------------------------------------------------------------------------


def function_of(tool: Any) -> dict[str, Any] | None:
    """A tool's function definition (Chat Completions' ``{"type", "function": {...}}`` or the flat Responses form)."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else None


def tool_names(tools: Tools) -> set[str]:
    return {fn["name"] for fn in map(function_of, tools or []) if fn and isinstance(fn.get("name"), str)}


def tool_properties(tools: Tools, name: str) -> dict[str, Any]:
    """The JSON schema ``properties`` of the first tool named ``name``; {} when there is none."""
    for fn in map(function_of, tools or []):
        if fn and fn.get("name") == name:
            parameters = fn.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any] | bool:
    """A tool's parameter schema (``{"type": "object"}`` when it has none), for a forced call's arguments."""
    params = (function_of(tool) or {}).get("parameters")
    return params if params is not None else {"type": "object"}


# -- typing argument values by the tool's JSON schema (as vLLM's engine parsers do) ----------------------------------

_TYPE_NAMES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean", "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: ``type``, the types of its ``enum`` values, and those of its
    ``anyOf``/``oneOf``/``allOf`` branches; ``{"string"}`` when it says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    for t in [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []:
        if isinstance(t, str):
            types.add(t)
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        if value is None:
            types.add("null")
        for kind, name in _ENUM_TYPES:
            if isinstance(value, kind):
                types.add(name)
                break
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            types |= schema_types(branch)
    return types or {"string"}


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


_UNCHANGED = object()


def _typed_text(value: str, types: set[str]) -> Any:
    """A string value as the first of the schema's types it reads as (null, integer, number, boolean, object, array,
    string in that order); failing all, the JSON it is, or else the string. ``_UNCHANGED`` when it stays the very
    same string."""
    wanted = {_TYPE_NAMES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in wanted:
            continue
        if kind == "string":
            return _UNCHANGED
        if kind == "null":
            if value.lower() == "null":
                return None
        elif kind == "integer":
            try:
                return int(value)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        elif kind == "boolean":
            word = value.strip().lower()
            if word in ("true", "1", "false", "0"):
                return word in ("true", "1")
        else:
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return _UNCHANGED
    return parsed if _finite(parsed) else _UNCHANGED


def _typed_value(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` typed by its schema; ``_UNCHANGED`` when it stays as it is (objects and arrays are typed in place)."""
    if isinstance(value, str):
        return _typed_text(value, schema_types(schema))
    if isinstance(value, dict):
        properties = schema.get("properties")
        changed = isinstance(properties, dict) and _typed_object(value, properties)
        return value if changed else _UNCHANGED
    if isinstance(value, list):
        items, changed = schema.get("items"), False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                typed = _typed_value(item, items)
                if typed is not _UNCHANGED:
                    value[i], changed = typed, True
        return value if changed else _UNCHANGED
    typed = _typed_text(json.dumps(value, ensure_ascii=False), schema_types(schema))
    if typed is _UNCHANGED:
        typed = json.dumps(value, ensure_ascii=False)
    return _UNCHANGED if type(typed) is type(value) and typed == value else typed


def _typed_object(args: dict[str, Any], properties: dict[str, Any]) -> bool:
    changed = False
    for key, value in args.items():
        schema = properties.get(key)
        if isinstance(schema, dict):
            typed = _typed_value(value, schema)
            if typed is not _UNCHANGED:
                args[key], changed = typed, True
    return changed


def typed(arguments: str, name: str, tools: Tools) -> str:
    """A call's arguments (a JSON object's text) with each value typed by the named tool's schema, as vLLM's engine
    parsers type them; the text as it was when nothing changes (no tools, no schema, nothing to convert)."""
    properties = tool_properties(tools, name)
    if not properties:
        return arguments
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(args, dict) or not _typed_object(args, properties):
        return arguments
    return json.dumps(args, ensure_ascii=False)
