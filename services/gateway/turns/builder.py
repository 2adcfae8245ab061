"""One chat turn for every API: the front ends (OpenAI chat and completions, Anthropic Messages, Responses, the
gRPC API) translate their request's spelling into what this builder takes, and it makes the TurnRequest.

It owns the rules a turn's request follows whatever API it came through:
- the tools and ``tool_choice`` (tools.py's ``check_tools``), and the answer parsing they imply (tools.py's
  ``check_tool_results``, which every front end runs over its messages in chat's form: each tool result answers an
  earlier call);
- the constraint: structured output, or the grammar that forces a tool call, and where it starts (after the
  reasoning the prompt leaves room for);
- the special-tokens rule (call tags and Harmony's channel markers that are special tokens stay in the text);
- the answer's limit when the request sets none (the gateway's default, else the context left).

What a turn reports back (usage, KV headers, ``drain``) is in reply.py.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kvshuttle.control_plane.constraints import CALL_SYNTAX, Constraint, forced_tool_calls, not_forced
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.parsers import Parsers
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.tools import (
    NO_TOOLS,
    OPENAI_TOOLS,
    FunctionIn,
    NamedTool,
    ToolChoice,
    ToolUse,
    ToolWords,
    check_tools,
    template_tools,
)


class TurnBuilder:
    """The gateway's turn rules for one served model and its parsers (vLLM's names; "": that part unparsed)."""

    def __init__(self, served_model: str, default_max_tokens: int = 0, *, tool_call_parser: str = "",
                 reasoning_parser: str = ""):
        """``default_max_tokens``: the limit of an answer whose request sets none (0: the context left after the
        prompt, as vLLM does)."""
        self.served_model = served_model
        self.base_model = ""  # an adapter's builder: the base model it adapts (for_adapter)
        self.default_max_tokens = default_max_tokens
        self.parsers = Parsers(tool_call_parser, reasoning_parser)

    def for_adapter(self, name: str) -> TurnBuilder:
        """This (base model's) builder for the turns of its LoRA adapter ``name``: the same rules and parsers, the
        requests for ``name`` run under the adapter."""
        adapter = copy.copy(self)
        adapter.served_model, adapter.base_model = name, self.served_model
        return adapter

    def tools(self, tools: Sequence[FunctionIn], choice: ToolChoice, words: ToolWords = OPENAI_TOOLS, *,
              parallel: bool = True, tenant: str = "") -> ToolUse:
        """The request's tools checked, whether the answer's calls are parsed, and the grammar of a forced call
        (``parallel`` false: exactly one, so the record holds no call the client never sees)."""
        check_tools(tools, choice, words, tenant=tenant)
        listed = template_tools(tools)
        calls = bool(tools) and choice != "none"
        if not calls:
            return ToolUse(listed)
        parser = self.parsers.tool_call_parser
        if self.parsers.tools is None:
            raise FieldError("tools", "this gateway parses no tool calls: start it with --tool-call-parser (e.g. "
                                      f"hermes) to use tools, or send {words.none}")
        if choice in (None, "auto"):
            return ToolUse(listed, calls=True)
        syntax = CALL_SYNTAX.get(parser)
        if syntax is None:
            raise FieldError("tool_choice", f"tool_choice {words.forced}: {not_forced(parser)}; "
                                            "use 'auto'")
        named = choice.name if isinstance(choice, NamedTool) else None
        return ToolUse(listed, calls=True, forced=forced_tool_calls(syntax, listed, named, one_call=not parallel))

    def constraint(self, asked: Constraint | None, param: str, tools: ToolUse = NO_TOOLS) -> Constraint | None:
        """The answer's constraint: the structured output ``asked`` (``param``: the field that asked for it) or the
        forced call's grammar; they exclude each other."""
        if asked is not None and not self.parsers.constrains:
            raise FieldError(param, "structured output cannot be applied to answers in the "
                                    f"{self.parsers.tool_call_parser or self.parsers.reasoning_parser} parser's "
                                    "format yet (gpt-oss's Harmony channels): leave it out")
        if asked is not None and tools.forced is not None:
            raise FieldError(param, "structured output and a forced tool call (tool_choice required or named) exclude "
                                    "each other")
        return asked if asked is not None else tools.forced

    def request(self, tools: ToolUse = NO_TOOLS, *, max_tokens: int | None = None,
                constraint_after_reasoning: bool = True, **fields: Any) -> TurnRequest:
        """The TurnRequest: ``fields`` are its own (messages, sampling, session, ...); the parsing, the reasoning
        tags and the special-tokens rule follow from the tools and the parsers. ``constraint_after_reasoning``:
        the constraint starts after the reasoning the prompt leaves room for (the gateway's own constraints; vLLM's
        raw ``structured_outputs`` applies from the first token, as in vLLM)."""
        fields.setdefault("model", self.served_model)
        if self.base_model:
            fields.setdefault("base_model", self.base_model)
        req = TurnRequest(max_tokens=max_tokens or None, default_max_tokens=self.default_max_tokens,
                          parsing=self.parsers.parsing(tools.calls, tools.tools if tools.calls else None), **fields)
        if req.constraint is not None and constraint_after_reasoning:
            req.reasoning_tags = self.parsers.think_tags
        if tools.calls or self.parsers.keeps_special_tokens:
            # As vLLM's tool parsers ask: a model whose call tags are special tokens must keep them in the text
            # (Harmony's channel markers too, tools or not).
            req.skip_special_tokens = False
        return req
