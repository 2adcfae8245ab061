"""`kvshuttle bench-gateway`'s SMG side without running it: whether SMG is driven (--smg required|auto|off), its
parser flags per mode, the kvshuttle ÷ SMG comparison per level, the streams held, the table, the process-tree CPU
reading, and what the fake engine tells SMG about the model."""

from __future__ import annotations

import json
import os

import pytest
from kvshuttle.services.common.config import ConfigError, load
from kvshuttle.services.devtools.bench import gateway_capacity as gc
from kvshuttle.services.devtools.bench.fake_engine import model_facts
from kvshuttle.services.devtools.bench.smg import SmgMissing


def row(loop, tools, streams, per_core, held=True):
    """A run of a level: ``streams`` * 10 tokens over the CPU seconds that make ``per_core``."""
    tokens = streams * 10
    return {"loop": loop, "streams": streams, "tools_and_reasoning": tools, "tokens": tokens,
            "complete_streams": streams, "wall_s": 1.0, "gateway_cpu_s": tokens / per_core if per_core else 0.0,
            "gateway_user_s": 0.4,
            "gateway_sys_s": 0.1, "tokens_per_s": 100.0,
            "gateway_cores": 0.5, "tokens_per_core_s": per_core,
            "cores_per_10k_tokens_s": round(10000 / per_core, 3) if per_core else None, "itl_p50_ms": 20.0,
            "itl_p99_ms": 30.0, "held_under_bound": held}


def test_smg_off_is_not_looked_for(tmp_path):
    assert gc.smg_plan("off", "nowhere/smg", root=tmp_path) == (None, "not measured (--smg off)")


def test_a_missing_smg_is_an_error_only_when_required(tmp_path):
    with pytest.raises(SmgMissing, match="make install"):
        gc.smg_plan("required", ".smg/bin/smg", root=tmp_path)
    binary, note = gc.smg_plan("auto", ".smg/bin/smg", root=tmp_path)
    assert binary is None and note.startswith("not measured: ") and "make install" in note


def test_an_installed_smg_is_driven_relative_to_the_root_or_absolute(tmp_path):
    smg = tmp_path / ".smg" / "bin" / "smg"
    smg.parent.mkdir(parents=True)
    smg.write_text("#!/bin/sh\n")
    for choice in ("auto", "required"):
        assert gc.smg_plan(choice, ".smg/bin/smg", root=tmp_path) == (smg, f"measured ({smg})")
    assert gc.smg_plan("auto", str(smg), root=tmp_path / "elsewhere")[0] == smg


def test_the_smg_flag_and_its_environment_variable(monkeypatch):
    assert load(gc.GatewayBenchConfig, []).smg == "auto"
    assert load(gc.GatewayBenchConfig, ["--smg", "off"]).smg == "off"
    monkeypatch.setenv("KVSHUTTLE_BENCH_GATEWAY_SMG", "required")
    monkeypatch.setenv("KVSHUTTLE_BENCH_GATEWAY_SMG_BIN", "/opt/smg")
    cfg = load(gc.GatewayBenchConfig, [])
    assert (cfg.smg, cfg.smg_bin) == ("required", "/opt/smg")
    with pytest.raises((ConfigError, SystemExit)):
        load(gc.GatewayBenchConfig, ["--smg", "sometimes"])


def test_smg_parsers_follow_the_mode():
    assert gc.smg_parser_flags(False, "hermes", "qwen3") == ("", "")
    assert gc.smg_parser_flags(True, "hermes", "qwen3") == ("hermes", "--reasoning-parser qwen3")
    assert gc.smg_parser_flags(True, "hermes", "") == ("hermes", "")
    with pytest.raises(ValueError, match="no SMG tool-call parser"):
        gc.smg_parser_flags(True, "mistral-ish", "qwen3")


def test_the_comparison_divides_per_core_throughput_level_by_level():
    kv = [row("asyncio", False, 1, 1000.0), row("asyncio", False, 64, 4000.0), row("uvloop", True, 64, 3000.0),
          row("asyncio", False, 512, None, held=False)]
    smg = [row("smg", False, 1, 2500.0), row("smg", False, 64, 16000.0, held=False), row("smg", True, 64, 6000.0)]
    got = gc.compare(kv, smg)
    assert [(c["loop"], c["tools_and_reasoning"], c["streams"], c["ratio_per_core"]) for c in got] == [
        ("asyncio", False, 1, 0.4), ("asyncio", False, 64, 0.25), ("uvloop", True, 64, 0.5),
        ("asyncio", False, 512, None)]
    assert got[1]["kvshuttle_cores_per_10k_tokens_s"] == 2.5 and got[1]["smg_cores_per_10k_tokens_s"] == 0.625
    assert got[1]["kvshuttle_held"] is True and got[1]["smg_held"] is False
    assert got[3]["smg_tokens_per_core_s"] is None and got[3]["smg_held"] is None  # SMG has no such level


def test_a_level_run_again_is_pooled_and_each_pair_shown():
    kv = [row("uvloop", True, 64, 3000.0), row("asyncio", True, 64, 2000.0), row("uvloop", True, 64, 4000.0),
          row("asyncio", True, 64, 1000.0)]
    smg = [row("smg", True, 64, 6000.0), row("smg", True, 64, 5000.0)]
    got = {c["loop"]: c for c in gc.compare(kv, smg)}
    assert list(got) == ["uvloop", "asyncio"]  # one row per level, in the order first run
    # each pair: the k-th run of a loop with SMG's k-th, measured right after it
    assert got["uvloop"]["pair_ratios"] == [0.5, 0.8] and got["asyncio"]["pair_ratios"] == [0.333, 0.2]
    # pooled: 1280 tokens over 640/3000 + 640/4000 CPU seconds; SMG's over 640/6000 + 640/5000
    assert got["uvloop"]["kvshuttle_tokens_per_core_s"] == 3428.6 and got["uvloop"]["smg_tokens_per_core_s"] == 5454.5
    assert got["uvloop"]["ratio_per_core"] == 0.629 and got["uvloop"]["runs"] == 2
    assert got["asyncio"]["ratio_per_core"] == round(1333.3 / 5454.5, 3)
    assert got["uvloop"]["kvshuttle_cores_per_10k_tokens_s"] == round(10000 / 3428.571, 3)


def test_a_level_is_held_only_when_every_run_held():
    kv = [row("uvloop", False, 64, 3000.0), row("uvloop", False, 64, 3000.0, held=False)]
    smg = [row("smg", False, 64, 6000.0), row("smg", False, 64, 6000.0)]
    (got,) = gc.compare(kv, smg)
    assert got["kvshuttle_held"] is False and got["smg_held"] is True
    assert gc.streams_held(kv + smg) == {"uvloop/off": 0, "smg/off": 64}


def test_streams_held_is_the_largest_level_held_per_loop_and_parsers():
    rows = [row("asyncio", False, 1, 1.0), row("asyncio", False, 64, 1.0), row("asyncio", False, 512, 1.0, False),
            row("asyncio", True, 1, 1.0, False), row("smg", True, 512, 1.0)]
    assert gc.streams_held(rows) == {"asyncio/off": 64, "asyncio/on": 0, "smg/on": 512}


def test_the_table_shows_both_gateways_and_the_ratio():
    kv, smg = [row("asyncio", False, 64, 4000.0)], [row("smg", False, 64, 16000.0)]
    report = {"kvshuttle": kv, "smg": {"status": "measured (/x/smg)", "rows": smg},
              "comparison": gc.compare(kv, smg), "streams_held": gc.streams_held(kv + smg)}
    text = gc.table(report)
    assert "tok/s/core" in text and "smg: measured (/x/smg)" in text and "kvs/smg" in text
    assert any(line.split()[:3] == ["smg", "off", "64"] for line in text.splitlines())
    # user / system CPU per token: 0.4 s and 0.1 s over 640 tokens
    assert "us/tok usr/sys" in text and any(line.split()[:3] == ["smg", "off", "64"] and "625/156" in line.split()
                                            for line in text.splitlines())
    # the comparison: loop, parsers, streams, runs, both tokens per core, the ratio, each pair's
    assert any(line.split()[:8] == ["asyncio", "off", "64", "1", "4000.0", "16000.0", "0.25", "0.25"]
               for line in text.splitlines())
    two = gc.compare(kv * 2, [row("smg", False, 64, 16000.0), row("smg", False, 64, 8000.0)])
    assert any(line.split()[:8] == ["asyncio", "off", "64", "2", "4000.0", "10666.7", "0.375", "0.25,0.5"]
               for line in gc.table({**report, "comparison": two}).splitlines())
    assert "asyncio/off 64, smg/off 64" in text
    missing = gc.table({"kvshuttle": kv, "smg": {"status": "not measured (--smg off)", "rows": []}, "comparison": []})
    assert "smg: not measured (--smg off)" in missing and "kvs/smg" not in missing


def test_tree_cpu_sums_the_process_and_its_descendants():
    cpu = {1: (0.75, 0.25), 2: (0.5, 0.0), 3: (0.125, 0.125), 4: (2.0, 0.0)}
    kids = {1: [2, 3], 2: [9], 3: [], 4: [], 9: []}  # 9 exited between the two reads

    def read(pid):
        if pid not in cpu:
            raise FileNotFoundError(pid)
        return cpu[pid]

    assert gc.tree_cpu_times(1, cpu_times=read, children=kids.__getitem__) == (1.375, 0.375)
    assert gc.tree_cpu_times(7, cpu_times=read, children=kids.__getitem__) == (0.0, 0.0)  # gone: nothing to read
    user, system = gc._cpu_times(os.getpid())  # read first: CPU time only grows, so the tree's later read is more
    tree_user, tree_sys = gc.tree_cpu_times(os.getpid())  # /proc itself
    assert user > 0 and tree_user >= user and tree_sys >= system


def test_the_fake_engine_reads_the_model_s_vocabulary_and_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096, "eos_token_id": 2}))
    assert model_facts(str(tmp_path)) == (4096, [2])
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "eos_token_id": [1, 7]}))
    assert model_facts(str(tmp_path)) == (10, [1, 7])
    assert model_facts("") == (0, [])
    assert model_facts(str(tmp_path / "missing")) == (0, [])


def test_a_level_too_short_for_a_cpu_tick_prints_as_none():
    kv, smg = [row("asyncio", False, 1, 1000.0)], [row("smg", False, 1, None)]  # 0 CPU ticks: no tokens per core
    text = gc.table({"kvshuttle": kv, "smg": {"status": "measured", "rows": smg}, "comparison": gc.compare(kv, smg)})
    assert any(line.split()[:3] == ["smg", "off", "1"] and "None" in line.split() for line in text.splitlines())


async def test_a_stream_whose_connection_fails_counts_as_incomplete_and_the_run_goes_on():
    """A reset connection (as 512 streams on two cores can see) is a stream that did not complete, not the end of
    the benchmark; an answer the gateway refused still ends it (that is a gateway fault, not load)."""
    import httpx

    def reset(request):
        raise httpx.ReadError("connection reset", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(reset), base_url="http://gw") as client:
        assert await gc._counted(client, {"messages": []}, []) == ("", 0)
    refused = httpx.MockTransport(lambda request: httpx.Response(503, json={"error": "full"}))
    async with httpx.AsyncClient(transport=refused, base_url="http://gw") as client:
        with pytest.raises(RuntimeError, match="HTTP 503"):
            await gc._counted(client, {"messages": []}, [])
