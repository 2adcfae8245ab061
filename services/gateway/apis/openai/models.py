"""The OpenAI routes' request bodies: ``ChatCompletionIn`` (/v1/chat/completions) and ``CompletionIn``
(/v1/completions), over the sampling fields they share (``SamplingIn``).

Nothing a client sends is dropped silently: a field this gateway does not apply (any unknown one, and the OpenAI and
vLLM fields listed in ``SamplingIn.KNOWN``) is a 400 naming it, except at a value that asks for nothing (null,
``store: false``, ...). docs/api.md lists every field and what becomes of it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvshuttle.services.gateway.apis.openai.chat_tools import (
    ToolCallIn,
    ToolChoice,
    ToolIn,
    template_tool_calls,
)
from kvshuttle.services.gateway.apis.openai.structured_output import ResponseFormatIn, StructuredOutputsIn
from kvshuttle.services.gateway.apis.request_model import SESSION_ID_PATTERN, StrictIn
from kvshuttle.services.gateway.edge.input_check import INT32_MAX
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.tools import MAX_TOOLS
from pydantic import Field


class TextPart(StrictIn):
    KNOWN = frozenset({"cache_control"})
    type: Literal["text"]
    text: str


class ChatMessageIn(StrictIn):
    # An assistant message echoed back from a response (the SDK's model_dump()) carries these as null.
    KNOWN = frozenset({"function_call", "refusal", "audio", "annotations"})
    NEUTRAL = {"annotations": ([],)}
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # Given to the chat template as vLLM gives it (most templates ignore it; some render it).
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)  # assistant messages
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool messages: the call they answer
    # An answer's reasoning, echoed back (vLLM reads either name); templates that keep reasoning render it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def plain(self, where: str = "message") -> dict[str, Any]:
        """The message as the chat template gets it (content parts joined, tool call arguments as dicts)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls and self.role != "assistant":
            raise FieldError(f"{where}.tool_calls", f"only assistant messages carry tool_calls, not {self.role}")
        if self.tool_calls:
            out["tool_calls"] = template_tool_calls(self.tool_calls, where)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out


class StreamOptions(StrictIn):
    KNOWN = frozenset({"continuous_usage_stats"})
    NEUTRAL = {"continuous_usage_stats": (False,)}
    include_usage: bool = False


TOKEN_ID = Annotated[int, Field(ge=0, le=2**31 - 1)]
# OpenAI's logit_bias: token ids as JSON object keys (strings), each to a bias in [-100, 100].
LOGIT_BIAS_KEY = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
BIAS = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]


class SamplingIn(StrictIn):
    # Fields of OpenAI's and vLLM's APIs this gateway does not apply: a 400 naming them, unless null (or neutral).
    KNOWN = frozenset({
        "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "top_logprobs", "audio", "modalities", "prediction", "web_search_options", "store", "metadata",
        "service_tier", "reasoning_effort", "verbosity", "echo", "best_of",
        "suffix", "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "prompt_logprobs",
        "truncate_prompt_tokens", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
        "add_special_tokens", "documents", "priority", "request_id", "return_tokens_as_token_ids", "cache_salt",
        "mm_processor_kwargs", "vllm_xargs", "include_reasoning",
        # Only the scheduler decides what P pulls: a router's or client's kv_transfer_params would be wrong here.
        "kv_transfer_params"})
    NEUTRAL = {"top_logprobs": (0,), "store": (False,), "echo": (False,), "best_of": (1,),
               "service_tier": ("auto", "default"), "modalities": (["text"],), "parallel_tool_calls": (True, False),
               "use_beam_search": (False,)}
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)  # vLLM's gRPC API takes an int32
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    conversation_id: str | None = Field(default=None, max_length=256, pattern=SESSION_ID_PATTERN)
    disable_pull: bool = False  # kvshuttle extension: force a recompute (benchmarks)
    # kvshuttle extension: plan with this named scheduler policy (A/B tests, benchmarks)
    policy: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_-]*$")
    # vLLM's sampling parameters beyond OpenAI's (null: the default); checked as vLLM checks them.
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stop_token_ids: list[TOKEN_ID] | None = Field(default=None, max_length=1024)
    logit_bias: dict[LOGIT_BIAS_KEY, BIAS] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Who the turn is for (OpenAI's end-user ids): on the turn's span and log line; they change no decision.
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    # OpenAI's cache key: a session hint when the request names no session (docs/agents.md).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: the prompt's token ids (top level) and each choice's answer ids, as the workers saw them.
    return_token_ids: bool | None = None
    # Structured output (guided decoding on D): OpenAI's response_format, or vLLM's structured_outputs.
    response_format: ResponseFormatIn | None = None
    structured_outputs: StructuredOutputsIn | None = None

    def sampling(self) -> dict[str, Any]:
        """TurnRequest's keywords for the sampling fields the request set."""
        out = {name: value for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                                        "repetition_penalty", "min_tokens", "include_stop_str_in_output",
                                        "skip_special_tokens", "spaces_between_special_tokens")
               if (value := getattr(self, name)) is not None}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return out


# chat_template_kwargs may not set what the gateway itself gives the template.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "conversation"})


MAX_LOGPROBS = 20  # the most likely tokens a request may ask for at each position (OpenAI's limit)


class ChatCompletionIn(SamplingIn):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer

    def template_vars(self) -> dict[str, Any]:
        """What the chat template gets besides the messages."""
        extra = dict(self.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_VARS & extra.keys())
        if reserved:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}")
        tools = [t.template_dict() for t in self.tools or []]
        if tools:  # given to the template even with tool_choice "none", as vLLM gives them
            extra["tools"] = tools
        return extra


class CompletionIn(SamplingIn):
    # The sampled token's logprob, and this many of the most likely (0: none).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Constraints on each member, so that the OpenAPI document shows them too (on the union it showed none).
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def logprobs_of(body: SamplingIn) -> int | None:
    """The turn's logprobs setting: None, or how many most-likely tokens to report (chat: top_logprobs, which needs
    logprobs true; completions: logprobs, an int)."""
    if isinstance(body, ChatCompletionIn):
        if body.top_logprobs and not body.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)
