"""The Responses API's request body (``ResponsesIn``, POST /v1/responses) and the response id's form."""

from __future__ import annotations

from typing import Any, Literal

from kvshuttle.services.gateway.apis.request_model import SESSION_ID_PATTERN, StrictIn
from kvshuttle.services.gateway.edge.input_check import INT32_MAX
from kvshuttle.services.gateway.turns.tools import MAX_TOOLS, FunctionIn
from pydantic import Field

RESPONSE_ID = r"^resp_[A-Za-z0-9]{1,64}$"


class FunctionToolIn(FunctionIn):
    """A Responses API function tool: the chat route's function definition, flat, with its type."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        """The tool as the chat template gets it (the chat route's spelling)."""
        return {"type": "function", "function": self.template_dict()}


class NamedFunctionChoice(StrictIn):
    type: Literal["function"]
    name: str


class FormatIn(StrictIn):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextIn(StrictIn):
    KNOWN = frozenset({"verbosity"})
    NEUTRAL = {"verbosity": ("medium",)}
    format: FormatIn | None = None


class ReasoningIn(StrictIn):
    """Accepted only when it asks for nothing (its options null): the model's own chat template decides whether it
    reasons."""

    KNOWN = frozenset({"effort", "summary", "generate_summary"})


class ResponsesIn(StrictIn):
    KNOWN = frozenset({"include", "truncation", "background", "prompt",
                       "service_tier", "top_logprobs", "conversation", "max_tool_calls", "stream_options",
                       "context_management", "prompt_cache_retention"})
    NEUTRAL = {"include": ([],), "truncation": ("disabled",), "background": (False,),
               "service_tier": ("auto", "default"), "top_logprobs": (0,)}
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(default=None, pattern=RESPONSE_ID)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    text: TextIn | None = None
    reasoning: ReasoningIn | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    conversation_id: str | None = Field(default=None, max_length=256, pattern=SESSION_ID_PATTERN)
