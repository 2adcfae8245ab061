"""A client-side streamed chat turn against the gateway's OpenAI API (SSE), timed: the demo and the benchmark."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class StreamError(Exception):
    """The gateway refused the turn or the stream broke off."""


@dataclass
class StreamedTurn:
    ttft_ms: float  # request sent -> first generated token (its content, or a chunk carrying its logprobs or id)
    latency_ms: float  # request sent -> end of the stream
    text: str  # the answer's content
    kv: dict = field(default_factory=dict)  # the gateway's `kvshuttle` object: decision, reason, tokens, timings
    usage: dict = field(default_factory=dict)
    # The answer as a client echoes it back: role, content (None when it only called tools), reasoning_content when
    # there was reasoning, tool_calls (ids, names, arguments) when it called tools.
    message: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


def _first_token(choice: dict[str, Any]) -> bool:
    """Whether a chunk's choice carries generated output: text, reasoning, a call, or (while a parser holds the text
    back) the logprobs or ids of its tokens."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or choice.get("logprobs") or choice.get("token_ids"))


async def stream_chat(client: httpx.AsyncClient, session: str | None, body: dict, *,
                      kvshuttle: bool = True) -> StreamedTurn:
    """POST /v1/chat/completions with ``stream: true`` (usage included) for ``session`` (None: no session header);
    gathers the stream. ``kvshuttle=False`` talks to another OpenAI server (the bench's SMG mode): no ``kvshuttle``
    figures are expected.

    The first token is the first chunk with output: a tool call's text is held by the gateway's parser until the call
    is whole, so a request that must time it asks for ``logprobs`` (or ``return_token_ids``), whose chunks come with
    every token."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    text, reasoning, kv, usage, finish = "", "", {}, {}, None
    calls: dict[int, dict[str, Any]] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"X-Session-ID": session} if session else {}) as resp:
        if resp.status_code != 200:
            raise StreamError(f"gateway answered {resp.status_code}: {(await resp.aread()).decode()[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(f"stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if first is None and _first_token(choice):
                    first = time.perf_counter()
                delta = choice.get("delta") or {}
                text += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or ""
                for tc in delta.get("tool_calls") or []:
                    fn = tc.get("function") or {}
                    call = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                          "function": {"name": fn.get("name"), "arguments": ""}})
                    call["function"]["arguments"] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
            kv = chunk.get("kvshuttle", kv)
            usage = chunk.get("usage") or usage
    ended = time.perf_counter()
    if not usage or (kvshuttle and not kv):
        raise StreamError("the stream ended without usage" + (" and kvshuttle figures" if kvshuttle else ""))
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return StreamedTurn(((first or ended) - started) * 1000, (ended - started) * 1000, text, kv, usage, message,
                        finish)
