"""Forced tool calls in every family's own syntax, end to end: the call the grammar forces re-renders, once the client
echoes it back, to exactly what the model wrote, so the next turn continues the session and pulls what the decode
worker holds.

The agent test model (kvshuttle.workers.agent_script) on one real vLLM prefill/decode pair (NIXL), the folder's agent
stack (conftest.py), behind one gateway per tool-call family, each started with its ``--tool-call-parser`` and a test
template that renders tool calls, tool results and the generation prompt as the family's real template does
(tests/support/family_templates.py; ``hermes``'s is the agent model's own, Hermes / Qwen2.5's). The model was trained
on the hermes syntax only; the tool's single argument is an enum, so the grammar (control_plane/tool_calls/, built by
the gateway's TurnBuilder.tools) decides the text up to the enum value.

Each family runs one conversation through the official openai SDK, without a session id (the gateway finds the
session by content), through a TurnTap (services/devtools/bench/turn_tap.py: P's prefix cache emptied before each
turn, P's own counters read after it):

1. ``tool_choice`` names ``pick_city``: exactly one call of it, with a city of the enum;
2. the answer echoed back whole (``message.model_dump``) and a tool result; ``tool_choice: "required"``: calls of
   ``pick_city`` only, each with a city of the enum (exactly one with ``parallel_tool_calls`` false, which every family
   but those in PARALLEL sends);
3. that answer echoed back with its results; ``tool_choice: "none"``, a short plain answer.

Turns 2 and 3 must each re-render the previous answer exactly (the recorded text is a prefix of the new prompt's
text), be found in the session and pull the whole blocks of the longest common prefix with the decode worker's ids
(check_pulls, against P's counters).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvshuttle.services.devtools.bench.turn_tap import TappedTurn, TurnTap, check_pulls
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from openai import AsyncOpenAI

from tests.support.agent_stack import gateways
from tests.support.family_templates import FAMILY_TEMPLATES

pytestmark = pytest.mark.e2e

CITIES = ["Paris", "Oslo", "Rome"]
PICK_CITY = {"type": "function", "function": {
    "name": "pick_city", "description": "Pick the city to report on",
    "parameters": {"type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"],
                   "additionalProperties": False}}}
TOOLS = [PICK_CITY]
SYSTEM = "You are a weather assistant."
FORCED_MAX_TOKENS = 128  # a whole call in any family's syntax, byte-level tokens of DeepSeek's markers included
PLAIN_MAX_TOKENS = 4
# The families whose required turn allows parallel calls (the grammar bounds nothing: the model stops when it ends its
# message); the others send parallel_tool_calls false, as a client that wants one call does, and the grammar ends the
# answer after one call (constraints.forced_tool_calls one_call).
PARALLEL = {"hermes", "qwen3_json"}

@pytest.fixture(scope="module")
async def family_gateways(agent_stack, tmp_path_factory):
    """One gateway per family (its ``--tool-call-parser`` and test template; no API keys) on the folder's agent stack
    (conftest): the stack and {family: base URL}."""
    work = tmp_path_factory.mktemp("family-templates")
    flags = {}
    for family, spec in FAMILY_TEMPLATES.items():
        template = work / f"{family}.jinja"
        template.write_text(spec.template)
        flags[family] = ["--tool-call-parser", spec.parser, "--chat-template", str(template)]
    async with gateways(agent_stack, flags) as urls:
        yield agent_stack, urls


def _calls(response) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls or []]


def _forced_ok(response, *, named: bool) -> str:
    """What is wrong with a forced answer ("" when nothing): calls of pick_city only (exactly one when named), each
    with a city of the enum, and nothing else."""
    choice = response.choices[0]
    calls = _calls(response)
    if choice.finish_reason != "tool_calls" or not calls or (named and len(calls) != 1):
        return f"finish {choice.finish_reason}, calls {calls}, content {choice.message.content!r}"
    if any(name != "pick_city" or args not in [{"city": c} for c in CITIES] for name, args in calls):
        return f"calls outside the schema: {calls}"
    if (choice.message.content or "").strip():
        return f"content next to the forced calls: {choice.message.content!r}"
    return ""


def _written(tokenizer: GatewayTokenizer, turn: TappedTurn) -> str:
    """The answer the model wrote in ``turn``, as recorded (special tokens kept)."""
    return tokenizer.decode(turn.history[len(turn.prompt_ids):], skip_special_tokens=False)


def _echo(response) -> list[dict[str, Any]]:
    """The answer as the SDK echoes it back (the whole message), and a tool result per call."""
    message = response.choices[0].message
    out = [message.model_dump(exclude_none=True)]
    for call in message.tool_calls or []:
        city = json.loads(call.function.arguments)["city"]
        out.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": city, "sky": "sunny"})})
    return out


def _as_template_gets(messages: list[dict]) -> list[dict]:
    """The messages as the gateway gives them to the chat template: tool call arguments as dicts (as vLLM and
    transformers do)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                       "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def _rerender_problem(tokenizer: GatewayTokenizer, recorded: TappedTurn, messages: list[dict], kwargs: dict) -> str:
    """"" when the next prompt's text (``messages`` rendered with the family's template) starts with the text the
    previous turn recorded (its prompt and the answer the model wrote); else where and how they differ."""
    held = tokenizer.decode(recorded.history, skip_special_tokens=False)
    prompt = tokenizer.render_chat(_as_template_gets(messages), tools=TOOLS, **kwargs)
    if prompt.startswith(held):
        return ""
    at = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
    return (f"the echoed answer re-renders differently from what the model wrote, at character {at}:\n"
            f"  written:     {held[max(0, at - 60):at + 80]!r}\n  re-rendered: {prompt[max(0, at - 60):at + 80]!r}")


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
async def test_a_forced_call_echoed_back_re_renders_and_the_next_turn_pulls(family_gateways, agent_model_dir, family):
    stack, urls = family_gateways
    spec = FAMILY_TEMPLATES[family]
    tokenizer = GatewayTokenizer(agent_model_dir, spec.template)
    extra = {"chat_template_kwargs": spec.template_kwargs} if spec.template_kwargs else None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        # a question of its own per family: no two conversations share a text boundary
        {"role": "user", "content": f"Pick a city for the {family} report."}]
    async with TurnTap(stack, urls[family]) as tap:
        client = AsyncOpenAI(base_url=f"{tap.base_url}/v1", api_key="unused", timeout=300)
        args = dict(model="agent", tools=TOOLS, temperature=0, extra_body=extra)
        named = await client.chat.completions.create(
            messages=messages, tool_choice={"type": "function", "function": {"name": "pick_city"}},
            max_tokens=FORCED_MAX_TOKENS, **args)
        await tap.settled()
        assert not (why := _forced_ok(named, named=True)), \
            f"named: {why}; written {_written(tokenizer, tap.turns[0])!r}"
        messages += _echo(named)
        rerendered = [_rerender_problem(tokenizer, tap.turns[0], messages, spec.template_kwargs)]
        required = await client.chat.completions.create(messages=messages, tool_choice="required",
                                                        parallel_tool_calls=family in PARALLEL,
                                                        max_tokens=FORCED_MAX_TOKENS, **args)
        await tap.settled()
        assert not (why := _forced_ok(required, named=False)), \
            f"required: {why}; written {_written(tokenizer, tap.turns[1])!r}"
        messages += _echo(required)
        rerendered.append(_rerender_problem(tokenizer, tap.turns[1], messages, spec.template_kwargs))
        await client.chat.completions.create(messages=messages, tool_choice="none", max_tokens=PLAIN_MAX_TOKENS,
                                             **args)
    print(f"\n{family}: named {_calls(named)}, required {_calls(required)}; pulled "
          f"{[t.pulled for t in tap.turns]} of {[len(t.prompt_ids) for t in tap.turns]} prompt tokens "
          f"({[t.source for t in tap.turns]})")
    assert not any(rerendered), "\n".join(p for p in rerendered if p)
    assert len(tap.turns) == 3, [t.path for t in tap.turns]
    problems = check_pulls(tap.turns, stack.workers[0].block_size, {})
    assert not problems, "\n".join(problems)
