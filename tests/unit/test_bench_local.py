"""The bench's local mode (later turns continued on D): its report math on hand-made samples (buckets by new tokens,
the crossover with the pull, D's inter-token delays inside and outside other turns' prefills, prompt tokens over the
network per lane), the streamed tokens' timing, D's counters around a turn, and the settings of the bench's own
scheduler and gateway."""

from __future__ import annotations

import json

import httpx
import pytest
from kvshuttle.control_plane.policies import make_policy, parse_policy_specs
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.devtools.bench import lanes, multiturn
from kvshuttle.services.devtools.bench.local_report import (
    continuing_on_d,
    crossover,
    itl_by_prefill,
    network_by_lane,
    new_bucket_label,
)
from kvshuttle.services.devtools.bench.multiturn import (
    BenchConfig,
    bench_keys,
    check_local_policy,
    decode_delta,
    local_policy_spec,
    scheduler_env,
)
from kvshuttle.services.devtools.bench.report import build_report, format_table, write_outputs
from kvshuttle.services.devtools.bench.samples import IDEAL, LOCAL, PULL, RECOMPUTE, TurnSample, TurnStream
from kvshuttle.services.devtools.bench.workload import Conversation, Turn
from kvshuttle.services.devtools.chat_stream import stream_chat
from kvshuttle.services.gateway.edge.auth import KeyRing

from tests.support.configs import parse_config

MODES = [PULL, RECOMPUTE, LOCAL]


def _s(mode: str, conv: str, turn: int, ttft: float, *, history: int, new: int, decision: str | None = None,
       reason: str = "", cached: int = -1, read: int = -1, pulled: int = 0) -> TurnSample:
    decision = decision or {PULL: PULL, RECOMPUTE: RECOMPUTE, LOCAL: LOCAL, IDEAL: IDEAL}[mode]
    return TurnSample(mode=mode, conversation=conv, turn=turn, prompt_tokens=history + new, history_tokens=history,
                      new_tokens=new, ttft_ms=ttft, latency_ms=ttft + 100, output_tokens=8, decision=decision,
                      pulled_tokens=pulled, computed_tokens=new, output_digest=f"{conv}{turn}", reason_code=reason,
                      decode_cached_tokens=cached, decode_read_tokens=read)


# Later turns (turn 2 of six conversations), TTFT ms of pull / local / recompute, with (history, new tokens):
#   a  (1000,  100):  80 /  40 /  200     <256
#   b  (1500,  200):  90 /  50 /  250     <256
#   c  (2000,  600): 120 / 100 /  400     256-1k (the local mode's own count says 1100 new: bucketed by pull's 600)
#   d  (2500, 2000): 200 / 300 /  700     1k-4k
#   e  (3000, 5000): 400 / 700 / 1200     >=4k
#   f  (1200,  150): the local mode did not continue it on D (a pull, expiry_guard): left out of every group
#   g  (1300,  120): the pull mode did not pull it (the cost model recomputed it): left out too
ROWS = {"a": (1000, 100, 80, 40, 200), "b": (1500, 200, 90, 50, 250), "c": (2000, 600, 120, 100, 400),
        "d": (2500, 2000, 200, 300, 700), "e": (3000, 5000, 400, 700, 1200), "f": (1200, 150, 85, 30, 220),
        "g": (1300, 120, 210, 35, 215)}
CACHED = {"a": 896, "b": 1600, "c": 1920, "d": 2432, "e": 2944, "g": 1280}  # b's exceeds its own history (1500)


def _samples() -> list[TurnSample]:
    out = []
    for conv, (history, new, pull, local, rec) in ROWS.items():
        if conv == "g":
            out.append(_s(PULL, conv, 2, pull, history=history, new=new, decision=RECOMPUTE, reason="cost_model"))
        else:
            out.append(_s(PULL, conv, 2, pull, history=history, new=new, pulled=history - 1))
        out.append(_s(RECOMPUTE, conv, 2, rec, history=history, new=new))
        if conv == "f":
            out.append(_s(LOCAL, conv, 2, local, history=history, new=new, decision=PULL, reason="expiry_guard"))
        else:
            own_new = 1100 if conv == "c" else new
            out.append(_s(LOCAL, conv, 2, local, history=history, new=own_new, cached=CACHED[conv], read=0))
        for mode in MODES:  # turn 1: no history; the local mode recomputes it
            out.append(_s(mode, conv, 1, 50, history=0, new=history - 8,
                          decision=PULL if mode == PULL else RECOMPUTE))
    return out


def test_new_token_buckets_compare_the_turns_continued_on_d():
    section = continuing_on_d(_samples(), MODES, [0, 2000, 3000])
    groups = {g["label"]: g for g in section["by_new_tokens"]}
    assert list(groups) == ["<256", "256-1k", "1k-4k", ">=4k"]
    small = groups["<256"]
    assert small["turns"] == 2 and small["new_tokens_mean"] == 150 and small["history_tokens_mean"] == 1250  # a, b
    assert {m: st["ttft_p50_ms"] for m, st in small["modes"].items()} == {PULL: 85, LOCAL: 45, RECOMPUTE: 225}
    assert small["modes"][LOCAL]["ttft_p99_ms"] == pytest.approx(49.9)  # 40 + 0.99 * 10
    assert small["ratios"] == {"local_over_pull": 45 / 85, "local_over_recompute": 0.2}
    mid = groups["256-1k"]  # c: by the pull mode's 600 new tokens, not the local mode's 1100
    assert mid["turns"] == 1 and mid["new_tokens_mean"] == 600 and mid["modes"][LOCAL]["count"] == 1
    assert groups["1k-4k"]["ratios"]["local_over_pull"] == 1.5 and groups[">=4k"]["ratios"]["local_over_pull"] == 1.75
    assert all(g["modes"][m]["count"] == g["turns"] for g in groups.values() for m in MODES)
    # f and g are in no group, in no mode: the comparison is on the same turns
    assert sum(g["turns"] for g in groups.values()) == 5 and section["overall"]["modes"][PULL]["count"] == 5

    by_history = {g["label"]: g["turns"] for g in section["by_history"]}
    assert by_history == {"0-2000": 2, "2000-3000": 2, "3000+": 1}

    turns = section["turns"]
    assert (turns["later_turns"], turns["local"], turns["compared"]) == (7, 6, 5)
    assert turns["not_local"] == [{"decision": PULL, "reason_code": "expiry_guard", "turns": 1}]
    assert turns["pull_not_pulled"] == [{"decision": RECOMPUTE, "reason_code": "cost_model", "turns": 1}]
    assert turns["first_turns"] == {RECOMPUTE: 7}
    assert turns["beyond_own_history"] == 1  # b: 1600 cached of a 1500-token history
    assert turns["cached_of_history"] == sum(CACHED.values()) / (1000 + 1500 + 2000 + 2500 + 3000 + 1300)


def test_the_crossover_of_the_measured_run_is_interpolated_between_the_bucket_means():
    c = continuing_on_d(_samples(), MODES, [0])["crossover"]
    assert c["status"] == "crosses" and c["bucket"] == "1k-4k" and c["monotonic"]
    assert (c["wins"], c["losses"]) == (["<256", "256-1k"], ["1k-4k", ">=4k"])
    # local - pull goes from -20 ms at 600 new tokens to +100 ms at 2000: zero at 600 + 1400 * 20 / 120
    assert c["new_tokens"] == pytest.approx(600 + 1400 * 20 / 120)


def _groups(*rows: tuple[str, float, float, float]) -> list[dict]:
    return [{"label": label, "new_tokens_mean": new, "modes": {LOCAL: {"ttft_p50_ms": local},
                                                               PULL: {"ttft_p50_ms": pull}}}
            for label, new, local, pull in rows]


def test_crossover_cases():
    never = crossover(_groups(("<256", 100, 60, 50), ("256-1k", 500, 80, 70)))
    assert never["status"] == "local_never_faster" and never["bucket"] == "<256" and never["new_tokens"] is None
    always = crossover(_groups(("<256", 100, 40, 50), ("256-1k", 500, 60, 70)))
    assert always["status"] == "local_always_faster" and always["bucket"] is None and always["losses"] == []
    tie = crossover(_groups(("<256", 100, 40, 50), ("256-1k", 500, 70, 70)))  # a tie does not beat the pull
    assert tie["status"] == "crosses" and tie["bucket"] == "256-1k" and tie["new_tokens"] == 500
    bumpy = crossover(_groups(("<256", 100, 40, 50), ("256-1k", 500, 80, 70), ("1k-4k", 2000, 90, 95)))
    assert bumpy["status"] == "crosses" and bumpy["bucket"] == "256-1k" and not bumpy["monotonic"]
    assert bumpy["wins_after"] == ["1k-4k"]
    one_sided = [{"label": "<256", "new_tokens_mean": 1, "modes": {LOCAL: {"ttft_p50_ms": 1.0}}}]
    assert crossover(one_sided)["status"] == "no_data" and crossover([])["status"] == "no_data"


def test_new_bucket_labels():
    assert [new_bucket_label(0, 256), new_bucket_label(256, 1024), new_bucket_label(1024, 4096),
            new_bucket_label(4096, None), new_bucket_label(1000, 2000)] == ["<256", "256-1k", "1k-4k", ">=4k",
                                                                            "1000-2000"]


def _stream(mode: str, conv: str, decision: str, sent: float, *tokens: float, worker: str = "d0") -> TurnStream:
    return TurnStream(mode, conv, 2, decision, worker, sent, list(tokens))


def test_itl_is_split_by_the_prefills_it_overlaps():
    streams = [
        # a pull turn streaming: delays 10, 10, 30, 10, 40 ms
        _stream(PULL, "x", PULL, 0.0, 0.100, 0.110, 0.120, 0.150, 0.160, 0.200),
        # a local turn prefills on D from 0.115 to 0.155: the 10 (0.110-0.120), 30 and 10 (0.150-0.160) ms delays
        # overlap it; its own 145 ms delay starts where its prefill ends (not its own)
        _stream(LOCAL, "y", LOCAL, 0.115, 0.155, 0.300),
        # a pull prefill from 0.170 to 0.250 (one token: no delay of its own): overlaps 40 and 145
        _stream(PULL, "z", PULL, 0.170, 0.250),
        # the ideal worker is not D: its 20 ms delay overlaps the local prefill, and counts nowhere
        _stream(IDEAL, "x", IDEAL, 0.105, 0.110, 0.130),
        # a recompute long after: its delays (20, 30) overlap no other prefill
        _stream(RECOMPUTE, "w", RECOMPUTE, 0.500, 0.600, 0.620, 0.650),
    ]
    itl = itl_by_prefill(streams)
    by = itl["by_prefill"]
    assert itl["streams"] == 4 and itl["gaps"] == 5 + 1 + 0 + 2
    assert by[LOCAL]["count"] == 3 and by[LOCAL]["p50"] == pytest.approx(10)
    assert by[LOCAL]["p99"] == pytest.approx(29.6)  # sorted 10, 10, 30: rank 1.98
    assert by[LOCAL]["prefills"] == 1 and by[LOCAL]["prefill_s"] == pytest.approx(0.040)
    assert by[PULL]["count"] == 2 and by[PULL]["p50"] == pytest.approx(92.5) and by[PULL]["prefills"] == 2
    assert by[RECOMPUTE]["count"] == 0 and by[RECOMPUTE]["p50"] is None and by[RECOMPUTE]["prefills"] == 1
    assert by["none"]["count"] == 3 and by["none"]["p50"] == pytest.approx(20)  # 10 (0.100-0.110), 20, 30
    assert by["none"]["max"] == pytest.approx(30)


def test_itl_counts_a_delay_for_every_kind_it_overlaps_and_only_on_its_own_decode_worker():
    streams = [
        _stream(PULL, "x", PULL, 0.0, 0.1, 0.2),  # one 100 ms delay on d0
        _stream(LOCAL, "y", LOCAL, 0.12, 0.3),  # on d0, overlapping it
        _stream(RECOMPUTE, "z", RECOMPUTE, 0.15, 0.25),  # on d0 too
        _stream(PULL, "v", PULL, 0.0, 0.1, 0.2, worker="d1"),  # the same delay on d1: nothing prefills on d1
        _stream(LOCAL, "u", LOCAL, 0.0, 0.1, 0.2, worker=""),  # unknown worker with two Ds: left out
    ]
    by = itl_by_prefill(streams)["by_prefill"]
    assert by[LOCAL]["count"] == by[RECOMPUTE]["count"] == 1 and by[PULL]["count"] == 0
    assert by["none"]["count"] == 1 and by["none"]["p50"] == pytest.approx(100)  # d1's


def test_network_by_lane():
    samples = [
        _s(PULL, "a", 2, 80, history=1000, new=500, pulled=999, read=520, cached=980),
        _s(PULL, "b", 2, 90, history=2000, new=300, pulled=1999, read=340, cached=1960),
        _s(PULL, "a", 1, 50, history=0, new=900, read=900, cached=0),  # turn 1: not in the means
        _s(RECOMPUTE, "a", 2, 200, history=1000, new=500, read=600),
        _s(RECOMPUTE, "b", 2, 300, history=2000, new=300),  # not measured
        _s(LOCAL, "a", 2, 40, history=1000, new=500, read=0, cached=896),
        _s(IDEAL, "a", 2, 30, history=1000, new=500),
    ]
    rows = {r["mode"]: r for r in network_by_lane(samples, [PULL, RECOMPUTE, IDEAL, LOCAL])}
    assert list(rows) == [PULL, RECOMPUTE, LOCAL]  # the ideal worker moves nothing
    pull = rows[PULL]
    assert (pull["turns"], pull["pulled_tokens_mean"], pull["pulled_tokens_sum"]) == (2, 1499, 2998)
    assert (pull["read_tokens_mean"], pull["read_tokens_sum"], pull["decode_cached_tokens_mean"]) == (430, 860, 1470)
    assert pull["crossed_tokens_mean"] == (999 + 520 + 1999 + 340) / 2
    rec = rows[RECOMPUTE]
    assert rec["read_tokens_measured"] == 1 and rec["read_tokens_mean"] is None and rec["crossed_tokens_mean"] is None
    assert rows[LOCAL]["crossed_tokens_mean"] == 0 and rows[LOCAL]["decode_cached_tokens_mean"] == 896


def test_the_report_and_its_text_have_the_local_section(tmp_path):
    samples = _samples()
    streams = [_stream(PULL, "x", PULL, 0.0, 0.1, 0.11, 0.12), _stream(LOCAL, "y", LOCAL, 0.105, 0.2)]
    meta = {"local_policy": "bench-local", "local_policy_spec": local_policy_spec(), "concurrency": 2}
    report = build_report(samples, buckets=[0, 2000, 3000], meta=meta, new_buckets=[0, 256, 1024, 4096],
                          streams=streams)
    assert report["later_turns"]["ratios"]["local_over_pull"] is not None
    assert report["continuing_on_d"]["crossover"]["bucket"] == "1k-4k"
    text = format_table(report)
    assert "Continuing on D (local mode: scheduler policy bench-local, bench-local=cost:" in text
    assert ("local mode, turns 2+: 6/7 continued on D; not continued: pull (expiry_guard) 1; turn 1: recompute 7"
            in text)
    assert ("compared on the 5 turns the local mode continued on D and the pull mode pulled (the pull mode did not "
            "pull: recompute (cost_model) 1)") in text
    assert "turns whose hit exceeded their own history (another lane's blocks): 1" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("<256 "))
    assert row.split() == ["<256", "2", "1250", "150", "85.0", "89.9", "45.0", "49.9", "225.0", "249.5", "0.53x",
                           "0.20x"]
    assert ("stops beating it in 1k-4k (~833 new tokens, interpolated)" in text)
    itl_row = next(line for line in lines if line.startswith("a local turn prefills on D"))
    assert itl_row.split()[-6:] == ["1", "2", "10.0", "10.0", "10.0", "10.0"]  # both pull delays overlap it
    assert "(P->D and D's cache hit per turn: not measured (concurrency 2;" in text
    header = next(line for line in lines if line.startswith("new ") and "local p50" in line)
    assert len(row) == len(header)
    paths = write_outputs(report, samples, tmp_path, streams=streams, log_y=False)
    assert [json.loads(line) for line in paths["streams"].read_text().splitlines()] == [s.to_dict() for s in streams]


def test_a_report_without_the_local_mode_has_no_local_section():
    report = build_report([s for s in _samples() if s.mode != LOCAL], buckets=[0], meta={})
    assert "continuing_on_d" not in report and "itl" not in report and "Continuing on D" not in format_table(report)


# ---------------------------------------------------------------------------------------------------------------
# Streamed tokens' arrival times


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_token_times_keep_the_chunks_that_carry_tokens():
    lp = {"content": [{"token": "a", "logprob": -0.1}], "refusal": None}
    lines = [(1.0, "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
             (2.0, "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": lp}]})),
             (3.0, "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "logprobs": lp}]})),  # parser holds it
             (3.5, "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "b"}}]})),  # same output
             (4.0, "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                          "kvshuttle": {"decision": "local", "logprobs": 1}})),
             (5.0, "data: [DONE]"), (6.0, "")]
    assert lanes.token_times(lines) == [2.0, 3.0]


async def test_the_timed_client_records_every_line_of_a_streamed_chat():
    lp = {"content": [{"token": "x", "logprob": 0.0}], "refusal": None}
    body = _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": lp}]},
                {"choices": [{"index": 0, "delta": {"content": "y"}, "logprobs": lp}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "kvshuttle": {"decision": "local"}},
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    seen = {}

    def answer(request: httpx.Request) -> httpx.Response:
        seen["session"] = request.headers["X-Session-ID"]
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://gw") as client:
        timed = lanes.TimedClient(client)
        got = await stream_chat(timed, "s1", {"messages": []})
    assert got.text == "xy" and got.kv == {"decision": "local"} and seen["session"] == "s1"
    times = lanes.token_times(timed.lines)
    assert len(times) == 2 and timed.sent <= times[0] <= times[1]
    assert len([line for _, line in timed.lines if line.startswith("data: ")]) == 6


# ---------------------------------------------------------------------------------------------------------------
# D's counters, the local policy and the bench's own stack


def test_decode_delta_reads_one_turn_off_d_s_counters():
    pull = _s(PULL, "a", 2, 80, history=1000, new=500)
    decode_delta(pull, {"external_kv_transfer": 100.0, "local_cache_hit": 50.0},
                 {"external_kv_transfer": 745.0, "local_cache_hit": 946.0, "local_compute": 1.0})
    assert (pull.decode_read_tokens, pull.decode_cached_tokens) == (645, 896)
    local = _s(LOCAL, "a", 2, 40, history=1000, new=500, cached=896, read=0)
    decode_delta(local, {}, {"local_cache_hit": 900.0})  # the answer's own figure stays
    assert (local.decode_read_tokens, local.decode_cached_tokens) == (0, 896)


class _Lane:
    def __init__(self, mode: str):
        self.mode, self.turns, self.last_stream = mode, 0, None
        self.last_timings: dict[str, float] = {}

    async def turn(self, turn: Turn) -> TurnSample:
        self.turns += 1
        if self.mode != IDEAL:
            self.last_stream = TurnStream(self.mode, "c", self.turns, self.mode, "d0", 0.0, [0.1])
        return _s(self.mode, "c", self.turns, 10, history=0, new=10)

    async def close(self) -> None:
        pass


async def test_drive_reads_d_s_counters_around_every_turn_but_the_ideal_worker_s():
    reads = iter(range(100))

    async def counters() -> dict[str, float]:
        n = next(reads)
        return {"external_kv_transfer": 10.0 * n, "local_cache_hit": 3.0 * n}

    conv = Conversation("c", None, [Turn([], "hi", None, 4), Turn([], "again", None, 4)])
    out = await multiturn.drive([conv], lambda c: {m: _Lane(m) for m in (PULL, IDEAL, LOCAL)}, [PULL, IDEAL, LOCAL],
                                concurrency=1, progress=False, turn_timeout_s=5, decode_counters=counters)
    assert not out.failures and len(out.samples) == 6
    assert all(s.decode_read_tokens == 10 and s.decode_cached_tokens == 3 for s in out.samples if s.mode != IDEAL)
    assert all(s.decode_read_tokens == -1 for s in out.samples if s.mode == IDEAL)
    assert sorted((s.mode, s.turn) for s in out.streams) == [(LOCAL, 1), (LOCAL, 2), (PULL, 1), (PULL, 2)]
    with pytest.raises(ValueError, match="concurrency 1"):
        await multiturn.drive([conv], lambda c: {}, [PULL], concurrency=2, progress=False, turn_timeout_s=5,
                              decode_counters=counters)


def test_the_local_policy_continues_on_d_always_within_a_high_slo():
    ((name, kind, params),) = parse_policy_specs(local_policy_spec())
    assert (name, kind) == ("bench-local", "cost")
    assert params == {"continue_on_decode": "always", "decode_itl_slo_ms": "60000"}
    from kvshuttle.control_plane.cost_model import PrefillCostModel

    policy = make_policy(kind, params, model=PrefillCostModel(), name=name)
    assert (policy.continue_on_decode, policy.decode_itl_slo_ms) == ("always", 60000.0)


def test_the_bench_s_scheduler_gets_the_local_policy_and_keeps_the_pull_mode_pulling():
    assert scheduler_env([PULL, LOCAL], "bench-local", {}) == {
        "KVSHUTTLE_SCHEDULER_POLICIES": local_policy_spec("bench-local"),
        "KVSHUTTLE_SCHEDULER_POLICY_PARAMS": "continue_on_decode=never"}
    t64 = "t64=threshold:pull_threshold_tokens=64"
    env = scheduler_env([PULL, LOCAL], "mine", {"KVSHUTTLE_SCHEDULER_POLICY": "threshold",
                                                 "KVSHUTTLE_SCHEDULER_POLICIES": f"{t64};"})
    assert env == {"KVSHUTTLE_SCHEDULER_POLICIES": f"{t64}; {local_policy_spec('mine')}"}
    assert [n for n, _, _ in parse_policy_specs(env["KVSHUTTLE_SCHEDULER_POLICIES"])] == ["t64", "mine"]
    assert scheduler_env([PULL], "x", {"KVSHUTTLE_SCHEDULER_POLICY_PARAMS": "explore_every=5"}) == {
        "KVSHUTTLE_SCHEDULER_POLICY_PARAMS": "explore_every=5,continue_on_decode=never"}
    assert scheduler_env([PULL], "x", {"KVSHUTTLE_SCHEDULER_POLICY_PARAMS": "continue_on_decode=auto"}) == {}


def test_the_bench_s_keys_give_each_gateway_mode_a_tenant_of_its_own(tmp_path):
    keys = bench_keys(tmp_path / "keys.json", [PULL, IDEAL, RECOMPUTE, LOCAL, "direct"])
    assert list(keys) == [PULL, RECOMPUTE, LOCAL] and len(set(keys.values())) == 3
    ring = KeyRing.load(str(tmp_path / "keys.json"))
    assert {m: ring.principal(k).tenant for m, k in keys.items()} == {PULL: "bench-pull", RECOMPUTE: "bench-recompute",
                                                                      LOCAL: "bench-local"}
    assert all(ring.principal(k).admin for k in keys.values())  # the bench lists the workers with one
    assert (tmp_path / "keys.json").stat().st_mode & 0o077 == 0
    assert bench_keys(tmp_path / "none.json", [IDEAL]) == {} and not (tmp_path / "none.json").exists()


def test_local_settings():
    cfg = parse_config(BenchConfig)
    assert LOCAL in cfg.mode_list and cfg.local_policy_name == "bench-local"
    assert cfg.new_bucket_edges == [0, 256, 1024, 4096]
    url = ["--gateway-url", "http://127.0.0.1:8000"]
    assert parse_config(BenchConfig, *url, "--local-policy", "on-d", "--local-api-key", "k").local_policy == "on-d"
    for argv, words in [
        (["--local-policy", "on d"], "--local-policy: a scheduler policy name"),
        (["--modes", "pull", "--local-policy", "on-d"], "--local-policy has no effect without local in --modes"),
        (["--local-api-key", "k"], "--local-api-key has no effect without --gateway-url"),
        (["--api-key", "k"], "--api-key has no effect without --gateway-url"),
        (["--new-buckets", "0,512,256"], "--new-buckets must be increasing integers"),
        (["--modes", "pull", "--new-buckets", "0,100"], "--new-buckets has no effect without local in --modes"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_config(BenchConfig, *argv)


async def test_the_local_policy_is_checked_on_the_gateway_before_the_run():
    answers = {"decision": LOCAL, "code": 200}
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(204)
        body = json.loads(request.content)
        calls.append(body.get("policy"))
        if "policy" not in body:
            return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "ok"}}],
                                             "kvshuttle": {"decision": RECOMPUTE}})
        if answers["code"] != 200:
            return httpx.Response(answers["code"], json={"error": {"message": "unknown policy 'nope'"}})
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "ok"}}],
                                         "kvshuttle": {"decision": answers["decision"], "reason_code": "x",
                                                       "reason": "why"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://gw") as client:
        assert (await check_local_policy(client, "on-d", "r1"))["decision"] == LOCAL
        assert calls == [None, "on-d"]
        answers["decision"] = PULL
        with pytest.raises(SystemExit, match="did not continue a later turn on D: decision pull"):
            await check_local_policy(client, "on-d", "r1")
        answers["code"] = 400
        with pytest.raises(SystemExit, match="the gateway refused a turn naming it .400: .*unknown policy"):
            await check_local_policy(client, "nope", "r1")
