"""The clients people use, each running the agent model's client conversation (kvshuttle.workers.agent_script:
CLIENT_QUESTIONS, a get_weather tool) as its own docs show, against a gateway's base URL, with no session id.

Each driver returns what the user saw: the final answer to each question, and the tool calls made on the way. The
e2e tests run them on the real stack (tests/e2e/agents/test_clients.py); the conversations they send were captured from
these same drivers (tests/support/capture_clients.py) to train the agent model on them. aiperf is run as its command
line, from its own environment (.aiperf: its pins do not fit next to the project's).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvshuttle.workers import agent_script as script

REPO = Path(__file__).resolve().parents[2]
AIPERF = REPO / ".aiperf" / "bin" / "aiperf"
AIPERF_VERSION = "0.13.0"  # scripts/bootstrap.sh installs it
MODEL = "agent"


@dataclass
class Ran:
    """What the user of a client saw: one final answer per question, and every tool call (name, arguments)."""

    answers: list[str] = field(default_factory=list)
    calls: list[tuple[str, dict]] = field(default_factory=list)


def _weather(city: str) -> str:
    """Current weather in a city."""
    return script.client_weather(city)


async def openai_sdk(base_url: str, api_key: str, stream: bool = False, *, whole: bool = True) -> Ran:
    """The official openai SDK in the tool loop of our docs (docs/agents.md): each answer echoed back as
    ``message.model_dump(exclude_none=True)`` (``whole``: its ``reasoning_content`` included), or with only the
    fields of the OpenAI format (role, content, tool_calls), as agent frameworks echo it."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": script.CLIENT_TOOL_DESCRIPTION,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ran, messages = Ran(), [{"role": "system", "content": script.CLIENT_SYSTEM}]
    for question in script.CLIENT_QUESTIONS:
        messages.append({"role": "user", "content": question})
        while True:
            args = dict(model=MODEL, messages=messages, tools=tools, temperature=0,
                        max_tokens=script.CLIENT_MAX_TOKENS)
            if stream:
                message = await _streamed_message(await client.chat.completions.create(**args, stream=True))
            else:
                message = (await client.chat.completions.create(**args)).choices[0].message.model_dump(
                    exclude_none=True)
            messages.append(message if whole else {k: v for k, v in message.items()
                                                   if k in ("role", "content", "tool_calls")})
            if not message.get("tool_calls"):
                ran.answers.append(message.get("content") or "")
                break
            for call in message["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                ran.calls.append((call["function"]["name"], args))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": _weather(**args)})
    return ran


async def _streamed_message(stream) -> dict:
    """The assistant message a streamed answer adds up to (as the openai SDK's docs assemble it)."""
    message: dict = {"role": "assistant"}
    content, reasoning, calls = "", "", {}
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                   "function": {"name": tc.function.name, "arguments": ""}})
                call["function"]["arguments"] += tc.function.arguments or ""
    message["content"] = content or None
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {k: v for k, v in message.items() if v is not None}


async def openai_standard_fields(base_url: str, api_key: str, stream: bool = False) -> Ran:
    return await openai_sdk(base_url, api_key, stream, whole=False)


async def openai_agents_chat(base_url: str, api_key: str, stream: bool = False) -> Ran:
    """The OpenAI Agents SDK with its chat-completions model: ``Runner.run`` per question, the history carried with
    ``result.to_input_list()``."""
    return await _openai_agents(base_url, api_key, responses=False, stream=stream)


async def openai_agents_responses(base_url: str, api_key: str, stream: bool = False) -> Ran:
    """The OpenAI Agents SDK with its Responses model: the server holds the conversation (``previous_response_id``)."""
    return await _openai_agents(base_url, api_key, responses=True, stream=stream)


async def _openai_agents(base_url: str, api_key: str, *, responses: bool, stream: bool) -> Ran:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export (no network)
    ran = Ran()

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.calls.append(("get_weather", {"city": city}))
        return script.client_weather(city)

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    model = (OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(model=MODEL, openai_client=client)
    agent = Agent(name="Weather", instructions=script.CLIENT_SYSTEM, tools=[get_weather], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=script.CLIENT_MAX_TOKENS))
    inputs: list | str = []
    previous = None
    for question in script.CLIENT_QUESTIONS:
        if responses:
            turn_input: list | str = question
        else:
            turn_input = [*inputs, {"role": "user", "content": question}]
        if stream:
            result = Runner.run_streamed(agent, turn_input, previous_response_id=previous)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, turn_input, previous_response_id=previous)
        ran.answers.append(str(result.final_output))
        inputs, previous = result.to_input_list(), (result.last_response_id if responses else None)
    return ran


async def langchain(base_url: str, api_key: str, stream: bool = False) -> Ran:
    """LangChain's ``ChatOpenAI`` with ``bind_tools``: the tool loop of its docs (``ainvoke``, or ``astream`` with the
    chunks added up), appending the AI message and a ``ToolMessage`` per call."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    get_weather = tool(_weather)
    get_weather.name = "get_weather"
    llm = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key=api_key, temperature=0,
                     max_tokens=script.CLIENT_MAX_TOKENS, max_retries=0).bind_tools([get_weather])
    ran, messages = Ran(), [SystemMessage(script.CLIENT_SYSTEM)]
    for question in script.CLIENT_QUESTIONS:
        messages.append(HumanMessage(question))
        while True:
            if stream:
                ai = None
                async for chunk in llm.astream(messages):
                    ai = chunk if ai is None else ai + chunk
            else:
                ai = await llm.ainvoke(messages)
            messages.append(ai)
            if not ai.tool_calls:
                ran.answers.append(ai.text if isinstance(ai.text, str) else ai.text())
                break
            for call in ai.tool_calls:
                ran.calls.append((call["name"], call["args"]))
                messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    return ran


async def pydantic_ai(base_url: str, api_key: str, stream: bool = False) -> Ran:
    """pydantic-ai's ``Agent`` on ``OpenAIChatModel``: ``agent.run`` per question, the history carried with
    ``message_history=result.all_messages()``."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    ran = Ran()
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{base_url}/v1", api_key=api_key))
    agent = Agent(model, instructions=script.CLIENT_SYSTEM,
                  model_settings={"temperature": 0, "max_tokens": script.CLIENT_MAX_TOKENS})

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.calls.append(("get_weather", {"city": city}))
        return script.client_weather(city)

    history = None
    for question in script.CLIENT_QUESTIONS:
        if stream:
            async with agent.run_stream(question, message_history=history) as result:
                answer = await result.get_output()
            history = result.all_messages()
        else:
            result = await agent.run(question, message_history=history)
            answer, history = result.output, result.all_messages()
        ran.answers.append(answer)
    return ran


async def anthropic_sdk(base_url: str, api_key: str, stream: bool = False) -> Ran:
    """The Anthropic SDK's tool loop (``messages.create``, or ``messages.stream`` and its final message): the
    assistant's content blocks echoed back whole (thinking included), the tool results as ``tool_result`` blocks.
    The SDK no longer takes ``temperature`` (newer Claude models sample as they do): greedy decoding, which the
    tests need, goes in ``extra_body``."""
    from anthropic import AsyncAnthropic

    client = AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"name": "get_weather", "description": script.CLIENT_TOOL_DESCRIPTION,
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    ran, messages = Ran(), []
    for question in script.CLIENT_QUESTIONS:
        messages.append({"role": "user", "content": question})
        while True:
            args = dict(model=MODEL, max_tokens=script.CLIENT_MAX_TOKENS, system=script.CLIENT_SYSTEM, tools=tools,
                        messages=messages, extra_body={"temperature": 0})
            if stream:
                async with client.messages.stream(**args) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(**args)
            messages.append({"role": "assistant", "content": message.content})
            uses = [b for b in message.content if b.type == "tool_use"]
            if message.stop_reason != "tool_use":
                ran.answers.append("".join(b.text for b in message.content if b.type == "text"))
                break
            results = []
            for use in uses:
                ran.calls.append((use.name, dict(use.input)))
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": _weather(**use.input)})
            messages.append({"role": "user", "content": results})
    return ran


Driver = Callable[[str, str, bool], Awaitable[Ran]]
# name -> (driver, its stream flag): each way a client is used, as the tests run it
CLIENTS: dict[str, tuple[Driver, bool]] = {
    "openai": (openai_sdk, False),
    "openai-streamed": (openai_sdk, True),
    "openai-standard-fields": (openai_standard_fields, False),
    "openai-agents-chat": (openai_agents_chat, False),
    "openai-agents-chat-streamed": (openai_agents_chat, True),
    "openai-agents-responses": (openai_agents_responses, False),
    "langchain": (langchain, False),
    "langchain-streamed": (langchain, True),
    "pydantic-ai": (pydantic_ai, False),
    "anthropic": (anthropic_sdk, False),
    "anthropic-streamed": (anthropic_sdk, True),
}


async def run_client(name: str, base_url: str, api_key: str = "unused") -> Ran:
    driver, stream = CLIENTS[name]
    return await driver(base_url, api_key, stream)


# -- aiperf ---------------------------------------------------------------------------------------------------------

def aiperf_input(path: Path) -> Path:
    """aiperf's multi-turn input file for AIPERF_CONVERSATIONS (one conversation a line)."""
    lines = [json.dumps({"session_id": f"c{i}", "turns": [
        {"text": text, "output_length": script.CLIENT_MAX_TOKENS} for text, _ in conv]})
        for i, conv in enumerate(script.AIPERF_CONVERSATIONS)]
    path.write_text("\n".join(lines) + "\n")
    return path


async def run_aiperf(base_url: str, tokenizer_dir: Path, work: Path, api_key: str = "") -> dict:
    """aiperf multi-turn as its docs show, streaming, without --session-header, one conversation at a time; returns
    its JSON export (profile_export_aiperf.json)."""
    if not AIPERF.exists():
        raise FileNotFoundError(f"{AIPERF} is missing: `make install` installs aiperf into .aiperf")
    out = work / "aiperf"
    n = len(script.AIPERF_CONVERSATIONS)
    cmd = [str(AIPERF), "profile", "-m", MODEL, "--url", base_url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer_dir.resolve()), "--input-file", str(aiperf_input(work / "aiperf.jsonl")),
           "--custom-dataset-type", "multi_turn", "--conversation-num", str(n), "--concurrency", "1",
           "--use-server-token-count", "--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(out)]
    if api_key:
        cmd += ["--api-key", api_key]
    # aiperf refuses a local tokenizer directory under HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE (it takes the path
    # for a hub repo id); it reads only the directory given
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VIRTUAL_ENV")}
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                                cwd=work)
    output, _ = await asyncio.wait_for(proc.communicate(), 900)
    if proc.returncode:
        raise RuntimeError(f"aiperf failed ({proc.returncode}):\n{output.decode(errors='replace')[-4000:]}")
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json:\n{output.decode(errors='replace')[-2000:]}")
    return json.loads(found[-1].read_text())


if __name__ == "__main__":  # python tests/support/clients.py NAME BASE_URL: one client, its answers printed
    print(asyncio.run(run_client(sys.argv[1], sys.argv[2])))
