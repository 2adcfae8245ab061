"""`kvshuttle bench-gateway` at a tiny size (4 streams x 32 tokens) against real etcd, registry and gateway processes
and the bench's fake engines: every stream arrives complete (the detokenized text of the ids the fake decode engine
sent, token count from usage), the report has its fields, and nothing is left running."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
FIELDS = {"loop", "run", "streams", "tools_and_reasoning", "tokens", "complete_streams", "wall_s", "gateway_cpu_s",
          "gateway_user_s", "gateway_sys_s", "tokens_per_s",
          "gateway_cores", "tokens_per_core_s", "cores_per_10k_tokens_s", "itl_p50_ms", "itl_p99_ms",
          "held_under_bound"}


async def test_tiny_run_delivers_every_token_with_parsers_off_and_on(tools_model_dir, tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvshuttle.services.commands", "bench-gateway", "--streams", "1,4", "--tokens", "32",
        "--interval-ms", "2", "--repeats", "2", "--model-dir", str(tools_model_dir), "--out", str(tmp_path), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, stderr.decode()[-3000:]

    report = json.loads((tmp_path / "gateway.json").read_text())
    rows = report["kvshuttle"]
    assert [(r["tools_and_reasoning"], r["streams"], r["run"]) for r in rows] == [
        (tools, streams, run) for tools in (False, True) for streams in (1, 4) for run in (0, 1)]
    for r in rows:
        assert set(r) == FIELDS
        assert r["complete_streams"] == r["streams"] and r["tokens"] == 32 * r["streams"], r
        # /proc counts CPU in 10 ms ticks: a one-stream level of 32 tokens may read 0 (then no per-core rate)
        assert r["gateway_cpu_s"] >= 0, r
        if r["gateway_cpu_s"] > 0:
            assert r["tokens_per_core_s"] == pytest.approx(r["tokens"] / r["gateway_cpu_s"], abs=0.1), r
            assert r["cores_per_10k_tokens_s"] > 0, r
        else:
            assert r["tokens_per_core_s"] is None, r
        assert r["gateway_cpu_s"] == pytest.approx(r["gateway_user_s"] + r["gateway_sys_s"], abs=0.002), r
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"], r
    assert sum(r["gateway_cpu_s"] for r in rows) > 0
    assert report["smg"]
    if report["smg"]["rows"]:  # each run of a level through SMG right after kvshuttle's (side by side, alternating)
        emitted = [json.loads(line) for line in stdout.decode().splitlines() if line.startswith('{"loop"')]
        assert [(r["loop"], r["tools_and_reasoning"], r["streams"], r["run"]) for r in emitted] == [
            (loop, tools, streams, run) for tools in (False, True) for streams in (1, 4) for run in (0, 1)
            for loop in ("uvloop", "smg")]
        assert [(c["streams"], c["runs"], len(c["pair_ratios"])) for c in report["comparison"]] == [(1, 2, 2), (4, 2, 2)] * 2
    assert "tok/s/core" in stdout.decode()
