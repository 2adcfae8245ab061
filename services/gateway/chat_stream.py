"""A client-side streamed chat turn against the gateway's OpenAI API (SSE), timed: the demo and the benchmark."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


class StreamError(Exception):
    """The gateway refused the turn or the stream broke off."""


@dataclass
class StreamedTurn:
    ttft_ms: float  # request sent -> first content delta
    latency_ms: float  # request sent -> end of the stream
    text: str
    kv: dict = field(default_factory=dict)  # the gateway's `kvshuttle` object: decision, reason, tokens, timings
    usage: dict = field(default_factory=dict)


async def stream_chat(client: httpx.AsyncClient, session: str, body: dict) -> StreamedTurn:
    """POST /v1/chat/completions with ``stream: true`` (usage included) for ``session``; gathers the stream."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    text, kv, usage = "", {}, {}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": session}) as resp:
        if resp.status_code != 200:
            raise StreamError(f"gateway answered {resp.status_code}: {(await resp.aread()).decode()[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(f"stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
            kv = chunk.get("kvshuttle", kv)
            usage = chunk.get("usage") or usage
    ended = time.perf_counter()
    if not kv or not usage:
        raise StreamError("the stream ended without usage and kvshuttle figures")
    return StreamedTurn(((first or ended) - started) * 1000, (ended - started) * 1000, text, kv, usage)
