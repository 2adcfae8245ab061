"""The bench workload (services/devtools/bench/workload.py) is the same in another Python process with another hash
seed: run in a child interpreter (the rest of its tests, in-process, are tests/unit/test_bench_workload.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvshuttle.services.devtools.bench.workload import Conversation, Turn, agentic_conversations

CPU = dict(max_history_tokens=6000, system_tokens=1000, turn_tokens=(150, 600), max_tokens=32)


def _from_dict(data: dict) -> Conversation:
    return Conversation(**{**data, "turns": [Turn(**t) for t in data["turns"]]})


def test_same_output_in_another_process_with_another_hash_seed():
    code = ("import json, dataclasses; from kvshuttle.services.devtools.bench.workload import agentic_conversations as g; "
            "print(json.dumps([dataclasses.asdict(c) for c in g(count=2, seed=7, max_history_tokens=6000, "
            "system_tokens=1000, turn_tokens=(150, 600), max_tokens=32)]))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONHASHSEED": "12345"},
                         capture_output=True, text=True, check=True).stdout
    here = agentic_conversations(count=2, seed=7, **CPU)
    assert [_from_dict(c) for c in json.loads(out)] == here
