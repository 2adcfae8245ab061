"""vLLM's own tool-call parsers as a reference for ours (control_plane.tool_calls), run in a subprocess.

vLLM must not be imported into the pytest process (it crashes grpc_tools' protoc there later), so :func:`start`
runs this file as a script: it reads a JSON list of cases from one file, runs each through vLLM's non-streaming
``extract_tool_calls`` and writes a JSON list of results to another (not stdout: vLLM may print there):
``{"content": str | None, "calls": [[name, arguments], ...]}`` or ``{"error": "..."}``.

A case is ``{"parser": vLLM's name, "text": the answer's content, "tools": [OpenAI tool dicts] | None (the request's),
"vocab": "legacy" | "default"}``. The parsers only need a tokenizer that knows their special tokens; ``vocab``
picks the Mistral tokenizer generation (``legacy``: no ``[ARGS]`` token, so vLLM takes its pre-v11 path, the
``[TOOL_CALLS][...]`` JSON array).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support import child_reference

SPECIAL_TOKENS = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_start|>", "<|im_end|>"],
    "llama3_json": ["<|python_tag|>", "<|eom_id|>", "<|eot_id|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"],
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
              "</think>"],
}


class FakeTokenizer:
    """Just enough of a tokenizer for vLLM's tool parsers: a vocabulary holding the family's special tokens."""

    def __init__(self, tokens: list[str]):
        self._vocab = {token: 100 + i for i, token in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def _parser(name: str, vocab: str, tools):
    from vllm.tool_parsers import ToolParserManager

    tokens = [t for t in SPECIAL_TOKENS[name] if not (vocab == "legacy" and t == "[ARGS]")]
    return ToolParserManager.get_tool_parser(name)(FakeTokenizer(tokens), tools)


def _run(case: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    # vLLM parses tool calls only for a request with tools; with none given, one the answer does not call.
    tools = case.get("tools") or [{"type": "function", "function": {"name": "unused"}}]
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice="auto")
    parser = _parser(case["parser"], case.get("vocab", "default"), request.tools)
    info = parser.extract_tool_calls(case["text"], request)
    return {"content": info.content,
            "calls": [[c.function.name, c.function.arguments] for c in info.tool_calls] if info.tools_called else []}


def start(cases: list[dict], workdir: Path) -> subprocess.Popen:
    """Start vLLM on ``cases`` in a subprocess (tests/support/child_reference.py); :func:`results` collects them."""
    return child_reference.start("tests.support.vllm_reference", cases, workdir, "vllm_reference")


def results(proc: subprocess.Popen, timeout: float = 120) -> list[dict]:
    return child_reference.results(proc, timeout, "vLLM reference")


if __name__ == "__main__":
    child_reference.serve(_run)
