"""vllm_command (the one description of a worker's vLLM) and VllmProcess's stop semantics."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvshuttle.services.common.config import ConfigError, from_namespace
from kvshuttle.workers import vllm_process
from kvshuttle.workers.vllm_process import VllmProcess, WorkerConfig, vllm_command

from tests.support.waits import until


def test_command_and_env(tmp_path):
    cfg = WorkerConfig(role="prefill", model="/models/tiny/", grpc_port=50071, nixl_port=5600, cpu_bind="0",
                       work_dir=str(tmp_path), max_model_len=4096, python="python3")
    argv, env = vllm_command(cfg)
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.launchers.grpc_server"]
    args = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert args["--model"] == "/models/tiny/" and args["--served-model-name"] == "tiny"
    assert args["--port"] == "50071" and args["--dtype"] == "float32" and args["--max-model-len"] == "4096"
    assert "--enforce-eager" in argv
    kv = json.loads(args["--kv-transfer-config"])
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_load_failure_policy"] == "fail"
    assert kv["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 1,
                                               "decoder_kv_blocks_ttl": 480, "kv_lease_duration": 30}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
    assert env["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "prometheus")
    assert env["SMG_VLLM_SERVICER_WARMUP"] == "off" and env["SMG_VLLM_SERVICER_KV_EVENTS"] == "0"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert cfg.id == "prefill-127.0.0.1-50071"


def test_colocated_worker_has_no_kv_connector(tmp_path):
    argv, _ = vllm_command(WorkerConfig(role=vllm_process.COLOCATED, model="/m/tiny", work_dir=str(tmp_path)))
    assert "--kv-transfer-config" not in argv and argv[argv.index("--model") + 1] == "/m/tiny"


def test_config_from_env():
    cfg = from_namespace(WorkerConfig, environ={
        "KVSHUTTLE_WORKER_ROLE": "decode", "KVSHUTTLE_WORKER_MODEL": "/m", "KVSHUTTLE_WORKER_ENFORCE_EAGER": "0",
        "KVSHUTTLE_REGISTRY_ADDRESS": "reg:1", "KVSHUTTLE_WORKER_EXTRA_ARGS": "--seed 3"})
    argv, _ = vllm_command(cfg)
    assert cfg.registry == "reg:1" and "--enforce-eager" not in argv and argv[-2:] == ["--seed", "3"]


def test_vllm_traces_only_with_an_endpoint(tmp_path):
    argv, env = vllm_command(WorkerConfig(role="decode", model="/m", work_dir=str(tmp_path)))
    assert "--otlp-traces-endpoint" not in argv and "OTEL_SERVICE_NAME" not in env
    cfg = from_namespace(WorkerConfig, environ={"KVSHUTTLE_WORKER_ROLE": "prefill", "KVSHUTTLE_WORKER_MODEL": "/m",
                                                "KVSHUTTLE_WORKER_VLLM_OTLP_TRACES_ENDPOINT": "http://otel:4317"})
    argv, env = vllm_command(cfg)
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://otel:4317"
    assert env["OTEL_SERVICE_NAME"] == "vllm-prefill"


def test_tensor_parallel_size_only_when_above_one(tmp_path):
    argv, _ = vllm_command(WorkerConfig(role="decode", model="/m", work_dir=str(tmp_path)))
    assert "--tensor-parallel-size" not in argv  # the CPU command line is unchanged
    cfg = from_namespace(WorkerConfig, environ={"KVSHUTTLE_WORKER_ROLE": "decode", "KVSHUTTLE_WORKER_MODEL": "/m",
                                                "KVSHUTTLE_WORKER_TENSOR_PARALLEL_SIZE": "4"})
    argv, _ = vllm_command(cfg)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        WorkerConfig(role="decode", model="/m", tensor_parallel_size=0).validate()


REPO = Path(__file__).resolve().parents[2]


def _print_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`kvshuttle worker ... --print-vllm-command` as a real process, without the caller's KVSHUTTLE_* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
    return subprocess.run([sys.executable, "-m", "kvshuttle.services.commands", "worker", *args], cwd=REPO, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def _flags(argv: list[str]) -> dict[str, str]:
    return {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}


def test_print_vllm_command_from_flags(tmp_path):
    done = _print_command("--role", "decode", "--model", "/m", "--grpc-port", "50090", "--nixl-port", "5611",
                          "--tensor-parallel-size", "2", "--work-dir", str(tmp_path), "--python", "python3",
                          "--registry", "127.0.0.1:1", "--print-vllm-command")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"argv", "env"}
    cfg = WorkerConfig(role="decode", model="/m", grpc_port=50090, nixl_port=5611, tensor_parallel_size=2,
                       work_dir=str(tmp_path), python="python3")
    assert (out["argv"], out["env"]) == tuple(vllm_command(cfg))  # exactly what the worker would run
    args = _flags(out["argv"])
    assert args["--model"] == "/m" and args["--port"] == "50090" and args["--tensor-parallel-size"] == "2"
    kv = json.loads(args["--kv-transfer-config"])
    assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert out["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"
    assert not (tmp_path / "prometheus").exists()  # nothing was started or prepared


def test_print_vllm_command_from_env_only():
    done = _print_command(env={"KVSHUTTLE_WORKER_ROLE": "prefill", "KVSHUTTLE_WORKER_MODEL": "/models/x",
                               "KVSHUTTLE_WORKER_NIXL_PORT": "5700", "KVSHUTTLE_WORKER_EXTRA_ARGS": "--seed 3",
                               "KVSHUTTLE_WORKER_PRINT_VLLM_COMMAND": "1"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    args = _flags(out["argv"])
    assert args["--model"] == "/models/x" and args["--served-model-name"] == "x" and args["--seed"] == "3"
    assert "--tensor-parallel-size" not in args
    assert json.loads(args["--kv-transfer-config"])["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert out["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert out["env"]["VLLM_CACHE_ROOT"].endswith("prefill-127.0.0.1-50061/cache")


def test_print_vllm_command_still_validates():
    done = _print_command("--role", "decode", "--print-vllm-command")  # no --model
    assert done.returncode == 2 and "--model is required" in done.stderr and not done.stdout


STUBBORN = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open(%r, 'w').write('x'); time.sleep(60)"])
print(child.pid, flush=True)
open(%r, "w").write(str(child.pid))
time.sleep(60)
"""


async def test_stop_kills_the_whole_group(tmp_path, monkeypatch):
    ready, pidfile = tmp_path / "ready", tmp_path / "child.pid"
    script = STUBBORN % (str(ready), str(pidfile))
    monkeypatch.setattr(vllm_process, "vllm_command", lambda cfg: ([sys.executable, "-c", script], {}))
    proc = VllmProcess(WorkerConfig(role="decode", model="/m", work_dir=str(tmp_path), stop_grace_s=0.5))
    await proc.start()
    await until(lambda: ready.exists() and pidfile.exists() and pidfile.read_text(), 10, "the stubborn child")
    child = int(pidfile.read_text())
    code = await proc.stop()
    assert code is not None
    await until(lambda: not _alive(child), 5, "the child that ignores SIGTERM to be killed too")
    assert str(child) in proc.log_tail()  # the child's output went to the log


def _alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for its new parent to reap it."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ")[1].startswith("Z")
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_vllm_log_dash_sends_vllm_output_to_the_agents_stderr(tmp_path):
    """`--vllm-log -` (the Helm chart's setting): vLLM's command line and output land in the pod's log, on the
    agent's stderr, so the agent's stdout keeps only its ready marker; no vllm.log file is written."""
    script = ("import asyncio, sys\n"
              "from kvshuttle.workers import vllm_process\n"
              "from kvshuttle.workers.vllm_process import VllmProcess, WorkerConfig\n"
              "vllm_process.vllm_command = lambda cfg: (['sh', '-c', 'echo from-vllm; echo err-vllm >&2'], {})\n"
              f"cfg = WorkerConfig(role='decode', model='/m', work_dir={str(tmp_path)!r}, vllm_log='-')\n"
              "async def main():\n"
              "    p = VllmProcess(cfg)\n"
              "    await p.start()\n"
              "    print('marker', await p.wait())\n"
              "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "marker 0\n"
    assert "=== sh -c" in out.stderr and "from-vllm" in out.stderr and "err-vllm" in out.stderr
    assert not (tmp_path / "vllm.log").exists()
    cfg = WorkerConfig(role="decode", model="/m", work_dir=str(tmp_path))
    assert VllmProcess(cfg).log_path == tmp_path / "vllm.log"
    assert VllmProcess(dataclasses.replace(cfg, vllm_log=str(tmp_path / "x.log"))).log_path == tmp_path / "x.log"


def test_prefix_hash_settings_reach_vllm_and_the_index_scheme(tmp_path, monkeypatch):
    """vLLM gets the hash algorithm, and PYTHONHASHSEED (its block-hash seed) is the worker's setting: removed from
    an inherited environment by default, so the KV index's default scheme matches."""
    from kvshuttle.services.common.processes import child_env

    argv, env = vllm_command(WorkerConfig(role="prefill", model="/m", work_dir=str(tmp_path)))
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256" and env["PYTHONHASHSEED"] is None
    monkeypatch.setenv("PYTHONHASHSEED", "12")
    assert "PYTHONHASHSEED" not in child_env(env) and child_env(env)["HF_HUB_OFFLINE"] == "1"
    cfg = from_namespace(WorkerConfig, environ={
        "KVSHUTTLE_WORKER_ROLE": "prefill", "KVSHUTTLE_WORKER_MODEL": "/m",
        "KVSHUTTLE_WORKER_PREFIX_HASH_SEED": "4294967295", "KVSHUTTLE_WORKER_PREFIX_HASH_ALGO": "sha256_cbor"})
    argv, env = vllm_command(cfg)
    assert env["PYTHONHASHSEED"] == "4294967295" and child_env(env)["PYTHONHASHSEED"] == "4294967295"
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    scheme = cfg.prefix_hash_scheme(block_size=128)
    assert (scheme.algo, scheme.seed, scheme.block_size) == ("sha256_cbor", "4294967295", 128)
    assert WorkerConfig(role="prefill", model="/m").prefix_hash_scheme(16).seed is None  # vLLM's default seed
    for bad in ("4294967296", "-1", "random", "0x10", "\u00b2"):
        with pytest.raises(ConfigError, match="prefix-hash-seed"):
            from_namespace(WorkerConfig, environ={"KVSHUTTLE_WORKER_ROLE": "prefill", "KVSHUTTLE_WORKER_MODEL": "/m",
                                                  "KVSHUTTLE_WORKER_PREFIX_HASH_SEED": bad})
    with pytest.raises(ConfigError):
        from_namespace(WorkerConfig, environ={"KVSHUTTLE_WORKER_ROLE": "prefill", "KVSHUTTLE_WORKER_MODEL": "/m",
                                              "KVSHUTTLE_WORKER_PREFIX_HASH_ALGO": "xxhash"})
