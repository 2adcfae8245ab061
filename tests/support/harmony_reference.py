"""Harmony (gpt-oss) answers as the reference parses them, for control_plane/harmony.py's tests.

Two references, both on the answer's token ids (the text encoded with the o200k_harmony vocabulary, every special
token's text read as the special token):

- :func:`harmony_messages`: the messages ``openai_harmony`` itself parses, in this process (it loads fast), token by
  token as vLLM feeds it (a token it refuses is skipped; a message still open in its header at the end is the text of
  its tokens, on the ``final`` channel);
- :func:`start` / :func:`results`: vLLM's own ``HarmonyParser.parse`` (vllm/parser/harmony.py, what its chat
  completions report), run in a subprocess as tests/support/vllm_reference.py runs vLLM's tool parsers (vLLM must not
  be imported into the pytest process). A case is ``{"text": the answer, "reasoning": bool, "tools": bool}`` (which of
  vLLM's two parsers are set); a result ``{"reasoning", "content", "calls": [[name, arguments], ...]}`` or
  ``{"error": "..."}``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from tests.support import child_reference

_encoding = None


def encoding() -> Any:
    global _encoding
    if _encoding is None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    return _encoding


def tokens(text: str) -> list[int]:
    return encoding().encode(text, allowed_special="all")


def harmony_messages(text: str, *, answer: bool = True) -> list[dict[str, Any]]:
    """The answer's messages as openai_harmony parses them for vLLM: ``{"role", "channel", "recipient",
    "content_type", "text"}`` each. ``answer`` false: ``text`` starts with a ``<|start|>`` of its own (the parser is
    not told that the first message is the assistant's)."""
    from openai_harmony import HarmonyError, Role, StreamableParser

    parser = StreamableParser(encoding(), role=Role.ASSISTANT if answer else None)
    done, current = 0, []
    for token in tokens(text):
        try:
            parser.process(token)
        except HarmonyError:
            continue  # as vLLM does: the token is dropped
        if len(parser.messages) > done:
            done, current = done + 1, []
        else:
            current.append(token)
    try:
        parser.process_eos()
    except HarmonyError:  # ended in a header: vLLM makes the message's tokens the final channel's text
        recovered = {"role": "assistant", "channel": "final", "recipient": None, "content_type": None,
                     "text": encoding().decode(current)}
        return [*map(_message, parser.messages), recovered]
    return list(map(_message, parser.messages))


def _message(message: Any) -> dict[str, Any]:
    return {"role": message.author.role.value, "channel": message.channel, "recipient": message.recipient,
            "content_type": message.content_type, "text": message.content[0].text if message.content else ""}


# -- vLLM's HarmonyParser, in a subprocess ---------------------------------------------------------------------------


class _Tokenizer:
    """Just enough of gpt-oss's tokenizer for vLLM's HarmonyParser: decoding (what it recovers from a cut-off header)."""

    def get_vocab(self) -> dict[str, int]:
        return {}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return encoding().decode(ids)


def _run(case: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    parser_cls = ParserManager.get_parser(tool_parser_name="openai" if case["tools"] else None,
                                          reasoning_parser_name="openai_gptoss" if case["reasoning"] else None,
                                          enable_auto_tools=True, is_harmony=True)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="auto",
                                    tools=[{"type": "function", "function": {"name": "unused"}}])
    parser = parser_cls(_Tokenizer(), request.tools)
    reasoning, content, calls = parser.parse(case["text"], request, enable_auto_tools=True,
                                             model_output_token_ids=tokens(case["text"]))
    return {"reasoning": reasoning, "content": content, "calls": [[c.name, c.arguments] for c in calls or []]}


def start(cases: list[dict], workdir: Path) -> subprocess.Popen:
    """Start vLLM's parser on ``cases`` in a subprocess (tests/support/child_reference.py); :func:`results` collects them."""
    return child_reference.start("tests.support.harmony_reference", cases, workdir, "harmony")


def results(proc: subprocess.Popen, timeout: float = 180) -> list[dict]:
    return child_reference.results(proc, timeout, "vLLM harmony reference")


if __name__ == "__main__":
    child_reference.serve(_run)
