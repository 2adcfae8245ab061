"""vllm_command (the one description of a worker's vLLM) and VllmProcess's stop semantics."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from services.config import from_namespace
from workers import vllm_process
from workers.vllm_process import VllmProcess, WorkerConfig, vllm_command


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
    for _ in range(200):
        if ready.exists() and pidfile.exists() and pidfile.read_text():
            break
        await asyncio.sleep(0.05)
    child = int(pidfile.read_text())
    code = await proc.stop()
    assert code is not None
    await asyncio.sleep(0.2)
    try:
        os.kill(child, 0)
        # Still listed only as a zombie waiting for its new parent to reap it.
        with open(f"/proc/{child}/stat") as f:
            assert f.read().split(") ")[1].startswith("Z")
    except ProcessLookupError:
        pass
    assert str(child) in proc.log_tail()  # the child's output went to the log
