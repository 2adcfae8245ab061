"""Pricing each policy's choices with the side-by-side measurements of the same turn."""

from __future__ import annotations

from kvshuttle.services.devtools.bench.policy_sweep import (
    ALWAYS_PULL,
    COST,
    RECOMPUTE,
    format_sweep,
    price_turns,
    sweep_report,
)
from kvshuttle.services.devtools.bench.samples import TurnSample


def sample(mode: str, turn: int, ttft: float, *, history=0, pulled=0, decision="recompute", conv="c") -> TurnSample:
    return TurnSample(mode=mode, conversation=conv, turn=turn, prompt_tokens=history + 50, history_tokens=history,
                      new_tokens=50, ttft_ms=ttft, latency_ms=ttft + 10, output_tokens=8, decision=decision,
                      pulled_tokens=pulled, computed_tokens=50)


def test_thresholds_and_cost_choices_are_priced_with_the_same_turns_measurements():
    samples = [
        *(sample(m, 1, 100.0) for m in (ALWAYS_PULL, RECOMPUTE, COST)),  # turn 1: no history, left out
        # short history: recompute (20 ms) beats the pull (30 ms); the cost policy recomputed
        sample(ALWAYS_PULL, 2, 30.0, history=100, pulled=96, decision="pull"),
        sample(RECOMPUTE, 2, 20.0, history=100),
        sample(COST, 2, 22.0, history=100),
        # long history: the pull (50 ms) beats recomputing (400 ms); the cost policy pulled
        sample(ALWAYS_PULL, 3, 50.0, history=2000, pulled=1990, decision="pull"),
        sample(RECOMPUTE, 3, 400.0, history=2000),
        sample(COST, 3, 55.0, history=2000, pulled=1990, decision="pull"),
    ]
    rows = price_turns(samples, [16, 512])
    assert [r["turn"] for r in rows] == [2, 3]
    short, long = rows
    assert (short["threshold-16"], short["threshold-512"], short["cost-choices"], short["oracle"]) == (30, 20, 20, 20)
    assert (long["threshold-16"], long["threshold-512"], long["cost-choices"], long["oracle"]) == (50, 50, 50, 50)
    assert short["cost-picked-faster"] and long["cost-picked-faster"] and short["cost-live"] == 22.0

    report = sweep_report(rows, [16, 512], [1, 256, 1000])
    assert list(report["by_history"]) == ["1-256", "1000+"]
    assert report["by_history"]["1-256"]["threshold-16"]["mean"] == 30
    assert report["overall"]["cost-choices"]["mean"] == 35 and report["overall"]["threshold-16"]["mean"] == 40
    assert report["overall"]["cost_picked_faster"] == 1.0 and report["overall"]["cost_pulls"] == 1
    text = format_sweep(report)
    assert "cost-choices" in text and "20.0*" in text  # threshold-512 is the best fixed one on short histories


def test_a_turn_that_could_not_pull_costs_a_recompute_for_every_policy():
    samples = [sample(ALWAYS_PULL, 2, 90.0, history=300), sample(RECOMPUTE, 2, 80.0, history=300)]
    (row,) = price_turns(samples, [16])
    assert row["threshold-16"] == 80.0 and row["oracle"] == 80.0 and row["reusable_tokens"] == 0
