"""The captured client conversations (workers/agent_client_conversations.json, which the agent model is trained on):
complete, answered by the script, and documented: docs/agents.md names every field each client sends."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvshuttle.workers import agent_script as script
from kvshuttle.workers.model_builder import CLIENT_CONVERSATIONS_FILE, client_answer

DOC = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
CAPTURED = json.loads(CLIENT_CONVERSATIONS_FILE.read_text())


def test_every_client_ran_the_whole_conversation():
    for client, turns in CAPTURED["requests"].items():
        steps = [(t["kind"], t["step"]) for t in turns]
        if client == "aiperf":
            assert steps == [(f"aiperf:{c}", i) for c, conv in enumerate(script.AIPERF_CONVERSATIONS)
                             for i in range(len(conv))], client
        else:
            assert steps == [("client", i) for i in range(len(script.CLIENT_STEPS))], client
        for t in turns:
            assert client_answer(t["kind"], t["step"]).reasoning  # a reasoning model: every answer reasons
            assert t["messages"][-1]["role"] in ("user", "tool"), (client, t["step"])


def test_the_agents_page_names_every_field_the_clients_send():
    section = DOC[DOC.index("### What the clients people use send"):DOC.index("### Test models that render like")]
    named = set(re.findall(r"`([a-z_]+)`", section))
    for client, by_path in CAPTURED["fields"].items():
        for path, sent in by_path.items():
            missing = sorted(set(sent["body"]) - named)
            assert not missing, f"docs/agents.md does not name what {client} sends to {path}: {missing}"
