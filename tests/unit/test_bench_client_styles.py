"""`kvshuttle bench-clients`' arithmetic on tapped turns (the turns themselves: tests/e2e/agents/test_clients.py, with the same
tap): later turns, found, P's pulled tokens over what the decode worker held, and the check of each turn."""

from __future__ import annotations

import json

from kvshuttle.services.devtools.bench.client_styles import format_rows, key_file, summarize
from kvshuttle.services.devtools.bench.turn_tap import TappedTurn, expected_pull

BS = 4


def tapped(session: str, source: str, pulled: int, history: list[int], prompt: int, decision: str = "pull"):
    return TappedTurn("/v1/chat/completions", 200, session, source, decision, "x", pulled, prompt - pulled,
                      {"external_kv_transfer": pulled, "local_compute": prompt - pulled}, history)


def test_the_share_is_what_p_pulled_of_what_the_decode_worker_held():
    first = list(range(10))  # turn 1: a prompt of 7, D holds 10 ids (covers 9)
    second = [*first[:6], 50, 51, 52, 53, 54, 55]  # diverges at 6: whole blocks of 6 -> 4 pulled
    third = [*second, 60, 61, 62, 63]  # extends all: D covers 11 -> all 11 pulled
    turns = [tapped("s", "new", 0, first, 7, "recompute"), tapped("s", "found", 4, second, 9),
             tapped("s", "found", 11, third, 13)]
    assert expected_pull(second[:9], first, BS) == 4 and expected_pull(third[:13], second, BS) == 11
    row = summarize("dropped", False, turns, BS)
    assert (row.later_turns, row.found, row.pulled, row.held, row.whole) == (2, 2, 15, 9 + 11, 1)
    assert row.share == 15 / 20 and row.problems == []
    wrong = summarize("dropped", False, [turns[0], tapped("s", "found", 0, second, 9, "recompute"), turns[2]], BS)
    assert len(wrong.problems) == 1 and "pulled 0" in wrong.problems[0] and "gives 4" in wrong.problems[0]
    table = format_rows([row, wrong], BS)
    assert "dropped" in table and "15 / 20" in table and "75%" in table


def test_each_run_is_a_tenant_of_its_own(tmp_path):
    keys = key_file(tmp_path / "keys.json", 3)
    entries = json.loads((tmp_path / "keys.json").read_text())["keys"]
    assert len(set(keys)) == 3 and [e["tenant"] for e in entries] == ["run0", "run1", "run2"]
