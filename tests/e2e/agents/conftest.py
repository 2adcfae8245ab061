"""One stack on the agent test model for the agent tests of this folder (test_agents, test_clients,
test_forced_calls): etcd, registry, scheduler, a vLLM prefill + decode pair (NIXL) and the stack's own gateway, with
the hermes tool-call parser and the qwen3 reasoning parser. Starting it once instead of once per module saves two vLLM
pair starts; it stops after this folder's last test.

* The stack's gateway takes API keys (tests/support/agent_stack.py ``KEYS``: ``unused`` and one per tenant in
  ``RUN_KEYS``), as test_agents needs; the clients and forced-call tests run on gateways of their own
  (tests/support/agent_stack.py ``gateways``: no keys, their own flags), so no two modules share a tenant, and no
  turn of one can find another's session.
* Idle sessions keep their KV (``KV_IDLE_LIMIT_S`` 0): freeing it reads a block on P, which P's counters, that the
  clients and forced-call tests compare, would count as a pull.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from kvshuttle.services.common.config import from_namespace
from kvshuttle.services.devtools.stack import Stack, StackConfig

from tests.support.agent_stack import KEYS


@pytest.fixture(scope="package")
async def agent_stack(agent_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("agent-stack")
    keys = work / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": tenant}
                                         for k, tenant in KEYS]}))
    cfg = from_namespace(StackConfig, environ={
        "KVSHUTTLE_STACK_WORK_DIR": str(work),
        "KVSHUTTLE_MODEL_DIR": str(agent_model_dir), "KVSHUTTLE_STACK_HTTP_PORT": "0",
        "KVSHUTTLE_STACK_GRPC_PORT": "0", "KVSHUTTLE_STACK_MAX_MODEL_LEN": "2048",
        "KVSHUTTLE_STACK_TOOL_CALL_PARSER": "hermes", "KVSHUTTLE_STACK_REASONING_PARSER": "qwen3",
    })
    stack = Stack(cfg, scheduler_env={"KVSHUTTLE_SCHEDULER_POLICY": "threshold",
                                      "KVSHUTTLE_SCHEDULER_KV_IDLE_LIMIT_S": "0"},
                  gateway_env={"KVSHUTTLE_GATEWAY_API_KEYS_FILE": str(keys)}, api_key="unused")
    try:
        await stack.start()
        yield stack
    finally:
        await stack.stop()
