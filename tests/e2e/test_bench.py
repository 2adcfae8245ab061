"""`kvshuttle bench` at a tiny size against the shared stack, with a colocated worker for the ideal mode: the
output has the right shape and every mode was measured. No timing thresholds: numbers only have to exist."""

from __future__ import annotations

import json

import pytest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.devtools.bench.multiturn import BenchConfig, run_bench
from kvshuttle.services.devtools.bench.policy_sweep import (
    ALWAYS_PULL,
    COST,
    LANE_POLICIES,
    RECOMPUTE,
    PolicySweepConfig,
    run_sweep,
)

pytestmark = pytest.mark.e2e
MODES = ("pull", "recompute", "local", "ideal", "direct")


async def test_bench_replays_agent_conversations_in_every_mode_and_writes_results(tools_model_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    """`kvshuttle bench` as the command runs it: its own stack (the tiny-tools model, the gateway with the hermes
    parser) and ideal worker, and agentic conversations whose every turn but the last forces a tool call that the next
    turn answers with a tool message. Every mode sees the same prompts, every later turn pulls in the pull mode and
    continues on D in the local mode, from D's blocks of its own session only, and every mode answers alike."""
    monkeypatch.setenv("KVSHUTTLE_SCHEDULER_POLICY", "threshold")  # the bench's scheduler: pulls at any length
    cfg = from_namespace(BenchConfig, environ={
        "KVSHUTTLE_MODEL_DIR": str(tools_model_dir), "KVSHUTTLE_BENCH_WORK_DIR": str(tmp_path / "stack"),
        "KVSHUTTLE_BENCH_OUT_DIR": str(tmp_path / "results"), "KVSHUTTLE_BENCH_CONVERSATIONS": "2",
        "KVSHUTTLE_BENCH_CONCURRENCY": "2", "KVSHUTTLE_BENCH_MAX_HISTORY_TOKENS": "1400",
        "KVSHUTTLE_BENCH_SYSTEM_TOKENS": "300", "KVSHUTTLE_BENCH_TURN_TOKENS_MIN": "150",
        "KVSHUTTLE_BENCH_TURN_TOKENS_MAX": "250", "KVSHUTTLE_BENCH_MAX_TOKENS": "6",
        "KVSHUTTLE_BENCH_PROGRESS": "false", "KVSHUTTLE_BENCH_BUCKETS": "0,500,1000",
        "KVSHUTTLE_BENCH_MAX_MODEL_LEN": "4096",
    })
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("hermes", "")
    assert await run_bench(cfg) == 0

    printed = capsys.readouterr().out
    assert "TTFT (ms) by history length" in printed and "Control-plane overhead" in printed
    assert "forced tool calls" in printed
    for title in ("Continuing on D (local mode: scheduler policy bench-local", "TTFT (ms) by new tokens per turn",
                  "crossover (local TTFT p50 against the pull's", "D's inter-token delay (ms",
                  "a local turn prefills on D", "Prompt tokens over the network per turn", "D's own counters"):
        assert title in printed, title
    (run_dir,) = (tmp_path / "results").iterdir()
    assert {p.name for p in run_dir.iterdir()} >= {"results.json", "samples.jsonl", "ttft.png", "report.txt",
                                                   "streams.jsonl"}
    assert (run_dir / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((run_dir / "results.json").read_text())
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]

    turns = {(s["conversation"], s["turn"]) for s in samples}
    assert len(turns) >= 4  # two conversations of two or more turns
    assert report["meta"]["tool_calls"] == len(turns) - 2  # every turn but each conversation's last
    for mode in MODES:  # every turn measured in every mode, with real numbers
        mine = [s for s in samples if s["mode"] == mode]
        assert {(s["conversation"], s["turn"]) for s in mine} == turns, mode
        assert all(s["ttft_ms"] > 0 and s["latency_ms"] >= s["ttft_ms"] and s["prompt_tokens"] > 0
                   and s["output_tokens"] > 0 for s in mine), mine
    for key in turns:  # the same prompt in every mode: same messages, tools, echoed calls
        assert len({s["prompt_tokens"] for s in samples if (s["conversation"], s["turn"]) == key}) == 1, key
    later = [s for s in samples if s["turn"] > 1]
    assert all(s["decision"] == "pull" and s["pulled_tokens"] > 0 for s in later if s["mode"] in ("pull", "direct"))
    assert all(s["pulled_tokens"] == s["history_tokens"] - 1 for s in later if s["mode"] in ("pull", "direct"))
    assert all(s["decision"] == "recompute" and s["pulled_tokens"] == 0 for s in later if s["mode"] == "recompute")
    # The local mode: turn 1 recomputes (nothing held yet), every later turn continues on D, served from D's blocks of
    # the mode's own session (its own tenant's salt: never another mode's run of the same prompt a moment before);
    # the history's last partial block is computed again.
    local = [s for s in samples if s["mode"] == "local"]
    assert all(s["decision"] == "recompute" for s in local if s["turn"] == 1)
    assert all(s["decision"] == "local" and s["reason_code"] == "local_always" and s["pulled_tokens"] == 0
               and s["decode_read_tokens"] == 0 and s["history_tokens"] - 128 < s["decode_cached_tokens"]
               <= s["history_tokens"] for s in local if s["turn"] > 1), local
    assert report["answers_agree"]["agree"] == report["answers_agree"]["compared"] == len(turns)
    assert all(p["agree"] == p["compared"] == len(turns) for name, p in report["answers_agree"]["pairs"].items()
               if "local" in name)
    section = report["continuing_on_d"]
    local_turns = section["turns"]
    assert local_turns["local"] == local_turns["later_turns"] == local_turns["compared"] == len(turns) - 2
    assert section["turns"]["beyond_own_history"] == 0 and section["by_new_tokens"] and section["by_history"]
    for group in section["by_new_tokens"]:
        assert {"pull", "local", "recompute"} <= set(group["modes"]) and group["ratios"]["local_over_pull"] > 0
    assert section["crossover"]["status"] != "no_data"
    itl = report["itl"]
    assert itl["streams"] == 4 * len(turns)  # every mode's turns but the ideal worker's
    assert itl["by_prefill"]["local"]["prefills"] == len(turns) - 2 and itl["gaps"] > 0
    network = {r["mode"]: r for r in report["network"]}
    assert network["pull"]["pulled_tokens_mean"] > 0 and network["local"]["crossed_tokens_mean"] == 0
    assert network["pull"]["read_tokens_mean"] is None  # concurrency 2: D's counters tell no single turn
    streams = [json.loads(line) for line in (run_dir / "streams.jsonl").read_text().splitlines()]
    assert all(s["tokens"] and s["sent"] < s["tokens"][0] for s in streams)

    overall = report["overall"]
    for mode in MODES:
        assert overall["modes"][mode]["ttft_p50_ms"] > 0
    assert overall["ratios"]["recompute_over_pull"] > 0 and overall["ratios"]["recompute_over_ideal"] > 0
    assert overall["ratios"]["local_over_pull"] > 0 and overall["ratios"]["local_over_recompute"] > 0
    overhead = report["control_plane_overhead"]
    assert overhead["paired_turns"] == len(turns)
    assert overhead["hops"]["plan_ms"]["p50"] > 0 and overhead["hops"]["prefill_ms"]["p50"] > 0


async def test_bench_replays_a_conversation_file(stack, tmp_path):
    """vLLM's multi-turn benchmark format: the user turns are replayed, assistant lengths cap max_tokens. Plain chats
    (no tools) run on any gateway: here the shared stack (the tiny model, no tool-call parser)."""
    convs = [{"id": f"c{i}", "messages": [
        {"role": "system", "content": f"You review code, conversation {i}."},
        {"role": "user", "content": "def add(a, b):\n    return a + b\n" * 40 + "Review this."},
        {"role": "assistant", "content": "Looks fine."},  # ~3 tokens: that turn generates at most 3
        {"role": "user", "content": "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 30},
        {"role": "assistant", "content": "It needs an __init__ that creates the list. " * 3},
    ]} for i in range(2)]
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(convs))
    cfg = from_namespace(BenchConfig, environ={
        "KVSHUTTLE_BENCH_GATEWAY_URL": stack.base_url, "KVSHUTTLE_MODEL_DIR": str(stack.model_dir),
        "KVSHUTTLE_BENCH_OUT_DIR": str(tmp_path / "results"), "KVSHUTTLE_BENCH_CONVERSATION_FILE": str(path),
        "KVSHUTTLE_BENCH_MODES": "pull,recompute", "KVSHUTTLE_BENCH_MAX_TOKENS": "8",
        "KVSHUTTLE_BENCH_PROGRESS": "false", "KVSHUTTLE_STACK_MAX_MODEL_LEN": "4096",
    })
    assert await run_bench(cfg) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted((s["conversation"], s["turn"], s["mode"]) for s in samples) == sorted(
        (c, t, m) for c in ("c0", "c1") for t in (1, 2) for m in ("pull", "recompute"))
    assert all(s["output_tokens"] <= 3 for s in samples if s["turn"] == 1)
    assert all(s["decision"] == "pull" for s in samples if s["turn"] == 2 and s["mode"] == "pull")
    report = json.loads((run_dir / "results.json").read_text())
    assert report["meta"]["workload"] == str(path) and "ideal" not in report["overall"]["modes"]


async def test_policy_sweep_prices_every_policy_on_the_same_turns(stack, tmp_path, capsys):
    cfg = from_namespace(PolicySweepConfig, environ={
        "KVSHUTTLE_SWEEP_GATEWAY_URL": stack.base_url, "KVSHUTTLE_SWEEP_SCHEDULER_ADDRESS": stack.scheduler_address,
        "KVSHUTTLE_MODEL_DIR": str(stack.model_dir), "KVSHUTTLE_SWEEP_OUT_DIR": str(tmp_path / "results"),
        "KVSHUTTLE_SWEEP_PER_CLASS": "1", "KVSHUTTLE_SWEEP_MAX_TURNS": "2", "KVSHUTTLE_SWEEP_MAX_TOKENS": "6",
        "KVSHUTTLE_SWEEP_MAX_HISTORY_TOKENS": "2800", "KVSHUTTLE_SWEEP_PREFILL_CACHE": "warm",
        "KVSHUTTLE_SWEEP_PROGRESS": "false", **stack.client_tls_env(),
    })
    assert await run_sweep(cfg) == 0
    printed = capsys.readouterr().out
    assert "By history length" in printed and "cost-choices" in printed and "policy sweep-cost: regret" in printed
    (run_dir,) = (tmp_path / "results").iterdir()
    report = json.loads((run_dir / "sweep.json").read_text())
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = {(s["conversation"], s["turn"]) for s in samples}
    assert len(turns) == 10  # five classes, two turns each, every one in all three lanes
    for lane in (ALWAYS_PULL, RECOMPUTE, COST):
        assert {(s["conversation"], s["turn"]) for s in samples if s["mode"] == lane} == turns, lane
    assert all(s["decision"] == "recompute" for s in samples if s["mode"] == RECOMPUTE)
    assert any(s["decision"] == "pull" for s in samples if s["mode"] == ALWAYS_PULL and s["turn"] == 2)
    overall = report["overall"]
    assert overall["turns"] == 5 and overall["threshold-16"]["n"] == 5 and overall["cost-choices"]["n"] == 5
    for column in ("threshold-16", "threshold-512", ALWAYS_PULL, RECOMPUTE, "cost-choices", "oracle"):
        assert overall[column]["mean"] > 0, column
    assert overall["oracle"]["mean"] <= min(overall[c]["mean"] for c in ("threshold-16", "threshold-512",
                                                                         "cost-choices"))
    decisions = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    cost = [d for d in decisions if d["mode"] == COST and d["turn"] == 2]
    assert len(cost) == 5 and all(d["policy"] == LANE_POLICIES[COST] and d["predicted_recompute_ms"] > 0
                                  for d in cost), cost
    policies = {p["name"]: p for p in report["scheduler_stats"]["policies"]}
    assert set(LANE_POLICIES.values()) <= set(policies) and int(policies[LANE_POLICIES[COST]]["judged_turns"]) > 0
    assert report["scheduler_stats"]["compute"] and int(report["scheduler_stats"]["reported_turns"]) >= 15
