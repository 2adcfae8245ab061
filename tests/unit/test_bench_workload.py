"""The benchmark's workloads: generated agentic conversations (tools, tool calls, tool results) and OpenAI-messages
files."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from kvshuttle.services.devtools.bench.workload import (
    CALL_MIN_TOKENS,
    CALLED_TOOLS,
    TOOLS,
    Conversation,
    Turn,
    agentic_conversations,
    conversation_messages,
    estimate_tokens,
    estimated_history_tokens,
    load_conversations,
    save_conversations,
    tools_tokens,
)

CPU = dict(max_history_tokens=6000, system_tokens=1000, turn_tokens=(150, 600), max_tokens=32)
GPU = dict(max_history_tokens=32000, system_tokens=2000, turn_tokens=(300, 2000), max_tokens=128)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# agentic_conversations


def test_same_seed_same_conversations_and_different_seed_differs():
    a = agentic_conversations(count=3, seed=7, **CPU)
    b = agentic_conversations(count=3, seed=7, **CPU)
    c = agentic_conversations(count=3, seed=8, **CPU)
    assert a == b
    assert [x.id for x in a] != [x.id for x in c]
    for x, y in zip(a, c, strict=True):
        assert x.system != y.system
        assert x.turns[0].user != y.turns[0].user
        assert x.tools != y.tools  # they name the session's checkout
        assert [t.call for t in x.turns] != [t.call for t in y.turns]


def test_log_spread_turn_sizes_cover_small_and_large_new_parts():
    """--turn-tokens-spread log: as many turns of 100-1k (estimated) tokens as of 1k-10k; uniform has few small ones.
    The default is uniform, drawn as before."""
    shape = dict(max_history_tokens=60000, system_tokens=1000, turn_tokens=(100, 10000), max_tokens=32)

    def sizes(spread):
        convs = agentic_conversations(count=8, seed=5, spread=spread, **shape)
        return [estimate_tokens(t.text()) for c in convs for t in c.turns[:-1]]  # the last may be shortened

    log, uniform = sizes("log"), sizes("uniform")
    assert all(80 <= n <= 10500 for n in log) and len(log) > 60
    assert 0.35 < sum(n < 1000 for n in log) / len(log) < 0.65
    assert sum(n < 1000 for n in uniform) / len(uniform) < 0.2
    assert agentic_conversations(count=2, seed=3, **CPU) == agentic_conversations(count=2, seed=3, spread="uniform",
                                                                                   **CPU)
    with pytest.raises(ValueError, match="spread must be one of uniform, log"):
        agentic_conversations(count=1, seed=0, spread="normal", **CPU)


def test_conversation_is_independent_of_count():
    few = agentic_conversations(count=2, seed=3, **CPU)
    many = agentic_conversations(count=5, seed=3, **CPU)
    assert many[:2] == few


def test_conversations_share_no_prefix():
    convs = agentic_conversations(count=6, seed=1, **CPU)
    assert len({c.id for c in convs}) == 6
    for c in convs:
        assert re.match(r"Session [0-9a-f]{12}: you are a coding agent working in repository \S+/\S+\.", c.system)
    for i, a in enumerate(convs):
        for b in convs[i + 1:]:
            assert _common_prefix(a.system, b.system) < len("Session ") + 4
            # Templates render the tools first: they differ early too (the first one names the session).
            ta, tb = json.dumps(a.tools), json.dumps(b.tools)
            assert _common_prefix(ta, tb) < ta.index('"description"') + 80


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_conversations_are_agent_loops_with_tool_calls_and_tool_results(seed):
    """Every request carries the tools (OpenAI function tools, JSON-schema parameters, none required so that a forced
    call may be `{}`); the first turn is the user's task; every turn but the last ends in a call of one of the tools
    whose results the workload makes, and the next turn carries that tool's result (and sometimes a user
    instruction)."""
    convs = agentic_conversations(count=6, seed=seed, **CPU)
    names = [name for name, _, _ in TOOLS]
    called = {name for name, _ in CALLED_TOOLS}
    seen_calls, with_instruction = set(), 0
    for c in convs:
        assert [t["type"] for t in c.tools] == ["function"] * len(TOOLS)
        assert [t["function"]["name"] for t in c.tools] == names
        for tool in c.tools:
            assert list(tool["function"]) == ["name", "description", "parameters"]  # as the gateway spells them
            params = tool["function"]["parameters"]
            Draft202012Validator.check_schema(params)
            assert params["type"] == "object" and "required" not in params
            assert all(p["type"] in ("string", "integer") and p["description"] for p in params["properties"].values())
            Draft202012Validator(params).validate({})  # the call a forced, biased test model writes
        first, *later = c.turns
        assert first.tool_results == [] and first.user
        assert [t.call is not None for t in c.turns] == [True] * (len(c.turns) - 1) + [False]
        for before, turn in zip(c.turns, later, strict=False):
            assert before.call in called
            assert len(turn.tool_results) == 1
            result = turn.tool_results[0]
            if before.call == "read_file":
                assert result.startswith("[File: ")
            elif before.call == "run_tests":
                assert result.startswith("===") and "test session starts" in result.splitlines()[0]
            else:
                assert re.match(r"[\w/]+\.py:\d+:", result)
            with_instruction += turn.user is not None
            seen_calls.add(before.call)
        for turn in c.turns:
            assert turn.max_tokens == CPU["max_tokens"]
            assert turn.answer_tokens == (max(CPU["max_tokens"], CALL_MIN_TOKENS) if turn.call else CPU["max_tokens"])
    assert seen_calls == called
    later_turns = sum(len(c.turns) - 1 for c in convs)
    assert 0.1 * later_turns < with_instruction < 0.6 * later_turns


def test_every_tool_message_answers_the_call_just_before_it():
    for c in agentic_conversations(count=4, seed=5, **CPU):
        messages = conversation_messages(c)
        assert messages[0] == {"role": "system", "content": c.system}
        assert messages[1]["role"] == "user"
        open_ids: set[str] = set()
        previous = None
        calls = 0
        for m in messages[1:]:
            if m["role"] == "tool":
                assert m["tool_call_id"] in open_ids and previous in ("assistant", "tool")
            elif m["role"] == "assistant":
                assert previous in ("user", "tool") and m["content"] is None
                [call] = m["tool_calls"]
                assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {}
                open_ids = {call["id"]}
                calls += 1
            else:
                assert m["role"] == "user"
            previous = m["role"]
        assert previous in ("tool", "user")  # the last turn: no call
        assert calls == len(c.turns) - 1


@pytest.mark.parametrize("params", [CPU, GPU], ids=["cpu", "gpu"])
def test_sizes_stay_within_bounds(params):
    lo, hi = params["turn_tokens"]
    convs = agentic_conversations(count=4, seed=11, **params)
    for c in convs:
        total = estimated_history_tokens(c)
        assert total <= params["max_history_tokens"]
        # Stopped only because the next turn would not fit (not at max_turns here).
        assert len(c.turns) < 64
        assert total > params["max_history_tokens"] - params["max_tokens"] - lo
        # The system prompt and the tool definitions fill the system budget together.
        fixed = estimate_tokens(c.system) + tools_tokens(c.tools)
        assert 0.9 * params["system_tokens"] <= fixed <= params["system_tokens"] + 2
        assert c.max_tokens == [params["max_tokens"]] * len(c.turns)
        for turn in c.turns:
            assert 0.9 * lo <= estimate_tokens(turn.text()) <= hi
    turns = [len(c.turns) for c in convs]
    assert min(turns) >= 2


def test_tiny_turns_stay_within_bounds():
    convs = agentic_conversations(count=3, seed=13, max_history_tokens=1200, system_tokens=0, turn_tokens=(3, 12),
                                  max_tokens=4, max_turns=64)
    for c in convs:
        assert estimated_history_tokens(c) <= 1200
        assert len(c.turns) == 64 or estimated_history_tokens(c) > 1200 - 4 - 3
        for turn in c.turns:
            assert 1 <= estimate_tokens(turn.text()) <= 12


def test_turn_sizes_vary_uniformly():
    convs = agentic_conversations(count=4, seed=5, max_history_tokens=100_000, system_tokens=500,
                                  turn_tokens=(200, 1000), max_tokens=16, max_turns=40)
    sizes = [estimate_tokens(t.text()) for c in convs for t in c.turns]
    assert len(sizes) == 160
    assert min(sizes) < 350 and max(sizes) > 850  # spread across the range, not a constant size
    assert 450 < sum(sizes) / len(sizes) < 750


def test_max_turns_caps_the_conversation():
    convs = agentic_conversations(count=2, seed=2, max_history_tokens=50_000, system_tokens=300,
                                  turn_tokens=(100, 200), max_tokens=8, max_turns=5)
    assert [len(c.turns) for c in convs] == [5, 5]
    assert [t.call is None for t in convs[0].turns] == [False] * 4 + [True]
    one = agentic_conversations(count=1, seed=2, max_history_tokens=50_000, system_tokens=300,
                                turn_tokens=(100, 200), max_tokens=8, max_turns=1)[0]
    assert [(t.tool_results, t.call) for t in one.turns] == [([], None)]


def test_tokens_per_char_scales_text_length():
    params = dict(CPU, system_tokens=3000, max_history_tokens=9000)
    base = agentic_conversations(count=1, seed=4, **params)[0]
    dense = agentic_conversations(count=1, seed=4, tokens_per_char=0.6, **params)[0]
    assert estimate_tokens(dense.system, 0.6) + tools_tokens(dense.tools, 0.6) <= 3000
    assert len(dense.system) < 0.6 * len(base.system)


def test_without_system_prompt_first_turn_is_unique():
    convs = agentic_conversations(count=3, seed=9, max_history_tokens=3000, system_tokens=0, turn_tokens=(200, 400),
                                  max_tokens=16)
    for c in convs:
        assert c.system is None
        assert c.turns[0].user.startswith("Session ")
    assert _common_prefix(convs[0].turns[0].user, convs[1].turns[0].user) < len("Session ") + 4


def test_tool_results_are_real_stdlib_sources():
    convs = agentic_conversations(count=3, seed=6, **CPU)
    checked = 0
    for text in (r for c in convs for t in c.turns for r in t.tool_results):
        m = re.match(r"\[File: (\S+) \((\d+) lines total\)\]\n", text)
        if not m:
            continue
        module = m.group(1).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        source = Path(importlib.util.find_spec(module).origin).read_text().splitlines()
        assert int(m.group(2)) == len(source)
        block = text[m.end():].splitlines()
        for line in block[:-1]:  # the last line may be cut
            number, _, code = line.partition("\t")
            assert source[int(number) - 1] == code
        numbers = [int(line.partition("\t")[0]) for line in block]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        checked += 1
    assert checked >= 5


def test_plain_conversations_write_the_tool_results_into_user_turns():
    conv = agentic_conversations(count=1, seed=3, **CPU)[0]
    plain = conv.plain()
    assert plain.tools is None and plain.id == conv.id
    assert plain.system.startswith(conv.system) and '"name": "read_file"' in plain.system
    assert len(plain.turns) == len(conv.turns)
    for k, (p, t) in enumerate(zip(plain.turns, conv.turns, strict=True)):
        assert p.tool_results == [] and p.call is None and p.max_tokens == t.max_tokens
        if k:
            assert p.user.startswith(f"Tool result of {conv.turns[k - 1].call}:\n{t.tool_results[0]}")
        assert p.user.endswith(t.user or t.tool_results[-1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(turn_tokens=(0, 10)), "turn_tokens"),
    (dict(turn_tokens=(50, 10)), "turn_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_history_tokens=1100), "no room for one turn"),
    (dict(system_tokens=0, max_history_tokens=800), "no room for one turn: system prompt and tools"),
    (dict(count=-1), "count"),
])
def test_bad_arguments(kwargs, message):
    params = dict(CPU, count=1, seed=0)
    params.update(kwargs)
    with pytest.raises(ValueError, match=message):
        agentic_conversations(**params)


# ---------------------------------------------------------------------------------------------------------------
# load_conversations / save_conversations


def _write(tmp_path: Path, data, name: str = "convs.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _user(text: str, budget: int) -> Turn:
    return Turn([], text, None, budget)


def test_load_openai_messages(tmp_path):
    path = _write(tmp_path, [
        {"id": "a", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "x" * 100},  # 30 tokens estimated
            {"role": "user", "content": "part one"},
            {"role": "user", "content": [{"type": "text", "text": "part "}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "y" * 1000},  # 300 estimated: capped at 64
            {"role": "user", "content": "last"},
        ]},
        {"conversation_id": 17, "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "ok"},  # 0.6 tokens: at least 1
            {"role": "assistant", "content": None},
        ]},
    ])
    a, b = load_conversations(path, max_tokens=64)
    assert a == Conversation(id="a", system="be brief", turns=[
        _user("hello", 30), _user("part one\n\npart two", 64), _user("last", 64)])
    assert b == Conversation(id="17", system=None, turns=[_user("q", 1)])
    assert a.tools is None and a.max_tokens == [30, 64, 64]


TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


def _call(call_id: str, name: str = "read_file", arguments: str = '{"path": "a.py"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_load_tool_calls_and_tool_messages(tmp_path):
    """An assistant message's calls name the function its turn calls; the tool messages answering them (and a user
    message after them) are the next turn; several calls are replayed as one call of the first function."""
    grep = {"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}
    path = _write(tmp_path, [{"id": "agent", "tools": [TOOL, grep], "messages": [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "1\tdef f(): pass"},
        {"role": "assistant", "content": "two at once", "tool_calls": [_call("c2", "grep", "{}"), _call("c3")]},
        {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "b.py"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "a.py:1:def f"},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "done, " * 20},
    ]}])
    [conv] = load_conversations(path, max_tokens=64)
    # Budgets: the answers' estimated lengths, calls included (9 + 16, 11 + 4 + 2 + 9 + 16, 120 characters).
    assert conv.turns == [Turn([], "fix it", "read_file", 8),
                          Turn(["1\tdef f(): pass"], None, "grep", 13),
                          Turn(["b.py", "a.py:1:def f"], "and now?", None, 36)]
    assert conv.tools == [TOOL, {"type": "function", "function": {"name": "grep", "description": None,
                                                                  "parameters": {"type": "object"}}}]


def test_load_tool_calls_without_tool_definitions(tmp_path):
    path = _write(tmp_path, [{"id": "x", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [_call("c1", "list_dir", "")]},  # no content: fine for calls
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]}])
    [conv] = load_conversations(path, max_tokens=8)
    assert conv.turns == [Turn([], "go", "list_dir", 2), Turn(["a.py"], None, None, 8)]
    assert conv.tools == [{"type": "function", "function": {"name": "list_dir", "description": None,
                                                            "parameters": {"type": "object"}}}]


def test_load_max_turns_and_limit(tmp_path):
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"u{j}"} if k % 2 == 0 else
                                          {"role": "assistant", "content": "a" * 10}
                                          for j in range(3) for k in range(2)]} for i in range(4)]
    path = _write(tmp_path, convs)
    loaded = load_conversations(path, max_tokens=50, max_turns=2, limit=3)
    assert [c.id for c in loaded] == ["c0", "c1", "c2"]
    assert [t.user for t in loaded[0].turns] == ["u0", "u1"]
    assert loaded[0].max_tokens == [3, 3]


def test_load_jsonl(tmp_path):
    lines = [json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}), "",
             json.dumps({"id": "y", "messages": [{"role": "user", "content": "yo"}]})]
    path = _write(tmp_path, "\n".join(lines), name="convs.jsonl")
    assert [c.id for c in load_conversations(path, max_tokens=8)] == ["x", "y"]


def test_save_then_load_round_trips(tmp_path):
    convs = agentic_conversations(count=2, seed=12, **CPU)
    convs.append(Conversation(id="plain", system=None, turns=[_user("one", 32), _user("two ✓", 32)]))
    convs.append(dataclasses.replace(convs[0].plain(), id="as-plain"))
    path = save_conversations(convs, tmp_path / "sub" / "w.json")
    data = json.loads(path.read_text())
    assert [m["role"] for m in data[2]["messages"]] == ["user", "user"] and "tools" not in data[2]
    assert data[0]["messages"][0]["role"] == "system" and data[0]["tools"] == convs[0].tools
    roles = [m["role"] for m in data[0]["messages"]]
    assert roles[:3] == ["system", "user", "assistant"] and roles[-1] in ("tool", "user")
    assert roles.count("assistant") == len(convs[0].turns) - 1
    assert load_conversations(path, max_tokens=32) == convs


def test_saved_budgets_keep_turn_boundaries(tmp_path):
    path = _write(tmp_path, [{"id": "a", "max_tokens": [5, 500], "messages": [
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}]}])
    assert load_conversations(path, max_tokens=64) == [Conversation("a", None, [_user("one", 5), _user("two", 64)])]


def test_save_rejects_tool_results_that_answer_no_call(tmp_path):
    conv = Conversation("x", None, [_user("a", 3), Turn(["result"], None, None, 3)])
    with pytest.raises(ValueError, match="'x': turn 2 carries tool results, but the answer before it calls no tool"):
        save_conversations([conv], tmp_path / "w.json")


def _tool_conv(*messages, tools=None) -> list:
    entry = {"id": "t", "messages": [{"role": "user", "content": "go"}, *messages]}
    if tools is not None:
        entry["tools"] = tools
    return [entry]


@pytest.mark.parametrize("data, message", [
    ("{not json", "not valid JSON"),
    ({"id": "a"}, "expected a JSON list of conversations, got dict"),
    (["text"], r"conversation #0: expected an object"),
    ([{"id": "a"}], r"conversation 'a' \(#0\): \"messages\" must be a non-empty list"),
    ([{"id": "a", "messages": []}], r"\"messages\" must be a non-empty list"),
    ([{"id": "ok", "messages": [{"role": "user", "content": "x"}]},
      {"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "function", "content": "y"}]}],
     r"conversation 'b' \(#1\), message 1: role must be \"system\", \"user\", \"assistant\" or \"tool\""),
    ([{"id": "a", "messages": [{"role": "user"}]}], r"message 0: missing \"content\""),
    ([{"id": "a", "messages": [{"role": "user", "content": 5}]}], r"message 0: content must be a string"),
    ([{"id": "a", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}],
     r"message 0: content part 0 must be"),
    ([{"id": "a", "messages": [{"role": "user", "content": None}]}], r"message 0: content must be a string"),
    ([{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}]}],
     r"message 1: a system message is only allowed as the first message"),
    ([{"id": "a", "messages": [{"role": "system", "content": "s"}]}], r"conversation 'a' \(#0\): no user message"),
    ([{"id": "a", "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}],
     r"message 0: assistant message before any user message"),
    ([{"id": "a", "messages": ["hi"]}], r"message 0: expected an object"),
    ([{"id": ["a"], "messages": [{"role": "user", "content": "x"}]}], r"#0: id must be a string or an integer"),
    ([{"id": "a", "messages": [{"role": "user", "content": "x"}]},
      {"conversation_id": "a", "messages": [{"role": "user", "content": "y"}]}], r"#1: duplicate id 'a'"),
    ([{"id": "a", "max_tokens": [1, 2], "messages": [{"role": "user", "content": "x"}]}],
     r"conversation 'a' \(#0\): \"max_tokens\" lists 2 budgets for 1 turns"),
    ([{"id": "a", "max_tokens": [0], "messages": [{"role": "user", "content": "x"}]}],
     r"\"max_tokens\" must be a list of positive integers"),
    # tool calls and tool messages
    (_tool_conv({"role": "tool", "content": "y"}),
     r"conversation 't' \(#0\), message 1: a tool message needs the \"tool_call_id\" of the call it answers"),
    (_tool_conv({"role": "tool", "tool_call_id": "c1", "content": "y"}),
     r"message 1: a tool message must follow the assistant message whose tool call it answers"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
                {"role": "tool", "tool_call_id": "c9", "content": "y"}),
     r"message 2: tool_call_id 'c9' answers no tool call of message 1 \(its calls: 'c1'\)"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
                {"role": "user", "content": "y"}),
     r"message 2: message 1 called tools \('c1'\); the messages after it must be the tool messages that answer"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
                {"role": "tool", "tool_call_id": "c1", "content": None}),
     r"message 2: content must be a string"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": []}),
     r"message 1: tool_calls must be a non-empty list"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}),
     r"message 1, tool call 0: id must be a non-empty string"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": ["f"]}),
     r"message 1, tool call 0: expected \{\"id\", \"type\": \"function\""),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": 3}}]}),
     r"message 1, tool call 0: function name must be a non-empty string"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [_call("c1", arguments="{oops")]}),
     r"message 1, tool call 0: arguments are not valid JSON"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [_call("c1", arguments="[1]")]}),
     r"message 1, tool call 0: arguments must be a JSON object"),
    (_tool_conv({"role": "assistant", "content": None, "tool_calls": [_call("c1", "grep")]}, tools=[TOOL]),
     r"message 1: calls 'grep', which is not among the conversation's tools"),
    (_tool_conv({"role": "assistant", "content": "a"},
                {"role": "assistant", "content": None, "tool_calls": [_call("c1")]}),
     r"message 2: an assistant message with tool calls must follow a user or tool message"),
    (_tool_conv(tools=[]), r"conversation 't' \(#0\): \"tools\" must be a non-empty list of function tools"),
    (_tool_conv(tools=[{"type": "function"}]), r"conversation 't' \(#0\), tool 0: expected"),
    (_tool_conv(tools=[{"type": "function", "function": {"name": "bad name"}}]),
     r"tool 0: function name must match"),
    (_tool_conv(tools=[TOOL, TOOL]), r"tool 1: two tools are named 'read_file'"),
    (_tool_conv(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     r"tool 0: parameters must be a JSON Schema object of type \"object\""),
])
def test_bad_files_raise_clear_value_errors(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as info:
        load_conversations(path, max_tokens=16)
    assert str(path) in str(info.value)


def test_bad_jsonl_line_is_named(tmp_path):
    path = _write(tmp_path, '{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{oops\n', name="c.jsonl")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not valid JSON")):
        load_conversations(path, max_tokens=16)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        load_conversations(os.fspath(tmp_path / "nope.json"), max_tokens=16)
