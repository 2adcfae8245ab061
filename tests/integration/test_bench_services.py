"""`kvshuttle bench-services` at a tiny size against real processes: the report's shape, and a clean stop."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from kvshuttle.services.common.config import load
from kvshuttle.services.devtools.bench.services_bench import LABELS, OPERATIONS, ServicesBenchConfig

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


async def _bench(*args: str, stderr=asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvshuttle.services.commands", "bench-services", *args, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=stderr)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie has exited too (its parent, the benchmark, is gone: init reaps it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_tiny_run_reports_every_operation_at_every_level(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = await _bench("--concurrency", "1,2", "--requests-per-level", "4", "--warmup-requests", "2",
                        "--out", str(out), "--work-dir", str(work), "--log-level", "WARNING")
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, stderr.decode()[-3000:]

    report = json.loads((out / "services.json").read_text())
    results = report["results"]
    assert sorted((r["operation"], r["concurrency"]) for r in results) == sorted(
        (op, c) for op in OPERATIONS for c in (1, 2))
    for r in results:
        where = f"{r['operation']} x{r['concurrency']}"
        assert r["errors"] == 0, (where, r["error_samples"])
        assert r["requests"] == r["ok"] >= 4, where
        assert r["ops_per_s"] > 0, where
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], where
        assert set(r["cpu_ms_per_op"]) == {"client", "registry", "scheduler", "etcd", "echo"}, where
    assert report["setup"]["history_tokens"] == 4096 and report["setup"]["prompt_tokens"] == 4096 + 64
    assert report["setup"]["scheduler_claims"].endswith("via etcd")  # the default, as `kvshuttle up` runs it

    setup = report["setup"]["grpc_echo"]
    assert setup["request_bytes"] > 4096 and 0 < setup["reply_bytes"] < setup["request_bytes"]
    goals = report["goals"]  # the goals next to the floors measured in the same run
    assert set(goals["claim_free"]) == {"plan_disable_pull", "plan_recompute", "local_disable_pull",
                                        "local_recompute"}
    assert set(goals["claiming"]) == {"plan_pull", "plan_pull_snapshot", "local_pull_snapshot"}
    assert goals["claim_free"]["local_disable_pull"]["rate_floor"] in ("", "planner")  # no gRPC under it
    assert set(goals["grpc_floor"]) == set(goals["etcd_limit"]) == {"1", "2"}
    for figures in goals["claiming"].values():
        assert all(x > 0 for x in figures["to_etcd_limit"].values())

    table = stdout.decode().splitlines()
    for label in LABELS.values():
        assert sum(line.startswith(label + "  ") for line in table) == 2, label
    assert sum(line.startswith("goals (#17): claim-free PlanTurn >= 5,000/s") for line in table) == 1
    assert (work / "logs" / "registry.log").is_file() and (work / "logs" / "scheduler.log").is_file()
    for name, info in report["processes"].items():  # everything it started is stopped
        assert info["pid"] and _gone(info["pid"]), name


async def test_plans_at_each_number_of_models_name_their_model(tmp_path):
    """--model-counts (issue #37): the plans at each count of models, each model with the same workers, and each
    p50 as a ratio to the first count's; every plan lands on the turn's model's workers (else it could not pull)."""
    out = tmp_path / "out"
    proc = await _bench("--concurrency", "1", "--requests-per-level", "4", "--warmup-requests", "0",
                        "--operations", "plan_disable_pull,local_disable_pull,plan_pull_snapshot",
                        "--model-counts", "1,3", "--fleet-workers", "12", "--out", str(out), "--log-level", "WARNING")
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    report = json.loads((out / "services.json").read_text())
    cells = [(r["operation"], r["models"]) for r in report["results"] if r["models"]]
    assert sorted(cells) == sorted((op, n) for op in ("plan_disable_pull", "local_disable_pull",
                                                      "plan_pull_snapshot") for n in (1, 3))
    assert all(r["errors"] == 0 for r in report["results"]), [r["error_samples"] for r in report["results"]]
    models = report["models"]
    assert models["counts"] == [1, 3] and models["workers_per_model"] == 4
    assert set(models["ratios"]) == {"plan_disable_pull", "local_disable_pull", "plan_pull_snapshot"}
    assert all(ratios["1"] == 1.0 and ratios["3"] > 0 for ratios in models["ratios"].values())
    assert "PlanTurn disable_pull p50 vs 1 model: 1: 1.00x" in stdout.decode()


async def test_plans_claim_through_the_registry_on_request(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    plans = "plan_recompute,plan_pull,plan_pull_snapshot"
    proc = await _bench("--claims", "registry", "--operations", plans, "--concurrency", "1",
                        "--requests-per-level", "4", "--warmup-requests", "0", "--out", str(out),
                        "--work-dir", str(work), "--log-level", "INFO")
    _, stderr = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    report = json.loads((out / "services.json").read_text())
    assert report["setup"]["scheduler_claims"].endswith("via registry")
    assert [(r["operation"], r["errors"]) for r in report["results"]] == [(op, 0) for op in plans.split(",")]
    assert "sessions are read and claimed via registry" in (work / "logs" / "scheduler.log").read_text()


async def test_ctrl_c_stops_every_child(tmp_path):
    proc = await _bench("--requests-per-level", "100000", "--out", str(tmp_path / "out"), "--log-level", "INFO")
    pids: dict[str, int] = {}
    async with asyncio.timeout(60):
        while "scheduler" not in pids:
            line = (await proc.stderr.readline()).decode()
            assert line, "bench-services exited before its services were up"
            found = re.search(r"(etcd|registry|scheduler) (?:on|serving on) \S+ \(pid (\d+)", line)
            if found:
                pids[found[1]] = int(found[2])
        await proc.stdout.readline()  # the table's header: measuring now
        proc.send_signal(signal.SIGINT)
        await proc.communicate()
    assert proc.returncode == 130
    assert set(pids) == {"etcd", "registry", "scheduler"}
    for name, pid in pids.items():
        assert _gone(pid), name
    assert not (tmp_path / "out" / "services.json").exists()


def test_settings_are_checked():
    cfg = load(ServicesBenchConfig, ["--concurrency", "2,8", "--operations", "get_session"])
    assert cfg.levels() == [2, 8] and cfg.operation_list() == ["get_session"]
    for bad in (["--concurrency", "0"], ["--concurrency", "a"], ["--operations", "nope"],
                ["--history-tokens", "8"], ["--claims", "nowhere"]):
        with pytest.raises(SystemExit):
            load(ServicesBenchConfig, bad)
