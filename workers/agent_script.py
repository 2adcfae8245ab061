"""The fixed agent conversation that the "agent" test model is trained on (workers/model_builder.py) and that
end-to-end tests replay: a weather assistant that calls ``get_weather``, reads the results, and answers.

Data only (no torch): the conversations, their chat template (Qwen-style: ``<think>`` reasoning, ``<tool_call>``
JSON calls, ``<tool_response>`` results grouped in one user turn), and helpers that build the OpenAI-format messages
a client sends at each step and the exact text the model must generate there.

Steps are numbered from 0. ``messages_after(step)`` is the prompt of ``step``: the system message, every earlier
step's new input messages and assistant reply (echoed as a client sends it back), then the step's own inputs.
``assistant_text(step)`` is what greedy decoding must produce for that prompt (rendered with the tools,
``add_generation_prompt=True``), ending with ``<|im_end|>``. Rendering ``messages_after(step + 1)`` starts with the
rendered prompt of ``step`` followed by ``assistant_text(step)``: the echoed history re-renders what was generated.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS: list[dict[str, Any]] = [WEATHER_TOOL]
SYSTEM = "You are a weather assistant."
END = "<|im_end|>"
# Added (not special) tokens of the agent tokenizer, in id order after the BPE vocabulary: like Qwen's, they survive
# skip_special_tokens, so tool-call and reasoning parsers see them in the decoded text.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")

# Qwen-style chat templates (transformers-compatible; the gateway's renderer gives the same text). They differ only in
# how an assistant message's reasoning comes back in the history (_REASONING_RULES): the agent model's own template
# renders it whenever the client echoes it; the variants follow what the real reasoning models' templates do.
_HEADER = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
# Qwen3's last real user query: the last user message that is not a wrapped tool response.
_LAST_QUERY = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not("
    "message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
)
_REASONING_RULES = {
    # the agent model's own: the reasoning whenever the client echoes it
    "echo": (
        "",
        "{%- if message.reasoning_content is string and message.reasoning_content %}"
        "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
        "{%- set content = content.lstrip('\\n') %}"
        "{%- endif %}"
    ),
    # Qwen3 (its tokenizer_config.json): reasoning_content, else what content holds before </think>; rendered only
    # for assistant messages after the last real user query (the current tool loop), or for a final assistant message
    "qwen3": (
        _LAST_QUERY,
        "{%- set reasoning_content = '' %}"
        "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
        "{%- elif '</think>' in content %}"
        "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- endif %}"
        "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
        "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
        "{%- set content = content.lstrip('\\n') %}"
        "{%- endif %}"
    ),
    # DeepSeek-R1 (its tokenizer_config.json): never the reasoning; a history message's content after its last </think>
    "deepseek_r1": (
        "",
        "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    ),
}


def chat_template(variant: str = "echo") -> str:
    """The agent model's chat template (``echo``), or a variant with a real model family's reasoning rule."""
    prelude, reasoning = _REASONING_RULES[variant]
    return (
        _HEADER + prelude
        + "{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}"
        "{%- elif message.role in ['user', 'system', 'developer'] %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{%- set content = message.content if message.content is string else '' %}"
        "{{- '<|im_start|>assistant\\n' }}"
        + reasoning
        + "{{- content }}"
        "{%- if message.tool_calls %}"
        "{%- for call in message.tool_calls %}"
        "{%- set fn = call.function if call.function is defined else call %}"
        "{%- if not loop.first or content.strip() %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
        "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- raise_exception('unknown role: ' + message.role) }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}"
        "{%- endif %}"
    )


TEMPLATE_VARIANTS = tuple(_REASONING_RULES)
AGENT_CHAT_TEMPLATE = chat_template("echo")


@dataclass(frozen=True)
class Step:
    """One assistant step: the client's new input messages, then the reply the model must generate."""

    inputs: tuple[dict[str, Any], ...]
    reasoning: str | None
    content: str | None
    tool_calls: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class Conversation:
    name: str
    system: str
    tools: list[dict[str, Any]] | None
    steps: tuple[Step, ...] = field(default_factory=tuple)


def tool_call_id(step: int, index: int) -> str:
    """The id the script gives the ``index``-th tool call of ``step`` (the template does not render ids)."""
    return f"call_{step}_{index}"


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _tool(step: int, index: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": tool_call_id(step, index), "content": json.dumps(result)}


AGENT = Conversation("agent", SYSTEM, TOOLS, (
    Step((_user("What is the weather in Paris?"),),
         "The user asks about Paris. I will call get_weather.", None,
         (("get_weather", {"city": "Paris"}),)),
    Step((_tool(0, 0, {"city": "Paris", "temperature_c": 21, "sky": "sunny"}),),
         "The tool says 21 °C and sunny.", "It is 21 °C and sunny in Paris."),
    Step((_user("And in Oslo and Rome?"),),
         "The user asks about Oslo and Rome. I will call get_weather twice.", None,
         (("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"}))),
    Step((_tool(2, 0, {"city": "Oslo", "temperature_c": 4, "sky": "rain"}),
          _tool(2, 1, {"city": "Rome", "temperature_c": 18, "sky": "cloudy"})),
         "Oslo has 4 °C and rain, Rome 18 °C and clouds.", "Oslo: 4 °C and rain. Rome: 18 °C and cloudy."),
    Step((_user("Which city is warmest?"),),
         "Paris has 21 °C, the most of the three.", "Paris is the warmest at 21 °C."),
    Step((_user("Thanks!"),),
         "The user thanks me.", "You are welcome!"),
))
PLAIN = Conversation("plain", SYSTEM, None, (
    Step((_user("Say hello."),), "A greeting.", "Hello!"),
))
CONVERSATIONS: tuple[Conversation, ...] = (AGENT, PLAIN)
TURNS: tuple[Step, ...] = AGENT.steps
PLAIN_TURNS: tuple[Step, ...] = PLAIN.steps


def inputs(step: int, conversation: Conversation = AGENT,
           call_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The new input messages of ``step`` (copies). ``call_ids``: the ids the server gave the previous step's tool
    calls, put into this step's tool messages in order (default: the script's ``tool_call_id``s)."""
    out = copy.deepcopy(list(conversation.steps[step].inputs))
    if call_ids is not None:
        tool_msgs = [m for m in out if m["role"] == "tool"]
        if len(tool_msgs) != len(call_ids):
            raise ValueError(f"step {step} has {len(tool_msgs)} tool messages, got {len(call_ids)} call ids")
        for msg, call_id in zip(tool_msgs, call_ids):
            msg["tool_call_id"] = call_id
    return out


def assistant_message(step: int, conversation: Conversation = AGENT) -> dict[str, Any]:
    """The reply of ``step`` as a client echoes it back (content None when empty; arguments as a JSON string)."""
    s = conversation.steps[step]
    msg: dict[str, Any] = {"role": "assistant", "content": s.content, "reasoning_content": s.reasoning}
    if s.tool_calls:
        msg["tool_calls"] = [
            {"id": tool_call_id(step, i), "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(s.tool_calls)]
    return msg


def messages_after(step: int, conversation: Conversation = AGENT) -> list[dict[str, Any]]:
    """The full message list a client sends for ``step``: system, then per earlier step its inputs and echoed
    reply, then the inputs of ``step``. ``step == len(steps)`` gives the whole conversation, last reply included."""
    if not 0 <= step <= len(conversation.steps):
        raise IndexError(f"{conversation.name} has steps 0..{len(conversation.steps) - 1}")
    out: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}]
    for i in range(step):
        out += inputs(i, conversation)
        out.append(assistant_message(i, conversation))
    if step < len(conversation.steps):
        out += inputs(step, conversation)
    return out


def assistant_text(step: int, conversation: Conversation = AGENT) -> str:
    """The exact text the model generates for ``step`` (after the ``<|im_start|>assistant\\n`` prompt)."""
    return step_text(conversation.steps[step])


def tool_calls(step: int, conversation: Conversation = AGENT) -> list[dict[str, Any]]:
    """The tool calls of ``step`` as parsed from the generated text: ``[{"name": ..., "arguments": {...}}]``."""
    return [{"name": name, "arguments": copy.deepcopy(args)} for name, args in conversation.steps[step].tool_calls]


# -- the conversation real clients run ------------------------------------------------------------------------------
# Agent frameworks and SDKs (tests/support/clients.py) each run this conversation as their docs show: three user
# questions, the first two answered through one get_weather call each. They render their own system prompt and tool
# schema, echo the answers back in their own way (most drop the reasoning) and send their own fields, so the model is
# trained on each client's requests as they were captured (CLIENT_CONVERSATIONS_FILE), rendered with every template
# variant (TEMPLATE_VARIANTS).

CLIENT_SYSTEM = "You are a weather assistant. Use the get_weather tool to answer."
CLIENT_TOOL_DESCRIPTION = "Current weather in a city."
CLIENT_WEATHER: dict[str, dict[str, Any]] = {
    "Paris": {"city": "Paris", "temperature_c": 21, "sky": "sunny"},
    "Oslo": {"city": "Oslo", "temperature_c": 4, "sky": "rain"},
}
CLIENT_QUESTIONS = ("What is the weather in Paris?", "And in Oslo?", "Thanks!")
# The model's steps: each user question, then (for a call) the tool's result; ``inputs`` are left to each client.
CLIENT_STEPS: tuple[Step, ...] = (
    Step((), "The user asks about Paris. I will call get_weather.", None, (("get_weather", {"city": "Paris"}),)),
    Step((), "The tool says 21 °C and sunny.", "It is 21 °C and sunny in Paris."),
    Step((), "The user asks about Oslo. I will call get_weather.", None, (("get_weather", {"city": "Oslo"}),)),
    Step((), "The tool says 4 °C and rain.", "It is 4 °C and rainy in Oslo."),
    Step((), "The user thanks me.", "You are welcome!"),
)
CLIENT_MAX_TOKENS = 96


def client_weather(city: str) -> str:
    """What every client's get_weather tool returns: the city's weather as JSON text."""
    return json.dumps(CLIENT_WEATHER[city])


def step_text(step: Step) -> str:
    """The exact text the model generates for ``step`` (``<|im_end|>`` included), as :func:`assistant_text`."""
    text = f"<think>\n{step.reasoning}\n</think>\n\n" if step.reasoning else ""
    content = step.content or ""
    text += content
    for i, (name, args) in enumerate(step.tool_calls):
        if i or content.strip():
            text += "\n"
        text += f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    return text + END


# aiperf's multi-turn conversations (no tools, no system prompt): its input file's turns, and the model's answers.
# Each starts with a few hundred tokens of notes, so that its later turns have whole KV blocks to pull.
_NOTES = (
    "Notes on four cities. Rome lies in central Italy on the Tiber; its summers are hot and dry, its winters mild, "
    "and about 2.8 million people live there. Oslo sits at the head of the Oslofjord in Norway; its winters are long "
    "and snowy, its summers short and cool, and it has about 700 thousand people. Paris is on the Seine in northern "
    "France, with mild summers, cool winters and about 2.1 million people in the city itself. Lisbon faces the "
    "Atlantic at the mouth of the Tagus; it is sunny most of the year, rarely cold, and home to about half a million "
    "people. All four are capitals, and each is older than a thousand years."
)
AIPERF_CONVERSATIONS: tuple[tuple[tuple[str, Step], ...], ...] = (
    ((_NOTES + "\nName a warm city.", Step((), "A warm city from the notes.", "Rome is warm.")),
     ("And a cold one?", Step((), "A cold city from the notes.", "Oslo is cold.")),
     ("Which one is bigger?", Step((), "Rome has more people.", "Rome is bigger."))),
    ((_NOTES + "\nSay hello.", Step((), "A greeting.", "Hello!")),
     ("Say it again.", Step((), "The same greeting.", "Hello again!")),
     ("Now say goodbye.", Step((), "A farewell.", "Goodbye!"))),
)
