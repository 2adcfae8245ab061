"""A session's history, its decode worker's handle and planners over stand-in workers, for the control-plane unit
tests (decision, policies, reasons, prefill cache)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvshuttle.control_plane.cost_model import PrefillCostModel, PrefillPrior
from kvshuttle.control_plane.decision import HandleView
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import make_policy, parse_params
from kvshuttle.control_plane.prefix import prefix_digest, prefix_digests
from kvshuttle.control_plane.selection import make_selector

BS = 16
HISTORY = list(range(1000, 1100))  # 100 tokens: prompt + answer of the last turn
COVERED = 99  # D's handle covers all but the last generated token
PROMPT = HISTORY + [1, 2, 3]  # the next turn's prompt: the history extended
CHECKPOINTS = (12, 37, 70)  # earlier turns' boundaries: prefix lengths the record keeps digests of


def checkpoints_for(tokens, lengths=CHECKPOINTS) -> list[tuple[int, bytes]]:
    """``(n, digest of tokens[:n])`` for each length: a record's checkpoints, as HandleView takes them."""
    got = prefix_digests(tokens, lengths)
    return [(n, got[n]) for n in sorted(lengths)]


def handle_view(**over) -> HandleView:
    """D's handle for HISTORY (COVERED tokens in 7 blocks, checkpoints at CHECKPOINTS, alive, unclaimed, 300 s
    left); ``over`` changes fields."""
    params = {"do_remote_decode": True, "remote_engine_id": "d", "remote_host": "127.0.0.1",
              "remote_port": 5700, "remote_num_tokens": COVERED,
              "remote_block_ids": [list(range(7))]}
    base = dict(kv_transfer_params_json=json.dumps(params), covered_tokens=COVERED, block_size=BS,
                prefix_digest=prefix_digest(HISTORY, COVERED), checkpoints=checkpoints_for(HISTORY),
                expires_in_s=300.0, claimed=False, source_alive=True)
    base.update(over)
    return HandleView(**base)


@dataclass(frozen=True)
class W:
    """A worker as the planner sees it: just its id."""

    worker_id: str


def planner(prior: PrefillPrior | None = None, default: str = "cost", **policies: str) -> Planner:
    """A planner with the cost policy and ``t16`` (threshold 16), plus ``policies`` (name="kind:params")."""
    model = PrefillCostModel(prior)
    made = {"cost": make_policy("cost", {}, model=model),
            "t16": make_policy("threshold", {"pull_threshold_tokens": "16"}, model=model, name="t16")}
    for name, params in policies.items():
        kind, _, text = params.partition(":")
        made[name] = make_policy(kind, parse_params(text), model=model, name=name)
    return Planner(made, default, model, make_selector("load"))


def plan(p: Planner, prompt=PROMPT, handle=None, loads=None, prefill=("p0",), **kw):
    """``p``'s plan for ``prompt`` with ``handle`` (handle_view() by default) on prefill workers ``prefill``, d0."""
    return p.plan(prompt, handle_view() if handle is None else handle, prefill=[W(w) for w in prefill],
                  decode=[W("d0")], loads=loads or {}, source_worker="d", **kw)
