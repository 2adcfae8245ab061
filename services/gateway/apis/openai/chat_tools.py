"""Tools in Chat Completions requests: the tool definitions, ``tool_choice``, and the tool calls in the history,
as OpenAI spells them, and the calls as the chat template gets them (as vLLM gives them to it). The checks every API
shares (schemas, names, results answering calls) are turns/tools.py's.

Checked strictly: call arguments that are not a JSON object are 400s (vLLM coerces bad arguments to ``{}``; a history
that silently changes is worse than a clear error).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.tools import FunctionIn
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
