"""The same answer events through every API's speller (chat, Anthropic Messages, Responses), streamed and whole:
the three APIs say the same thing in their own shapes (control_plane/answer_blocks.py holds the rules once)."""

from __future__ import annotations

import json
from itertools import count

import pytest
from kvshuttle.control_plane.answer import Piece
from kvshuttle.control_plane.reasoning import CONTENT, REASONING
from kvshuttle.control_plane.tool_calls import ParsedCall
from kvshuttle.services.gateway.apis.anthropic.blocks import ContentBlocks, stop_reason
from kvshuttle.services.gateway.apis.openai.chat_answer import AnswerShape
from kvshuttle.services.gateway.apis.responses.output import OutputBuilder


def R(text: str) -> Piece:
    return Piece(REASONING, text)


def C(text: str) -> Piece:
    return Piece(CONTENT, text)


def call(index: int, name: str, **arguments) -> ParsedCall:
    return ParsedCall(index, name, json.dumps(arguments))


# events -> what every API must say: (reasoning, text, [(name, arguments)]) with all calls kept, and with
# parallel_tool_calls false
TABLE = {
    "text": ([C("Hello"), C(" world")], (None, "Hello world", [])),
    "empty": ([], (None, None, [])),
    "only whitespace": ([C("  "), C("\n")], (None, "  \n", [])),
    "reasoning then text": ([R("think "), R("hard"), C("\n\n"), C("Paris")], ("think hard", "\n\nParis", [])),
    "reasoning only": ([R("hmm")], ("hmm", None, [])),
    "blank line before a call": ([R("plan"), C("\n\n"), call(0, "now", tz="UTC")],
                                 ("plan", None, [("now", {"tz": "UTC"})])),
    "text, call, trailing blank": ([C("Let me check."), call(0, "now"), C("\n")],
                                   (None, "Let me check.", [("now", {})])),
    "two calls": ([call(0, "a", x=1), C("\n"), call(1, "b", y=2)], (None, None, [("a", {"x": 1}), ("b", {"y": 2})])),
    "a parser numbering from 1": ([call(1, "b", y=2), call(2, "c")], (None, None, [("b", {"y": 2}), ("c", {})])),
    "text around reasoning": ([C("a"), R("r"), C(" "), C("b")], ("r", "a b", [])),
}


def first_call_only(expected):
    reasoning, text, calls = expected
    return reasoning, text, calls[:1]


def ids():
    n = count()
    return lambda: f"id{next(n)}"


# -- each API's output, read back into (reasoning, text, calls) -------------------------------------------------------

def chat_whole(events, parallel):
    shape = AnswerShape(parsed=True, parallel_tool_calls=parallel, new_id=ids())
    message, called = shape.message("", events)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    finish = shape.finish_reason("stop")
    assert called == bool(calls) and finish == ("tool_calls" if calls else "stop")
    return message.get("reasoning_content"), message["content"], calls


def chat_stream(events, parallel):
    shape = AnswerShape(parsed=True, parallel_tool_calls=parallel, new_id=ids())
    deltas = [d for e in events for d in shape.deltas([e])] + shape.finish_deltas()
    reasoning = text = None
    calls: dict[int, list] = {}
    for d in deltas:
        if "reasoning_content" in d:
            assert d["reasoning"] == d["reasoning_content"]
            reasoning = (reasoning or "") + d["reasoning_content"]
        if "content" in d:
            text = (text or "") + d["content"]
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc["function"].get("name", "")
            entry[1] += tc["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... among the kept calls
    out = [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]
    assert shape.finish_reason("length") == ("tool_calls" if out else "length")
    return reasoning, text, out


def _from_blocks(blocks):
    reasoning = "".join(b["thinking"] for b in blocks if b["type"] == "thinking") or None
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    return reasoning, "".join(texts) if texts else None, calls


def anthropic_whole(events, parallel):
    blocks = ContentBlocks(parallel, new_id=ids())
    blocks.finish(events)
    reason, _ = stop_reason("stop", "", [], bool(blocks.calls))
    assert reason == ("tool_use" if blocks.calls else "end_turn")
    return _from_blocks(blocks.content)


def anthropic_stream(events, parallel):
    blocks = ContentBlocks(parallel, new_id=ids())
    stream = [e for ev in events for e in blocks.feed([ev])] + blocks.finish()
    built: list[dict] = []
    open_at = None
    for kind, payload in stream:
        assert payload["type"] == kind
        if kind == "content_block_start":
            assert open_at is None and payload["index"] == len(built)
            built.append(dict(payload["content_block"]))
            open_at = payload["index"]
            if built[-1]["type"] == "tool_use":
                built[-1]["partial"] = ""
        elif kind == "content_block_delta":
            assert payload["index"] == open_at
            delta, block = payload["delta"], built[open_at]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                block["partial"] += delta["partial_json"]
        else:
            assert payload["index"] == open_at
            open_at = None
    assert open_at is None  # every block closed
    for block in built:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial"))
    assert built == blocks.content  # the stream builds exactly the whole answer's content
    return _from_blocks(built)


def _from_items(items):
    reasoning = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning") or None
    texts = [i["content"][0]["text"] for i in items if i["type"] == "message"]
    calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
    return reasoning, "".join(texts) if texts else None, calls


def responses_whole(events, parallel):
    out = OutputBuilder(parallel_tool_calls=parallel)
    out.finish(events)
    return _from_items(out.items)


def responses_stream(events, parallel):
    out = OutputBuilder(parallel_tool_calls=parallel)
    stream = [e for ev in events for e in out.feed([ev])] + out.finish()
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    items: dict[int, dict] = {}
    done: dict[int, dict] = {}
    for e in stream:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(items)
            items[e["output_index"]] = {**e["item"], "text": ""}
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["text"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            done[e["output_index"]] = e["item"]
    assert list(done) == list(items) == list(range(len(out.items)))  # every item added and done, in order
    for index, item in items.items():
        if item["type"] in ("reasoning", "message"):
            assert done[index]["content"][0]["text"] == item["text"]  # the deltas spell the item's text
    assert [done[i] for i in range(len(done))] == out.items
    return _from_items(out.items)


SPELLERS = [chat_whole, chat_stream, anthropic_whole, anthropic_stream, responses_whole, responses_stream]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "first call only"])
@pytest.mark.parametrize("name", list(TABLE))
def test_every_api_says_the_same_answer(name, parallel):
    events, expected = TABLE[name]
    if not parallel:
        expected = first_call_only(expected)
    reasoning, text, calls = expected
    said = {speller.__name__: speller(events, parallel) for speller in SPELLERS}
    for speller, answer in said.items():
        got_reasoning, got_text, got_calls = answer
        # chat names no empty content; the block APIs have no block for it: both say None
        assert (got_reasoning, got_text, got_calls) == (reasoning, text, calls), (speller, answer)


def test_blocks_follow_the_answer_s_order_in_the_block_apis():
    events = [R("a"), C("b"), call(0, "f"), C("c"), R("d")]
    blocks = ContentBlocks(new_id=ids())
    blocks.finish(events)
    assert [b["type"] for b in blocks.content] == ["thinking", "text", "tool_use", "text", "thinking"]
    out = OutputBuilder()
    out.finish(events)
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call", "message", "reasoning"]


def test_chat_drops_reasoning_when_the_request_says_so():
    shape = AnswerShape(parsed=True, include_reasoning=False)
    message, _ = shape.message("", [R("secret"), C("answer")])
    assert message == {"role": "assistant", "content": "answer"}
    stream = AnswerShape(parsed=True, include_reasoning=False)
    assert stream.deltas([R("secret")]) == [] and stream.deltas([C("answer")]) == [{"content": "answer"}]
