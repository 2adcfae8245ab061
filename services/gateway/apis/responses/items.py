"""A conversation's items (``message``, ``function_call``, ``function_call_output``, ``reasoning``): the request's
input as canonical items (what is stored), items as the chat template's messages, output items as stored items, and
stored items as ``input_items`` lists them."""

from __future__ import annotations

import json
from typing import Any

from kvshuttle.services.gateway.turns.errors import FieldError
from kvshuttle.services.gateway.turns.tools import check_tool_results
from kvshuttle.v1 import registry_pb2


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(where, "content must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError(f"{where}.{j}", f"content part of type {kind!r} is not supported here (only "
                                             f"{', '.join(kinds)})")
        out.append(part["text"])
    return "\n".join(out)


_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}


def normalized_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as canonical items (what is stored and rendered); FieldError naming the bad one."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    items = []
    for i, item in enumerate(raw):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str) or kind not in _ITEM_KEYS:
            raise FieldError(f"{where}.type", f"input item of type {kind!r} is not supported (only "
                                              f"{', '.join(_ITEM_KEYS)})")
        extra = sorted(set(item) - _ITEM_KEYS[kind])
        if extra:
            raise FieldError(f"{where}.{extra[0]}", f"unsupported field(s) in a {kind} item: {', '.join(extra)}")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldError(f"{where}.role", f"role must be user, system, developer or assistant, got {role!r}")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            items.append({"type": "message", "role": role, "content": _text_of(item.get("content"),
                                                                                f"{where}.content", kinds)})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
                    raise FieldError(f"{where}.{name}", f"a function_call item needs {name} as a string")
            items.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise FieldError(f"{where}.call_id", "a function_call_output item needs the call_id it answers")
            items.append({"type": "function_call_output", "call_id": item["call_id"],
                          "output": _text_of(item.get("output"), f"{where}.output", ("input_text",))})
        else:
            if item.get("encrypted_content"):
                raise FieldError(f"{where}.encrypted_content", "encrypted reasoning is not supported")
            text = _text_of(item.get("content") or [], f"{where}.content", ("reasoning_text",))
            summary = _text_of(item.get("summary") or [], f"{where}.summary", ("summary_text",))
            items.append({"type": "reasoning", "text": text or summary})
    return items


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation's items as the chat template's messages: consecutive reasoning, assistant text and function
    calls make one assistant message; function outputs are tool messages (each must answer an earlier call)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    fields: dict[int, str] = {}
    turn: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for i, item in enumerate(items):
        kind = item["type"]
        if kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant"):
            turn = turn or {"role": "assistant", "content": ""}
            if kind == "reasoning":
                turn["reasoning_content"] = turn["reasoning"] = turn.get("reasoning_content", "") + item["text"]
            elif kind == "message":
                turn["content"] += item["content"]
            else:
                try:
                    arguments = json.loads(item["arguments"]) if item["arguments"].strip() else {}
                except ValueError as exc:
                    raise FieldError(f"input.{i}.arguments", f"arguments are not valid JSON ({exc})") from None
                if not isinstance(arguments, dict):
                    raise FieldError(f"input.{i}.arguments", "arguments must be a JSON object")
                turn.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": arguments}})
            continue
        flush()
        if kind == "function_call_output":
            fields[len(messages)] = "input"  # the conversation's items: the previous responses' and this input's
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": item["role"], "content": item["content"]})
    flush()
    check_tool_results(messages, fields, id_name="call_id", call_name="function_call")
    return messages


def stored_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as conversation items (what normalized_items gives for them when a client sends them back)."""
    out = []
    for item in output:
        if item["type"] == "reasoning":
            out.append({"type": "reasoning", "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            out.append({"type": "message", "role": "assistant", "content": item["content"][0]["text"]})
        else:
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
    return out


def conversation_items(chain: list[tuple[registry_pb2.StoredResponse, dict[str, Any]]]) -> list[tuple[str, dict]]:
    """(item id, item) for every item the last response's turn was given, oldest first: each earlier response's
    input and output items, then the last one's input. Output items keep their ids; input items are named after their
    response and place (``item_{response}_{n}``), the same on every read."""
    out: list[tuple[str, dict[str, Any]]] = []
    for n, (entry, body) in enumerate(chain):
        items, output = body["items"], body["response"].get("output") or []
        inputs = len(items) - len(output)  # a body's items: its input, then its output (one item per output item)
        tag = entry.response_id.removeprefix("resp_")
        out += [(f"item_{tag}_{i}", item) for i, item in enumerate(items[:inputs])]
        if n < len(chain) - 1:
            out += [(produced.get("id") or f"item_{tag}_{inputs + j}", item)
                    for j, (produced, item) in enumerate(zip(output, items[inputs:], strict=False))]
    return out


def api_item(item_id: str, item: dict[str, Any]) -> dict[str, Any]:
    """A stored conversation item as the Responses API lists it."""
    kind = item["type"]
    if kind == "message":
        text = {"type": "input_text", "text": item["content"]} if item["role"] != "assistant" else {
            "type": "output_text", "text": item["content"], "annotations": []}
        return {"id": item_id, "type": "message", "role": item["role"], "status": "completed", "content": [text]}
    if kind == "function_call":
        return {"id": item_id, "type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        return {"id": item_id, "type": "function_call_output", "call_id": item["call_id"], "output": item["output"],
                "status": "completed"}
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": item["text"]}]}
