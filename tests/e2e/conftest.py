"""One real stack for the whole end-to-end suite: etcd, registry, scheduler, gateway, vLLM prefill + decode.

Starting the vLLM pair costs ~45 s on 2 cores, so every e2e test shares it. Sessions use unique ids so tests do
not see each other's KV. Traces go to an in-test OTLP receiver.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.devtools.bench.policy_sweep import sweep_policies
from kvshuttle.services.devtools.stack import DemoConfig, Stack

from tests.support.otlp import OtlpReceiver


@pytest.fixture(scope="session")
async def otlp():
    receiver = OtlpReceiver()
    await receiver.start()
    yield receiver
    await receiver.stop()


@pytest.fixture(scope="session")
async def stack(model_dir, otlp, tmp_path_factory):
    work = tmp_path_factory.mktemp("stack")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export spans quickly (inherited by the services)
    cfg = from_namespace(DemoConfig, environ={
        "KVSHUTTLE_STACK_WORK_DIR": str(work), "KVSHUTTLE_MODEL_DIR": str(model_dir),
        "KVSHUTTLE_STACK_HTTP_PORT": "0", "KVSHUTTLE_STACK_GRPC_PORT": "0",
        "KVSHUTTLE_TRACES_EXPORTER": "otlp", "KVSHUTTLE_OTLP_ENDPOINT": otlp.endpoint,
        "KVSHUTTLE_STACK_MAX_MODEL_LEN": "4096", "KVSHUTTLE_STACK_TURNS": "3", "KVSHUTTLE_STACK_MAX_TOKENS": "16",
        # A production-like etcd: three members, every service given all endpoints (test_etcd_faults kills them).
        "KVSHUTTLE_STACK_ETCD_MEMBERS": "3",
    })
    # The e2e tests check the pull mechanics, so the default policy is the deterministic threshold one; the cost
    # policy runs by name in the policy sweep test (its lanes' policies are hosted here too).
    # Idle sessions keep their KV here: freeing it reads a block on P in the background, which would show in the
    # prefill counters that many tests compare (the idle limit is tested with stand-in engines, test_kv_manager;
    # pressure and room, which the small decode worker of test_kv_capacity needs, stay on).
    s = Stack(cfg, scheduler_env={"KVSHUTTLE_SCHEDULER_POLICY": "threshold",
                                  # on_d: continue on D whenever it can (test_local_turns)
                                  "KVSHUTTLE_SCHEDULER_POLICIES": sweep_policies() + "; on_d=cost:continue_on_decode="
                                                                  "always,decode_itl_slo_ms=60000",
                                  "KVSHUTTLE_SCHEDULER_KV_IDLE_LIMIT_S": "0"})
    try:
        await s.start()
        yield s
    finally:
        await s.stop()
    patterns = [str(work)] + [f"grpc_server.*--port {w.grpc_address.rsplit(':', 1)[1]}" for w in s.workers]
    leftovers = [subprocess.run(["pgrep", "-af", p], capture_output=True, text=True).stdout.strip()
                 for p in patterns]
    assert not any(leftovers), f"processes left running after the stack stopped:\n{leftovers}"
