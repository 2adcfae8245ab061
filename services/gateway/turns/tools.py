"""Tools, whatever the API: the function definition every front end gives the builder (FunctionIn), the checks of
tools and ``tool_choice`` (``check_tools``) and of the tool results in a history (``check_tool_results``), and the
tools as the chat template gets them (``ToolUse``).

Checked strictly: a tool whose parameters are not a JSON Schema object, a ``tool_choice`` naming no tool, or a tool
result whose id answers no earlier call are 400s naming the API's field (FieldError).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from kvshuttle.control_plane.constraints import Constraint
from kvshuttle.control_plane.lru import BoundedLru
from kvshuttle.services.gateway.turns.errors import FieldError
from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionIn(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def template_dict(self) -> dict[str, Any]:
        """As vLLM dumps it for the template (``strict`` only when set), so the prompt is vLLM's."""
        out: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict is not None:
            out["strict"] = self.strict
        return out


# Schemas found valid, by (tenant, canonical JSON): agents send the same tools (and answer formats) every turn, and
# checking one against the metaschema takes milliseconds. Per tenant, so a tenant's timing never tells whether
# another sent the same schema.
_VALID_SCHEMAS: BoundedLru[bool] = BoundedLru(8 << 20)


def check_schema(schema: Any, param: str, what: str, *, tenant: str = "") -> None:
    """``schema`` is a valid JSON Schema (draft 2020-12); FieldError naming ``param`` otherwise."""
    try:
        key: tuple[str, str] | None = (tenant, json.dumps(schema, sort_keys=True, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError):
        key = None
    if key is not None and _VALID_SCHEMAS.get(key):
        return
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top)"
        raise FieldError(param, f"{what} are not a valid JSON Schema at {where}: {exc.message}") from None
    except RecursionError:  # input_check refuses deep schemas first; this is the backstop
        raise FieldError(param, f"{what} nest too deeply") from None
    if key is not None:
        _VALID_SCHEMAS.put(key, True, len(key[0]) + len(key[1]) + 100)


@dataclass(frozen=True)
class NamedTool:
    """A ``tool_choice`` that names the one tool to call."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool | None


@dataclass(frozen=True)
class ToolWords:
    """How an API spells what the tool checks name: each tool's fields, and its ``tool_choice`` values."""

    field: Callable[[int, str], str]  # (tool index, "name" | "parameters") -> the request's field
    required: str = "'required'"  # the choice that forces some call
    forced: str = "'required' or a named function"  # the choices that force a call
    none: str = "tool_choice 'none'"  # the choice that asks for no call
    named: str | None = None  # the named choice, when a named choice without tools has a message of its own


OPENAI_TOOLS = ToolWords(lambda i, name: f"tools.{i}.function.{name}")
RESPONSES_TOOLS = ToolWords(lambda i, name: f"tools.{i}.{name}")
ANTHROPIC_TOOLS = ToolWords(lambda i, name: f"tools.{i}.{'input_schema' if name == 'parameters' else name}",
                            required="'any'", forced="'any' or 'tool'", none='tool_choice {"type": "none"}',
                            named="'tool'")


def check_tools(tools: Sequence[FunctionIn], choice: ToolChoice, words: ToolWords = OPENAI_TOOLS, *,
                tenant: str = "") -> None:
    """Tool definitions and ``tool_choice`` that the gateway can use; FieldError (naming the API's field)
    otherwise. ``tenant``: whose request (the schema checks it already passed are remembered per tenant)."""
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    names: set[str] = set()
    for i, fn in enumerate(tools):
        if fn.name in names:
            raise FieldError(words.field(i, "name"), f"two tools are named {fn.name!r}")
        names.add(fn.name)
        if fn.parameters is None:
            continue
        if fn.parameters.get("type", "object") != "object":
            raise FieldError(words.field(i, "parameters"),
                             f"tool {fn.name!r}: parameters must be a JSON Schema of type 'object', "
                             f"got type {fn.parameters.get('type')!r}")
        check_schema(fn.parameters, words.field(i, "parameters"), f"tool {fn.name!r}: parameters", tenant=tenant)
    if not tools and (choice == "required" or (isinstance(choice, NamedTool) and words.named)):
        raise FieldError("tool_choice", f"tool_choice {words.required if choice == 'required' else words.named} "
                                        "needs tools")
    if isinstance(choice, NamedTool) and choice.name not in names:
        raise FieldError("tool_choice", f"tool_choice names {choice.name!r}, which is not among the tools "
                                        f"({', '.join(sorted(names)) or 'none given'})")


def check_tool_results(messages: Sequence[Mapping[str, Any]], fields: Mapping[int, str] | None = None, *,
                       id_name: str = "tool_call_id", call_name: str = "tool call") -> None:
    """Every ``tool`` message (the chat form every API's messages take) answers a call of an earlier assistant
    message, by ``tool_call_id``; FieldError otherwise. ``fields``: message index -> the request field that carried
    that result's id (default chat's ``messages.<i>.tool_call_id``); ``id_name`` and ``call_name``: the API's words
    for the id and the call."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            called.update(call.get("id") or "" for call in message.get("tool_calls") or [])
        elif role == "tool":
            field = (fields or {}).get(i, f"messages.{i}.tool_call_id")
            answers = message.get("tool_call_id")
            if not answers:
                raise FieldError(field, f"a tool message needs the {id_name} it answers")
            if answers not in called:
                raise FieldError(field, f"{id_name} {answers!r} answers no {call_name} of an earlier assistant "
                                        "message")


def template_tools(tools: Sequence[FunctionIn]) -> list[dict[str, Any]]:
    """The tools as the chat template gets them (the chat route's spelling, as vLLM gives them)."""
    return [{"type": "function", "function": fn.template_dict()} for fn in tools]


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the turn uses them: ``calls``: the answer's calls are parsed (tools sent, tool_choice not
    none); ``forced``: the grammar that forces a call (tool_choice required or named)."""

    tools: list[dict[str, Any]]
    calls: bool = False
    forced: Constraint | None = None


NO_TOOLS = ToolUse([])
