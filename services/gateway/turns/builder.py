"""One chat turn for every API: the front ends (OpenAI chat and completions, Anthropic Messages, Responses, the
gRPC API) translate their request's spelling into what this builder takes, and it makes the TurnRequest.

It owns the rules a turn's request follows whatever API it came through:
- the model check;
- the tools and ``tool_choice`` (one ``check_tools``), and the answer parsing they imply;
- every tool result answers an earlier call (one ``check_tool_results``, over the messages in chat's form);
- the constraint: structured output, or the grammar that forces a tool call, and where it starts (after the
  reasoning the prompt leaves room for);
- the special-tokens rule (call tags and Harmony's channel markers that are special tokens stay in the text);
- the answer's limit when the request sets none (the gateway's default, else the context left).

What a turn reports back (usage, KV headers, ``drain``) is in reply.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from kvshuttle.control_plane.constraints import CALL_SYNTAX, Constraint, forced_tool_calls, not_forced
from kvshuttle.services.gateway.chat_tools import MAX_TOOLS, FieldError, FunctionIn, check_schema
from kvshuttle.services.gateway.turns.errors import TurnError
from kvshuttle.services.gateway.turns.parsers import Parsers
from kvshuttle.services.gateway.turns.request import TurnRequest


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


def check_tools(tools: Sequence[FunctionIn], choice: ToolChoice, words: ToolWords = OPENAI_TOOLS) -> None:
    """Tool definitions and ``tool_choice`` that the gateway can use; FieldError (naming the API's field)
    otherwise."""
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
        check_schema(fn.parameters, words.field(i, "parameters"), f"tool {fn.name!r}: parameters")
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


class TurnBuilder:
    """The gateway's turn rules for one served model and its parsers (vLLM's names; "": that part unparsed)."""

    def __init__(self, served_model: str, default_max_tokens: int = 0, *, tool_call_parser: str = "",
                 reasoning_parser: str = ""):
        """``default_max_tokens``: the limit of an answer whose request sets none (0: the context left after the
        prompt, as vLLM does)."""
        self.served_model = served_model
        self.default_max_tokens = default_max_tokens
        self.parsers = Parsers(tool_call_parser, reasoning_parser)

    def check_model(self, model: str | None, *, required: bool = False) -> None:
        """404 for a model this gateway does not serve (``required``: an empty name is one too)."""
        if (model or required) and model != self.served_model:
            raise TurnError(404, grpc.StatusCode.NOT_FOUND,
                            f"model {model!r} not found; this gateway serves {self.served_model!r}")

    def tools(self, tools: Sequence[FunctionIn], choice: ToolChoice, words: ToolWords = OPENAI_TOOLS, *,
              parallel: bool = True) -> ToolUse:
        """The request's tools checked, whether the answer's calls are parsed, and the grammar of a forced call
        (``parallel`` false: exactly one, so the record holds no call the client never sees)."""
        check_tools(tools, choice, words)
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
        req = TurnRequest(max_tokens=max_tokens or None, default_max_tokens=self.default_max_tokens,
                          parsing=self.parsers.parsing(tools.calls, tools.tools if tools.calls else None), **fields)
        if req.constraint is not None and constraint_after_reasoning:
            req.reasoning_tags = self.parsers.think_tags
        if tools.calls or self.parsers.keeps_special_tokens:
            # As vLLM's tool parsers ask: a model whose call tags are special tokens must keep them in the text
            # (Harmony's channel markers too, tools or not).
            req.skip_special_tokens = False
        return req
