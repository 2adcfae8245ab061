"""The agent model is trained on what the clients people use send (workers/agent_client_conversations.json): that
file must be what the pinned clients send now. Captured again here (no vLLM: the gateway's front ends on a stand-in
runner, tests/support/capture_clients.py); a difference means a client changed what it sends: capture again with
``python -m tests.support.capture_clients`` (the model then retrains on the new requests)."""

from __future__ import annotations

import json

import pytest
from kvshuttle.workers.model_builder import CLIENT_CONVERSATIONS_FILE

from tests.support.capture_clients import capture_all

pytestmark = pytest.mark.e2e


async def test_the_captured_conversations_are_what_the_pinned_clients_send(agent_model_dir):
    fresh = json.loads(json.dumps(await capture_all(agent_model_dir)))  # as the file holds it (tuples as lists)
    committed = json.loads(CLIENT_CONVERSATIONS_FILE.read_text())
    for client in sorted(set(fresh["requests"]) | set(committed["requests"])):
        assert fresh["fields"].get(client) == committed["fields"].get(client), client
        assert fresh["requests"].get(client) == committed["requests"].get(client), client
