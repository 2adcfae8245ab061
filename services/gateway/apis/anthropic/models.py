"""The Messages API's request bodies: ``MessagesIn`` (/v1/messages) and ``CountTokensIn``
(/v1/messages/count_tokens), over the prompt's fields they share (``PromptIn``).

Text only: image, document and search-result blocks, and the blocks and tools of Anthropic's server-side tools, are
refused by name. ``cache_control`` (on blocks, tools, or the request) is accepted and ignored: kvshuttle reuses a
conversation's KV without being asked (the session's prompt prefix is pulled or found in P's prefix cache).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvshuttle.services.gateway.apis.request_model import StrictIn
from kvshuttle.services.gateway.turns.tools import FUNCTION_NAME, MAX_TOOLS, FunctionIn
from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

TEXT_ONLY = frozenset({"image", "document", "search_result"})
# Blocks of Anthropic's server-side tools (web search, code execution, MCP connector, ...): this gateway runs none.
SERVER_TOOL_BLOCKS = frozenset({
    "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result",
    "mcp_tool_use", "mcp_tool_result", "container_upload"})


def _supported_block(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        return value  # the block's own validation names what is wrong
    if kind in TEXT_ONLY:
        raise PydanticCustomError("unsupported_block", "{kind} blocks are not supported: this gateway serves a "
                                  "text-only model (send the content as text)", {"kind": kind})
    if kind in SERVER_TOOL_BLOCKS:
        raise PydanticCustomError("unsupported_block", "{kind} blocks are not supported: this gateway runs no "
                                  "server tools", {"kind": kind})
    return value


def _as_blocks(value: Any) -> Any:
    """A string stands for one text block (as Anthropic reads it)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _custom_tool(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise PydanticCustomError("unsupported_tool", "server tool {kind} is not supported: this gateway runs no "
                                  "server tools (declare a client tool: name, description, input_schema)",
                                  {"kind": repr(kind)})
    return value


class CacheControlIn(StrictIn):
    """Accepted and ignored: kvshuttle reuses a conversation's KV without being asked."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockIn(StrictIn):
    KNOWN = frozenset({"citations"})
    NEUTRAL = {"citations": ([],)}
    type: Literal["text"]
    text: str
    cache_control: CacheControlIn | None = None


TextBlocks = Annotated[list[Annotated[TextBlockIn, BeforeValidator(_supported_block)]],
                       BeforeValidator(_as_blocks, json_schema_input_type=str | list[TextBlockIn])]


class ToolUseBlockIn(StrictIn):
    KNOWN = frozenset({"caller", "toolset_name"})
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: CacheControlIn | None = None


class ToolResultBlockIn(StrictIn):
    KNOWN = frozenset({"toolset_name"})
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: TextBlocks = Field(default_factory=list)
    is_error: bool = False  # given to the chat template with the tool message (a template may render it)
    cache_control: CacheControlIn | None = None


class ThinkingBlockIn(StrictIn):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this gateway signs nothing: its answers carry ""


class RedactedThinkingBlockIn(StrictIn):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Annotated[TextBlockIn | ToolUseBlockIn | ToolResultBlockIn | ThinkingBlockIn | RedactedThinkingBlockIn,
              Field(discriminator="type")],
    BeforeValidator(_supported_block)]


class MessageIn(StrictIn):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[ContentBlock])]


class ToolDefIn(StrictIn):
    KNOWN = frozenset({"allowed_callers", "defer_loading", "eager_input_streaming", "input_examples"})
    NEUTRAL = {"defer_loading": (False,), "eager_input_streaming": (False,), "input_examples": ([],)}
    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # given to the template as the chat route gives a function's `strict`
    cache_control: CacheControlIn | None = None

    def function(self) -> FunctionIn:
        """The tool as the chat route's function definition."""
        return FunctionIn(name=self.name, description=self.description, parameters=self.input_schema,
                          strict=self.strict)


class ToolChoiceAutoIn(StrictIn):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAnyIn(StrictIn):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceToolIn(StrictIn):
    type: Literal["tool"]
    name: str = Field(min_length=1, max_length=256)
    disable_parallel_tool_use: bool = False


class ToolChoiceNoneIn(StrictIn):
    type: Literal["none"]


class ThinkingEnabledIn(StrictIn):
    type: Literal["enabled"]
    # Taken only where max_tokens already bounds it (budget_tokens >= max_tokens - 1): the gateway cannot stop the
    # reasoning earlier (a smaller budget is a 400 naming it).
    budget_tokens: int = Field(ge=1, le=2**31 - 1)
    display: Literal["summarized"] | None = None


class ThinkingAdaptiveIn(StrictIn):
    type: Literal["adaptive"]
    display: Literal["summarized"] | None = None


class ThinkingDisabledIn(StrictIn):
    type: Literal["disabled"]


class MetadataIn(StrictIn):
    user_id: str | None = Field(default=None, max_length=256)  # on the turn's span and log line; changes nothing


class PromptIn(StrictIn):
    """What makes the prompt: the fields /v1/messages and /v1/messages/count_tokens share."""

    # Fields of Anthropic's API this gateway does not apply: a 400 naming them, unless null.
    KNOWN = frozenset({"container", "context_management", "mcp_servers", "output_config", "output_format",
                       "inference_geo", "speed", "diagnostics"})
    NEUTRAL = {"speed": ("standard",)}
    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageIn] = Field(min_length=1)
    system: TextBlocks | None = None
    tools: list[Annotated[ToolDefIn, BeforeValidator(_custom_tool)]] | None = Field(default=None,
                                                                                    max_length=MAX_TOOLS)
    tool_choice: Annotated[ToolChoiceAutoIn | ToolChoiceAnyIn | ToolChoiceToolIn | ToolChoiceNoneIn,
                           Field(discriminator="type")] | None = None
    thinking: Annotated[ThinkingEnabledIn | ThinkingAdaptiveIn | ThinkingDisabledIn,
                        Field(discriminator="type")] | None = None
    cache_control: CacheControlIn | None = None  # accepted and ignored, as on blocks


class MessagesIn(PromptIn):
    max_tokens: int = Field(ge=1, le=2**31 - 1)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stream: bool = False
    metadata: MetadataIn | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


class CountTokensIn(PromptIn):
    pass
