"""The bench's smg mode without SMG or vLLM: its command line, the missing-install message, the config, the lane's
requests and echoes (against a fake SMG stream), and the report's kvshuttle ÷ SMG ratio per history bucket."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from kvshuttle.services.common.config import ConfigError, from_namespace, load
from kvshuttle.services.devtools.bench import smg as smg_mod
from kvshuttle.services.devtools.bench.multiturn import ALL_MODES, BenchConfig, lane_system
from kvshuttle.services.devtools.bench.report import build_report, format_table
from kvshuttle.services.devtools.bench.samples import PULL, RECOMPUTE, SMG, TurnSample
from kvshuttle.services.devtools.bench.workload import agentic_conversations

# ---------------------------------------------------------------------------------------------------------------
# command line and install


def test_smg_command_fronts_every_worker_in_pd_mode():
    argv = smg_mod.smg_command("/x/.smg/bin/smg", prefill=["127.0.0.1:5001", "127.0.0.1:5002"],
                               decode=["grpc://127.0.0.1:6001"], model_dir="/m/tiny-tools", port=7000,
                               prometheus_port=7001, silence_s=45, extra_args="--policy round_robin")
    assert argv[:3] == ["/x/.smg/bin/smg", "launch", "--pd-disaggregation"]

    def values(flag):
        return [argv[i + 1] for i, a in enumerate(argv) if a == flag]

    assert values("--prefill") == ["grpc://127.0.0.1:5001", "grpc://127.0.0.1:5002"]
    assert values("--decode") == ["grpc://127.0.0.1:6001"]  # already a URL: kept
    assert values("--model-path") == ["/m/tiny-tools"]
    assert values("--host") == values("--prometheus-host") == ["127.0.0.1"]
    assert values("--port") == ["7000"] and values("--prometheus-port") == ["7001"]
    assert values("--worker-wedge-secs") == ["45"]
    assert values("--tool-call-parser") == ["qwen"]  # SMG's name for the hermes syntax the bench forces
    assert argv[-2:] == ["--policy", "round_robin"]


def test_smg_command_without_a_tool_parser_and_its_errors():
    argv = smg_mod.smg_command("smg", prefill=["a:1"], decode=["b:2"], model_dir="m", port=1, prometheus_port=2,
                               tool_call_parser="")
    assert "--tool-call-parser" not in argv
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        smg_mod.smg_command("smg", prefill=[], decode=["b:2"], model_dir="m", port=1, prometheus_port=2)
    with pytest.raises(ValueError, match="no SMG tool-call parser known for 'pythonic'"):
        smg_mod.smg_command("smg", prefill=["a:1"], decode=["b:2"], model_dir="m", port=1, prometheus_port=2,
                            tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="silence_s"):
        smg_mod.smg_command("smg", prefill=["a:1"], decode=["b:2"], model_dir="m", port=1, prometheus_port=2,
                            silence_s=0)


def test_a_missing_smg_names_the_install_step(tmp_path):
    with pytest.raises(smg_mod.SmgMissing, match=r"does not exist: run `make install` \(scripts/bootstrap.sh "
                                                 r"installs smg==1\.13\.0 into its own venv, \.smg/"):
        smg_mod.smg_binary(str(tmp_path / "nothing" / "smg"))
    binary = tmp_path / "smg"
    binary.write_text("#!/bin/sh\n")
    assert smg_mod.smg_binary(str(binary)) == binary


def test_bootstrap_installs_the_version_the_bench_names():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "scripts" / "bootstrap.sh").read_text()
    # read, not imported: tests.support.clients starts the clients' processes, which unit tests do not (test_test_layout)
    [AIPERF_VERSION] = re.findall(r'^AIPERF_VERSION = "([^"]+)"', (repo / "tests/support/clients.py").read_text(), re.M)
    assert f"SMG_VERSION={smg_mod.SMG_VERSION}" in text and 'venv_tool .smg smg "$SMG_VERSION"' in text
    assert f"AIPERF_VERSION={AIPERF_VERSION}" in text and 'venv_tool .aiperf aiperf "$AIPERF_VERSION"' in text
    assert '"$dir/bin/pip" install "$package==$version"' in text  # each its own venv, never .venv


# ---------------------------------------------------------------------------------------------------------------
# config


def _config(*argv: str) -> BenchConfig:
    import argparse

    from kvshuttle.services.common.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(BenchConfig, parser)
    return from_namespace(BenchConfig, parser.parse_args(list(argv)))


def test_smg_is_a_mode_but_not_a_default_one(tmp_path):
    assert SMG not in ALL_MODES and SMG not in _config().mode_list
    binary = tmp_path / "smg"
    binary.write_text("")
    cfg = _config("--modes", "pull,smg", "--smg-bin", str(binary), "--smg-silence-s", "30")
    assert cfg.mode_list == [PULL, SMG] and cfg.smg_silence_s == 30


def test_the_smg_mode_refuses_to_start_without_smg(tmp_path):
    with pytest.raises(ConfigError, match=r"--modes smg: the smg mode needs SMG, and .* does not exist: run `make "
                                          r"install`"):
        _config("--modes", "pull,smg", "--smg-bin", str(tmp_path / "missing"))
    with pytest.raises(SystemExit):  # the command line prints it as a usage error
        load(BenchConfig, ["--modes", "smg", "--smg-bin", str(tmp_path / "missing")])
    binary = tmp_path / "smg"
    binary.write_text("")
    with pytest.raises(ConfigError, match="--smg-silence-s must be >= 1"):
        _config("--modes", "smg", "--smg-bin", str(binary), "--smg-silence-s", "0")
    with pytest.raises(ConfigError, match="--modes must be distinct names among pull, recompute, local, ideal, "
                                          "direct, smg"):
        _config("--modes", "pull,sglang")


def test_a_warm_p_cache_tags_each_modes_system_prompt():
    assert lane_system("You are an agent.", SMG, "cold") == "You are an agent."
    assert lane_system("You are an agent.", SMG, "warm") == "[smg lane] You are an agent."
    assert lane_system("You are an agent.", PULL, "warm") != lane_system("You are an agent.", SMG, "warm")
    assert lane_system(None, PULL, "warm") == "[pull lane] "


# ---------------------------------------------------------------------------------------------------------------
# the lane against a fake SMG stream


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n" for c in chunks)


def smg_stream(body: dict, n: int, arguments: str) -> bytes:
    """SMG's stream: a role chunk, a forced call as the name then its arguments (no hermes text), or content; usage
    with P's cached tokens; no kvshuttle figures."""
    base = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "model": body["model"]}
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        deltas = [{"tool_calls": [{"index": 0, "id": f"call_{n}", "type": "function",
                                   "function": {"name": choice["function"]["name"]}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}]
        finish = "tool_calls"
    else:
        deltas, finish = [{"content": "All "}, {"content": "done."}], "stop"
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                    "logprobs": None, "finish_reason": None}]}]
    chunks += [{**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
               for d in deltas]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]})
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 1000 * n, "completion_tokens": 96,
                                                    "prompt_tokens_details": {"cached_tokens": 128 * n}}})
    return sse(*chunks, "[DONE]")


@pytest.mark.parametrize("arguments, rewritten", [("{}", 0), ("{\n\n   \n   ", None)])
def test_the_smg_lane_sends_what_a_plain_client_sends_and_echoes_forced_calls_as_empty(arguments, rewritten):
    conv = agentic_conversations(count=1, seed=3, max_history_tokens=3000, system_tokens=1000,
                                 turn_tokens=(100, 300), max_tokens=16)[0]
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        body = json.loads(request.content)
        return httpx.Response(200, content=smg_stream(body, len(requests), arguments),
                              headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://smg") as client:
            lane = smg_mod.SmgLane(client, "tiny-tools", conv.id, conv.system, conv.tools, {93: 100.0, 95: 100.0})
            samples = [await lane.turn(turn) for turn in conv.turns]
            await lane.close()
            return lane, samples

    lane, samples = asyncio.run(go())
    forced = [t for t in conv.turns if t.call]
    assert len(requests) == len(conv.turns) and forced
    for k, (request, turn) in enumerate(zip(requests, conv.turns, strict=True)):
        body = json.loads(request.content)
        assert "x-session-id" not in request.headers and "disable_pull" not in body
        assert body["model"] == "tiny-tools" and body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["tools"] == conv.tools and body["temperature"] == 0 and body["max_tokens"] == turn.answer_tokens
        if turn.call:
            assert body["tool_choice"] == {"type": "function", "function": {"name": turn.call}}
        if k:  # the previous forced call echoed back with {} arguments, whatever came back
            echoed = [m for m in body["messages"] if m["role"] == "assistant"][-1]
            assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in echoed["tool_calls"]] == [
                (f"call_{k}", conv.turns[k - 1].call, "{}")]
    assert lane.forced_calls == len(forced)
    assert lane.rewritten_calls == (len(forced) if rewritten is None else rewritten)
    for k, sample in enumerate(samples, start=1):
        assert sample.mode == SMG and sample.turn == k and sample.prompt_tokens == 1000 * k
        assert sample.computed_tokens == 1000 * k - 128 * k and sample.pulled_tokens == 0
        assert sample.decision == "recompute" and 0 < sample.ttft_ms <= sample.latency_ms


def test_an_smg_error_fails_the_turn():
    from kvshuttle.services.devtools.bench.lanes import LaneError

    conv = agentic_conversations(count=1, seed=3, max_history_tokens=3000, system_tokens=1000,
                                 turn_tokens=(100, 300), max_tokens=16)[0]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(504, json={"error": {"code": "prefill_worker_silent"}})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://smg") as client:
            await smg_mod.SmgLane(client, "m", conv.id, conv.system, conv.tools).turn(conv.turns[0])

    with pytest.raises(LaneError, match="smg: gateway answered 504: .*prefill_worker_silent"):
        asyncio.run(go())


# ---------------------------------------------------------------------------------------------------------------
# the report


def _samples() -> list[TurnSample]:
    """Two conversations, three turns; history 0 / 1500 / 3500. TTFT (ms) per turn, both conversations alike:
    pull 100, 80, 90; recompute 100, 300, 700; smg 120, 400, 900."""
    ttft = {PULL: (100, 80, 90), RECOMPUTE: (100, 300, 700), SMG: (120, 400, 900)}
    history = (0, 1500, 3500)
    out = []
    for mode, values in ttft.items():
        for conv in ("a", "b"):
            for turn, (ms, hist) in enumerate(zip(values, history, strict=True), start=1):
                out.append(TurnSample(mode=mode, conversation=conv, turn=turn, prompt_tokens=hist + 300,
                                      history_tokens=hist, new_tokens=300, ttft_ms=float(ms), latency_ms=ms + 500.0,
                                      output_tokens=32, decision=RECOMPUTE, pulled_tokens=0,
                                      computed_tokens=hist + 300, output_digest=f"{conv}{turn}"))
    return out


def test_the_report_divides_kvshuttle_by_smg_in_every_history_bucket():
    report = build_report(_samples(), buckets=[0, 1000, 3000], meta={
        "smg": {"forced_calls": 4, "rewritten_calls": 3}})
    groups = {g["label"]: g for g in report["by_history"]}
    assert list(groups) == ["first turn", "1000-3000", "3000+"]
    assert groups["first turn"]["ratios"]["pull_over_smg"] == pytest.approx(100 / 120)
    assert groups["1000-3000"]["ratios"]["pull_over_smg"] == pytest.approx(80 / 400)
    assert groups["3000+"]["ratios"]["pull_over_smg"] == pytest.approx(90 / 900)
    assert groups["3000+"]["ratios"]["recompute_over_smg"] == pytest.approx(700 / 900)
    assert report["headline"]["ratios"]["pull_over_smg"] == pytest.approx(0.1)
    text = format_table(report)
    assert "kvshuttle / SMG (pull p50 / smg p50, below 1: kvshuttle faster): headline 0.10x, turns 2+" in text
    assert "smg: 3/4 forced calls came back with arguments other than {}" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("history ") and "pull/smg" in line)
    assert "smg p50" in header
    row = next(line for line in lines if line.startswith("1000-3000"))
    assert row.rstrip().endswith("0.20x")


def test_without_smg_the_tables_have_no_smg_column():
    report = build_report([s for s in _samples() if s.mode != SMG], buckets=[0, 1000, 3000], meta={})
    assert report["headline"]["ratios"]["pull_over_smg"] is None
    text = format_table(report)
    assert "pull/smg" not in text and "kvshuttle / SMG" not in text


def test_tagged_lanes_are_not_compared_for_agreement():
    text = format_table(build_report(_samples(), buckets=[0, 1000, 3000], meta={"lane_prompts": "tagged"}))
    assert "answers agree across modes: not compared (P's cache warm" in text
