"""Tools in Chat Completions requests: the tool definitions, ``tool_choice``, and the tool calls and results in the
history, checked and turned into what the chat template gets (as vLLM gives them to it).

Checked strictly: a tool whose parameters are not a JSON Schema object, a ``tool_choice`` naming no tool, a tool
result whose ``tool_call_id`` answers no earlier call, or call arguments that are not a JSON object are 400s (vLLM
coerces bad arguments to ``{}``; a history that silently changes is worse than a clear error).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field

FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
MAX_TOOLS = 128


class FieldError(ValueError):
    """A request field that cannot be used as given (tools, tool history, structured output): a 400 naming
    ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


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


class ToolIn(_Strict):
    type: Literal["function"]
    function: FunctionIn

    def template_dict(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.template_dict()}


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1 << 20)


class ToolCallIn(_Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


def check_schema(schema: Any, param: str, what: str) -> None:
    """``schema`` is a valid JSON Schema (draft 2020-12); FieldError naming ``param`` otherwise."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top)"
        raise FieldError(param, f"{what} are not a valid JSON Schema at {where}: {exc.message}") from None
    except RecursionError:  # input_check refuses deep schemas first; this is the backstop
        raise FieldError(param, f"{what} nest too deeply") from None


def template_tool_calls(calls: list[ToolCallIn], where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls for the template: arguments as a dict (as vLLM and transformers give
    them)."""
    out = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except ValueError as exc:
            raise FieldError(f"{where}.tool_calls.{j}.function.arguments",
                            f"tool call {call.id!r}: arguments are not valid JSON ({exc})") from None
        if not isinstance(arguments, dict):
            raise FieldError(f"{where}.tool_calls.{j}.function.arguments",
                            f"tool call {call.id!r}: arguments must be a JSON object, got {type(arguments).__name__}")
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out
