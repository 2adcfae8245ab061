"""`kvshuttle bench-services` pieces that need no etcd: the goals against the floors, the claim transaction the etcd
limit row sends, the bare echo server."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import grpc
import pytest
from kvshuttle.services.common.config import ConfigError
from kvshuttle.services.devtools.bench import services_bench as sb
from kvshuttle.services.devtools.etcd_process import free_port
from kvshuttle.services.store.etcd_store import EtcdStore, claim_txn
from kvshuttle.v1 import common_pb2

from tests.support.configs import parse_config


def _cell(op: str, concurrency: int, ops_per_s: float, p99_ms: float = 5.0) -> sb.CellResult:
    return sb.CellResult(operation=op, label=sb.LABELS[op], concurrency=concurrency, requests=100, ok=100, errors=0,
                         wall_s=1.0, ops_per_s=ops_per_s, p50_ms=p99_ms / 2, p99_ms=p99_ms, mean_ms=p99_ms / 2,
                         max_ms=p99_ms, cpu_ms_per_op={}, error_samples=[])


def test_ratio_and_the_series_floor():
    assert sb.ratio(1.0, 4.0) == 0.25
    assert math.isnan(sb.ratio(1.0, 0.0)) and math.isnan(sb.ratio(math.nan, 1.0)) and math.isnan(sb.ratio(1, -1))
    # a hop as fast as the txn: in series on the same cores, at most half the txn's rate
    assert sb.series_floor_ratio(1000.0, 1000.0) == 0.5
    assert sb.series_floor_ratio(3000.0, 1000.0) == 0.75
    assert sb.series_floor_ratio(1000.0, 3000.0) == 0.25


def test_goals_name_the_grpc_floor_when_the_echo_itself_misses():
    results = [_cell(sb.GRPC_ECHO, 1, 1500, p99_ms=1.2), _cell(sb.GRPC_ECHO, 16, 3000, p99_ms=9.0),
               _cell(sb.PLAN_DISABLE_PULL, 1, 750, p99_ms=1.5), _cell(sb.PLAN_DISABLE_PULL, 16, 2400, p99_ms=11.0)]
    out = sb.goals(results)
    dp = out["claim_free"][sb.PLAN_DISABLE_PULL]
    assert (dp["peak_ops_per_s"], dp["peak_concurrency"], dp["best_p99_ms"], dp["best_p99_concurrency"]) == \
        (2400, 16, 1.5, 1)
    assert not dp["rate_met"] and not dp["p99_met"] and not dp["met"]
    assert dp["to_grpc_floor"] == {1: 0.5, 16: 0.8}
    assert dp["rate_floor"] == dp["p99_floor"] == "grpc"
    text = "\n".join(out["lines"])
    assert "5,000/s" in text and "p99 <= 1 ms" in text and "0.5x" in text  # the goals are printed
    assert "peak 2,400/s at conc 16" in text and "1: 0.50x, 16: 0.80x" in text
    assert "rate: stopped by the gRPC floor: the bare echo peaks at 3,000/s (conc 16)" in text
    assert "p99: stopped by the gRPC floor: the bare echo's best p99 is 1.20 ms (conc 1)" in text
    assert out["grpc_floor"] == {1: 1500, 16: 3000} and out["claiming"] == {}


def test_goals_blame_the_plan_when_the_echo_meets_them():
    results = [_cell(sb.GRPC_ECHO, 1, 6000, p99_ms=0.4), _cell(sb.PLAN_RECOMPUTE, 1, 2000, p99_ms=1.4)]
    rc = sb.goals(results)["claim_free"][sb.PLAN_RECOMPUTE]
    assert rc["rate_floor"] == rc["p99_floor"] == "planturn"
    lines = sb.goals(results)["lines"]
    assert any("rate: not the gRPC floor" in line and "0.33x of that" in line for line in lines)


def test_goals_met_needs_the_rate_and_the_p99_in_one_cell():
    results = [_cell(sb.PLAN_DISABLE_PULL, 1, 1000, p99_ms=0.5), _cell(sb.PLAN_DISABLE_PULL, 64, 6000, p99_ms=9)]
    out = sb.goals(results)
    dp = out["claim_free"][sb.PLAN_DISABLE_PULL]
    assert dp["rate_met"] and dp["p99_met"] and not dp["met"]
    assert dp["rate_floor"] == dp["p99_floor"] == ""  # no echo measured: no floor named
    assert any("no gRPC floor measured" in line for line in out["lines"])
    results.append(_cell(sb.PLAN_DISABLE_PULL, 16, 5200, p99_ms=0.9))
    assert sb.goals(results)["claim_free"][sb.PLAN_DISABLE_PULL]["met"]


def test_goals_put_claiming_plans_against_etcds_claim_rate():
    results = [_cell(sb.ETCD_CLAIM, 1, 1000), _cell(sb.ETCD_CLAIM, 16, 2000),
               _cell(sb.GRPC_ECHO, 1, 800), _cell(sb.GRPC_ECHO, 16, 6000),
               _cell(sb.PLAN_PULL_SNAPSHOT, 1, 400), _cell(sb.PLAN_PULL_SNAPSHOT, 16, 1200),
               _cell(sb.PLAN_PULL, 1, 300), _cell(sb.PLAN_PULL, 16, 800)]
    out = sb.goals(results)
    snap = out["claiming"][sb.PLAN_PULL_SNAPSHOT]
    assert snap["to_etcd_limit"] == {1: 0.4, 16: 0.6} and snap["met"] == {1: False, 16: True}
    assert snap["floor_ratio"][1] == pytest.approx(800 / 1800) and snap["floor"] == {1: "grpc", 16: ""}
    pull = out["claiming"][sb.PLAN_PULL]
    assert pull["met"] == {1: False, 16: False} and pull["floor"] == {1: "grpc", 16: "scheduler"}
    text = "\n".join(out["lines"])
    assert ("PlanTurn pull+snapshot vs etcd's claim txn, ratio at each conc (goal >= 0.5x): 1: 0.40x (400/s of "
            "1,000/s), 16: 0.60x (1,200/s of 2,000/s); MISSED at conc 1") in text
    assert ("MISSED at conc 1\n  conc 1: stopped by the gRPC floor: a gRPC hop (800/s bare) plus the txn on the same "
            "cores reach at most 0.44x (this plan: 0.40x)") in text
    assert "conc 16: not the floors (a gRPC hop plus the txn allow 0.75x): stopped by the scheduler's own work" in text
    assert out["etcd_limit"] == {1: 1000, 16: 2000}


def test_goals_without_an_etcd_row_say_so():
    lines = sb.goals([_cell(sb.PLAN_PULL, 1, 300)])["lines"]
    assert any("no etcd limit measured" in line for line in lines)


def test_the_scaled_rows_are_not_the_main_table():
    scaled = _cell(sb.GRPC_ECHO, 1, 9999)
    scaled.label += " @1024"
    assert sb.goals([scaled, _cell(sb.GRPC_ECHO, 1, 10)])["grpc_floor"] == {1: 10}


async def test_claim_txn_is_the_one_the_store_sends():
    """The etcd limit row's transaction (etcd_store.claim_txn) is the one EtcdStore.claims.claim sends."""
    store = EtcdStore("127.0.0.1:1")
    sent = []

    async def txn(compare, success, failure, **_):
        sent.append((list(compare), list(success), list(failure)))
        return SimpleNamespace(succeeded=False, responses=[SimpleNamespace(response_range=SimpleNamespace(kvs=[]))])

    store._kv = SimpleNamespace(txn=txn)
    known = common_pb2.Session(tenant="t", session_id="s1", revision=42, lease_id=7, decode_worker_id="d0",
                               kv_transfer_params_json="{}")
    known.expires_at.FromSeconds(int(time.time()) + 3600)
    result = await store.claims.claim("t", "s1", 42, now=time.time(), known=known)
    assert not result.claimed and len(sent) == 1
    assert sent[0] == claim_txn(store.keys, "t", "s1", 42, 7, "d0")
    assert claim_txn(store.keys, "t", "s1", 42, 7, "d0") != claim_txn(store.keys, "t", "s1", 42, 7, "")


async def test_the_echo_server_answers_fixed_size_replies():
    address = f"127.0.0.1:{free_port()}"
    server = asyncio.create_task(sb.serve_echo(address, 37))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 10)
            assert await channel.unary_unary(sb.ECHO_METHOD)(b"x" * 1000, timeout=5) == b"\x00" * 37
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    assert sb.echo_server_options() == [("grpc.max_receive_message_length", 4 << 20),
                                        ("grpc.max_send_message_length", 4 << 20)]


def test_cells_run_operation_by_operation_or_level_by_level():
    cfg = sb.ServicesBenchConfig(concurrency="1,4", operations="grpc_echo,etcd_claim")
    assert cfg.cells() == [("grpc_echo", 1), ("grpc_echo", 4), ("etcd_claim", 1), ("etcd_claim", 4)]
    cfg.order = "level"
    assert cfg.cells() == [("grpc_echo", 1), ("etcd_claim", 1), ("grpc_echo", 4), ("etcd_claim", 4)]


# -- settings that other settings make no-ops ------------------------------------------------------------------

def test_scale_history_tokens_needs_a_scaled_operation(capsys):
    with pytest.raises(ConfigError, match=r"--scale-history-tokens has no effect without record_turn, claim_session "
                                          r"or get_session in --operations"):
        parse_config(sb.ServicesBenchConfig, "--scale-history-tokens", "1024,131072", "--operations",
                     "plan_pull,plan_recompute")
    with pytest.raises(SystemExit) as exc:  # the command line: a usage error before anything starts
        sb.main(["--scale-history-tokens", "1024,131072", "--operations", "plan_pull"])
    assert exc.value.code == 2
    assert "--scale-history-tokens has no effect" in capsys.readouterr().err
    for ops in ("record_turn", "plan_pull,get_session", "claim_session"):
        cfg = parse_config(sb.ServicesBenchConfig, "--scale-history-tokens", "1024,131072", "--operations", ops)
        assert cfg.scale_sizes() == [1024, 131072]
    assert parse_config(sb.ServicesBenchConfig, "--scale-history-tokens", "1024").scale_sizes() == [1024]  # default ops


@pytest.mark.parametrize(("argv", "words"), [
    (["--turn-tokens", "64", "--operations", "claim_session"], "--turn-tokens has no effect without record_turn"),
    (["--new-tokens", "8", "--operations", "record_turn,etcd_claim"], "--new-tokens has no effect without plan_"),
    (["--claims", "registry", "--operations", "plan_disable_pull,record_turn"], "--claims has no effect without "
                                                                                "plan_recompute"),
    (["--channels", "4", "--operations", "local_recompute,etcd_claim"], "--channels has no effect when --operations "
                                                                        "holds only in-process plans and etcd_claim"),
    (["--order", "level", "--concurrency", "1", "--operations", "plan_pull,record_turn"], "--order has no effect"),
    (["--order", "level", "--operations", "plan_pull"], "--order has no effect unless --operations lists more"),
    (["--model-counts", "1,20", "--operations", "record_turn"], "--model-counts has no effect without plan_disable_pull"),
    (["--fleet-workers", "100"], "--fleet-workers has no effect without --model-counts"),
    (["--model-counts", "1,0"], "--model-counts must list integers >= 1"),
    (["--model-counts", "1,20", "--fleet-workers", "30"], "--fleet-workers must give every model"),
])
def test_settings_only_some_operations_use_need_one_of_them(argv, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(sb.ServicesBenchConfig, *argv)


@pytest.mark.parametrize("argv", [
    ["--turn-tokens", "64", "--operations", "record_turn"],
    ["--new-tokens", "8", "--operations", "grpc_echo"],
    ["--new-tokens", "8", "--operations", "local_disable_pull"],
    ["--claims", "registry", "--operations", "local_pull_snapshot"],
    ["--claims", "etcd", "--operations", "record_turn"],  # the default value: nothing to refuse
    ["--channels", "4", "--operations", "grpc_echo"],
    ["--order", "level", "--concurrency", "1,4", "--operations", "plan_pull,record_turn"],
    ["--order", "operation", "--operations", "plan_pull"],
    ["--model-counts", "20,1", "--fleet-workers", "40", "--operations", "local_disable_pull"],
    ["--turn-tokens", "64", "--new-tokens", "8", "--claims", "registry", "--channels", "2", "--order", "level",
     "--scale-history-tokens", "1024,4096"],  # every operation (the default): every setting has its effect
])
def test_the_valid_combinations_still_load(argv):
    parse_config(sb.ServicesBenchConfig, *argv)


def test_the_commands_own_env_vars_count_as_given():
    with pytest.raises(ConfigError, match=r"--turn-tokens \(set by KVSHUTTLE_BENCH_SERVICES_TURN_TOKENS\) has no "
                                          r"effect without record_turn"):
        parse_config(sb.ServicesBenchConfig, "--operations", "plan_pull",
                     environ={"KVSHUTTLE_BENCH_SERVICES_TURN_TOKENS": "64"})
