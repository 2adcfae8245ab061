"""The benchmark's workloads: generated agentic conversations and OpenAI-messages files."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvshuttle.services.devtools.bench.workload import (
    Conversation,
    agentic_conversations,
    estimate_tokens,
    estimated_history_tokens,
    load_conversations,
    save_conversations,
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
        assert x.user_turns[0] != y.user_turns[0]


def test_same_output_in_another_process_with_another_hash_seed():
    code = ("import json, dataclasses; from kvshuttle.services.devtools.bench.workload import agentic_conversations as g; "
            "print(json.dumps([dataclasses.asdict(c) for c in g(count=2, seed=7, max_history_tokens=6000, "
            "system_tokens=1000, turn_tokens=(150, 600), max_tokens=32)]))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONHASHSEED": "12345"},
                         capture_output=True, text=True, check=True).stdout
    here = agentic_conversations(count=2, seed=7, **CPU)
    assert [Conversation(**c) for c in json.loads(out)] == here


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


@pytest.mark.parametrize("params", [CPU, GPU], ids=["cpu", "gpu"])
def test_sizes_stay_within_bounds(params):
    lo, hi = params["turn_tokens"]
    convs = agentic_conversations(count=4, seed=11, **params)
    for c in convs:
        total = estimated_history_tokens(c)
        assert total <= params["max_history_tokens"]
        # Stopped only because the next turn would not fit (not at max_turns here).
        assert len(c.user_turns) < 64
        assert total > params["max_history_tokens"] - params["max_tokens"] - lo
        assert 0.9 * params["system_tokens"] <= estimate_tokens(c.system) <= params["system_tokens"]
        assert c.max_tokens == [params["max_tokens"]] * len(c.user_turns)
        for text in c.user_turns:
            assert 0.9 * lo <= estimate_tokens(text) <= hi
    turns = [len(c.user_turns) for c in convs]
    assert min(turns) >= 2


def test_tiny_turns_stay_within_bounds():
    convs = agentic_conversations(count=3, seed=13, max_history_tokens=400, system_tokens=40, turn_tokens=(3, 12),
                                  max_tokens=4, max_turns=64)
    for c in convs:
        assert estimated_history_tokens(c) <= 400
        assert len(c.user_turns) == 64 or estimated_history_tokens(c) > 400 - 4 - 3
        for text in c.user_turns:
            assert 1 <= estimate_tokens(text) <= 12


def test_turn_sizes_vary_uniformly():
    convs = agentic_conversations(count=4, seed=5, max_history_tokens=100_000, system_tokens=500,
                                  turn_tokens=(200, 1000), max_tokens=16, max_turns=40)
    sizes = [estimate_tokens(t) for c in convs for t in c.user_turns]
    assert len(sizes) == 160
    assert min(sizes) < 350 and max(sizes) > 850  # spread across the range, not a constant size
    assert 450 < sum(sizes) / len(sizes) < 750


def test_max_turns_caps_the_conversation():
    convs = agentic_conversations(count=2, seed=2, max_history_tokens=50_000, system_tokens=300,
                                  turn_tokens=(100, 200), max_tokens=8, max_turns=5)
    assert [len(c.user_turns) for c in convs] == [5, 5]


def test_tokens_per_char_scales_text_length():
    base = agentic_conversations(count=1, seed=4, **CPU)[0]
    dense = agentic_conversations(count=1, seed=4, tokens_per_char=0.6, **CPU)[0]
    assert estimate_tokens(dense.system, 0.6) <= 1000
    assert len(dense.system) < 0.6 * len(base.system)


def test_without_system_prompt_first_turn_is_unique():
    convs = agentic_conversations(count=3, seed=9, max_history_tokens=3000, system_tokens=0, turn_tokens=(200, 400),
                                  max_tokens=16)
    for c in convs:
        assert c.system is None
        assert c.user_turns[0].startswith("Session ")
    assert _common_prefix(convs[0].user_turns[0], convs[1].user_turns[0]) < len("Session ") + 4


def test_turns_are_tool_results_of_real_stdlib_sources():
    convs = agentic_conversations(count=3, seed=6, **CPU)
    checked = 0
    for text in (t for c in convs for t in c.user_turns):
        assert text.startswith("Tool result of ")
        assert text.rstrip().endswith(("?", ".", "JSON."))
        for m in re.finditer(r'Tool result of read_file\(path="([^"]+)", start_line=(\d+), end_line=\d+\):\n', text):
            module = m.group(1).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            source = Path(importlib.util.find_spec(module).origin).read_text().splitlines()
            start = int(m.group(2))
            block = text[m.end():].split("\n\n")[0].splitlines()
            for line in block[:-1]:  # the last line may be cut
                number, _, code = line.partition("\t")
                assert source[int(number) - 1] == code
            assert int(block[0].partition("\t")[0]) == start
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(turn_tokens=(0, 10)), "turn_tokens"),
    (dict(turn_tokens=(50, 10)), "turn_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_history_tokens=1100), "no room for one turn"),
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
    assert a == Conversation(id="a", system="be brief", user_turns=["hello", "part one\n\npart two", "last"],
                             max_tokens=[30, 64, 64])
    assert b == Conversation(id="17", system=None, user_turns=["q"], max_tokens=[1])


def test_load_max_turns_and_limit(tmp_path):
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"u{j}"} if k % 2 == 0 else
                                          {"role": "assistant", "content": "a" * 10}
                                          for j in range(3) for k in range(2)]} for i in range(4)]
    path = _write(tmp_path, convs)
    loaded = load_conversations(path, max_tokens=50, max_turns=2, limit=3)
    assert [c.id for c in loaded] == ["c0", "c1", "c2"]
    assert loaded[0].user_turns == ["u0", "u1"]
    assert loaded[0].max_tokens == [3, 3]


def test_load_jsonl(tmp_path):
    lines = [json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}), "",
             json.dumps({"id": "y", "messages": [{"role": "user", "content": "yo"}]})]
    path = _write(tmp_path, "\n".join(lines), name="convs.jsonl")
    assert [c.id for c in load_conversations(path, max_tokens=8)] == ["x", "y"]


def test_save_then_load_round_trips(tmp_path):
    convs = agentic_conversations(count=2, seed=12, **CPU)
    convs.append(Conversation(id="plain", system=None, user_turns=["one", "two ✓"], max_tokens=[32, 32]))
    path = save_conversations(convs, tmp_path / "sub" / "w.json")
    data = json.loads(path.read_text())
    assert [m["role"] for m in data[2]["messages"]] == ["user", "user"]
    assert data[0]["messages"][0]["role"] == "system"
    assert load_conversations(path, max_tokens=32) == convs


def test_saved_budgets_keep_turn_boundaries(tmp_path):
    path = _write(tmp_path, [{"id": "a", "max_tokens": [5, 500], "messages": [
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}]}])
    assert load_conversations(path, max_tokens=64) == [Conversation("a", None, ["one", "two"], [5, 64])]


def test_save_rejects_mismatched_budgets(tmp_path):
    with pytest.raises(ValueError, match="'x': 1 max_tokens for 2 user turns"):
        save_conversations([Conversation("x", None, ["a", "b"], [3])], tmp_path / "w.json")


@pytest.mark.parametrize("data, message", [
    ("{not json", "not valid JSON"),
    ({"id": "a"}, "expected a JSON list of conversations, got dict"),
    (["text"], r"conversation #0: expected an object"),
    ([{"id": "a"}], r"conversation 'a' \(#0\): \"messages\" must be a non-empty list"),
    ([{"id": "a", "messages": []}], r"\"messages\" must be a non-empty list"),
    ([{"id": "ok", "messages": [{"role": "user", "content": "x"}]},
      {"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}],
     r"conversation 'b' \(#1\), message 1: role must be"),
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
     r"conversation 'a' \(#0\): \"max_tokens\" lists 2 budgets for 1 user messages"),
    ([{"id": "a", "max_tokens": [0], "messages": [{"role": "user", "content": "x"}]}],
     r"\"max_tokens\" must be a list of positive integers"),
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
