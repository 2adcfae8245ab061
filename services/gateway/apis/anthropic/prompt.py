"""The Messages request as the chat template gets it: the messages, tools and template variables the chat route
would build for the same conversation, so the prompt, and with it the KV reuse across turns, is the same whichever
API an agent speaks.

- ``system`` → a system message; assistant ``text`` blocks → its content, ``thinking`` → ``reasoning_content``,
  ``tool_use`` → ``tool_calls`` (arguments as a dict, as the chat route gives them to the template); a user message's
  ``tool_result`` blocks → ``tool`` messages (before the message's text, in order; ``is_error`` goes with them to the
  template, as a message's ``name`` does on the chat route). Text blocks are joined with a newline, as the chat route
  (and vLLM) join content parts. ``redacted_thinking`` blocks are accepted and left out (only Anthropic can read them).
- ``tools`` → OpenAI function tools; ``tool_choice`` ``auto`` / ``any`` (forced calls, as ``required``) / ``tool``
  (one named call) / ``none`` (tools rendered, calls not parsed); ``disable_parallel_tool_use`` keeps the first call.
- ``thinking`` ``enabled`` / ``adaptive`` / ``disabled`` → the template variable ``enable_thinking``.
"""

from __future__ import annotations

from typing import Any

from kvshuttle.services.gateway.apis.anthropic.models import PromptIn
from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.tools import FunctionIn, NamedTool, ToolChoice, ToolUse, check_tool_results


def chat_messages(body: PromptIn) -> list[dict[str, Any]]:
    """The messages as the chat route gives them to the template (ChatMessageIn.plain()'s shape)."""
    out: list[dict[str, Any]] = []
    system = "\n".join(b.text for b in body.system or [])
    if system:
        out.append({"role": "system", "content": system})
    fields: dict[int, str] = {}  # a tool result's chat message -> its tool_use_id's field
    for i, message in enumerate(body.messages):
        where = f"messages.{i}"
        text: list[str] = []
        if message.role == "assistant":
            thinking: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, block in enumerate(message.content):
                if block.type == "text":
                    text.append(block.text)
                elif block.type == "thinking":
                    thinking.append(block.thinking)
                elif block.type == "tool_use":
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": block.input}})
                elif block.type == "tool_result":
                    raise FieldError(f"{where}.content.{j}", "tool_result blocks belong in user messages")
            assistant: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
            if calls:
                assistant["tool_calls"] = calls
            if thinking:
                assistant["reasoning_content"] = assistant["reasoning"] = "".join(thinking)
            out.append(assistant)
            continue
        results: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            if block.type == "text":
                text.append(block.text)
            elif block.type == "tool_result":
                fields[len(out) + len(results)] = f"{where}.content.{j}.tool_use_id"
                results.append({"role": "tool", "content": "\n".join(b.text for b in block.content),
                                "tool_call_id": block.tool_use_id, **({"is_error": True} if block.is_error else {})})
            else:
                raise FieldError(f"{where}.content.{j}", f"{block.type} blocks belong in assistant messages")
        out.extend(results)
        if text or not results:
            out.append({"role": "user", "content": "\n".join(text)})
    check_tool_results(out, fields, id_name="tool_use_id", call_name="tool_use block")
    return out


def chat_tools(body: PromptIn) -> tuple[list[FunctionIn], ToolChoice, bool]:
    """The tools as the chat route's functions, the ``tool_choice`` (``any`` is ``required``, ``tool`` names one),
    and whether parallel calls are kept."""
    tools = [t.function() for t in body.tools or []]
    choice = body.tool_choice
    neutral: ToolChoice
    if choice is None:
        neutral = None
    elif choice.type == "tool":
        neutral = NamedTool(choice.name)
    else:
        neutral = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return tools, neutral, not getattr(choice, "disable_parallel_tool_use", False)


def template_vars(body: PromptIn, tools: ToolUse) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools.tools:  # given to the template even with tool_choice none, as the chat route gives them
        out["tools"] = tools.tools
    if body.thinking is not None:
        out["enable_thinking"] = body.thinking.type != "disabled"
    return out
