"""What each client (tests/support/clients.py) sends, captured: the conversation the agent model is trained on.

The clients run against the gateway's real HTTP front ends (chat completions, Responses, Messages: the same request
parsing, answer parsing and shapes as in production), on a stand-in runner that answers every turn with the agent
script's text for that step (kvshuttle.workers.agent_script: CLIENT_STEPS, AIPERF_CONVERSATIONS), as the trained
model will. What the runner is asked to render (the messages and the template's variables) is what the model will
see, and is written to CLIENT_CONVERSATIONS_FILE:

    .venv/bin/python -m tests.support.capture_clients      # after a client's version changes

tests/e2e/test_client_conversations.py captures again and fails when the file is stale.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvshuttle.services.common.http_server import HttpServer
from kvshuttle.services.gateway.apis.anthropic.routes import add_anthropic_routes
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.responses.routes import add_responses_routes
from kvshuttle.workers import agent_script as script
from kvshuttle.workers.model_builder import CLIENT_CONVERSATIONS_FILE, client_answer

from tests.support.auth import open_guard
from tests.support.clients import CLIENTS, REPO, run_aiperf, run_client
from tests.support.turn_fakes import AnsweredTurn, AnsweringRunner, StoredResponses

PARSERS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}


def step_of(messages: list[dict]) -> tuple[str, int]:
    """Which scripted answer a request asks for: ("client", step) or ("aiperf:<conversation>", turn), from its last
    user question and whether a tool result follows it."""
    last_user = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
    if last_user is None:
        raise ValueError("no user message")
    question = messages[last_user]["content"]
    if question in script.CLIENT_QUESTIONS:
        q = script.CLIENT_QUESTIONS.index(question)
        answered = any(m["role"] == "tool" for m in messages[last_user + 1:])
        return "client", min(2 * q + answered, len(script.CLIENT_STEPS) - 1)
    for c, conversation in enumerate(script.AIPERF_CONVERSATIONS):
        for t, (text, _) in enumerate(conversation):
            if question == text:
                return f"aiperf:{c}", t
    raise ValueError(f"no scripted answer for {question!r}")


def with_stable_ids(captured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``captured`` with the tool call ids (random: the gateway's, or the client's) numbered in order of appearance
    (no template renders them)."""
    ids: dict[str, str] = {}

    def stable(value: str) -> str:
        return ids.setdefault(value, f"call_{len(ids)}")

    out = copy.deepcopy(captured)
    for request in out:
        for message in request["messages"]:
            for call in message.get("tool_calls") or []:
                if "id" in call:
                    call["id"] = stable(call["id"])
            if "tool_call_id" in message:
                message["tool_call_id"] = stable(message["tool_call_id"])
    return out


class BodyRecorder:
    """ASGI middleware: keeps each request's path and JSON body, then lets the app read the body as sent."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False
        if scope["method"] == "POST":
            self.bodies.append((scope["path"], json.loads(body or b"{}")))

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def fields_sent(bodies: list[tuple[str, dict]]) -> dict[str, Any]:
    """What a client's requests carried: per path, the top-level fields, and the fields of its messages (chat,
    Messages) or input items (Responses) by role or type."""
    out: dict[str, Any] = {}
    for path, body in bodies:
        seen = out.setdefault(path, {"body": set(), "items": {}})
        seen["body"].update(body)
        for item in [*(body.get("messages") or []), *(body.get("input") if isinstance(body.get("input"), list) else [])]:
            kind = item.get("role") or item.get("type") or "?"
            seen["items"].setdefault(kind, set()).update(item)
    return {path: {"body": sorted(seen["body"]), "items": {k: sorted(v) for k, v in sorted(seen["items"].items())}}
            for path, seen in sorted(out.items())}


class ScriptedRunner(AnsweringRunner):
    """Answers each turn with its step's scripted text (the end marker left out, as the decode stage leaves it
    out), and keeps what it was asked to render."""

    def __init__(self):
        super().__init__("")
        self.registry = StoredResponses()
        self.captured: list[dict[str, Any]] = []

    async def prepare(self, req) -> AnsweredTurn:
        kind, step = step_of(req.messages)
        self.captured.append({"kind": kind, "step": step, "messages": copy.deepcopy(req.messages),
                              "template_vars": copy.deepcopy(req.template_vars)})
        self.answer = script.step_text(client_answer(kind, step)).removesuffix(script.END)
        return await super().prepare(req)


async def capture(name: str, tokenizer_dir: Path = REPO / "var" / "models" / "agent") -> tuple[
        list[dict[str, Any]], dict[str, Any]]:
    """What client ``name`` (a CLIENTS key, or "aiperf") sends in its conversation: the turns as the gateway read
    them, and the fields its requests carried (fields_sent). aiperf counts tokens with ``tokenizer_dir`` (the agent
    model's)."""
    runner = ScriptedRunner()
    app = create_app(runner, "agent", 64, **PARSERS)
    add_anthropic_routes(app)
    add_responses_routes(app)
    recorder = BodyRecorder(open_guard(app))
    server = HttpServer(recorder, "127.0.0.1:0")
    await server.start()
    try:
        base_url = f"http://{server.address}"
        if name == "aiperf":
            with tempfile.TemporaryDirectory() as work:
                await run_aiperf(base_url, tokenizer_dir, Path(work))
        else:
            await run_client(name, base_url)
    finally:
        await server.stop()
    return with_stable_ids(runner.captured), fields_sent(recorder.bodies)


async def capture_all(tokenizer_dir: Path = REPO / "var" / "models" / "agent") -> dict[str, dict[str, Any]]:
    """{"requests": {client: turns}, "fields": {client: fields_sent}} for every client."""
    out: dict[str, dict[str, Any]] = {"requests": {}, "fields": {}}
    for name in [*CLIENTS, "aiperf"]:
        out["requests"][name], out["fields"][name] = await capture(name, tokenizer_dir)
    return out


def main() -> int:
    captured = asyncio.run(capture_all())
    CLIENT_CONVERSATIONS_FILE.write_text(json.dumps(captured, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    print(f"wrote {CLIENT_CONVERSATIONS_FILE} ({sum(len(v) for v in captured['requests'].values())} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
