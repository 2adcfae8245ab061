"""Pull-vs-recompute policies: same safety rules, different judgement of when a pull is worth it."""

from __future__ import annotations

import pytest

from control_plane.cost_model import PrefillPrior
from control_plane.decision import Choice
from control_plane.policies import CostPolicy, Outcome, PolicyError, ThresholdPolicy, make_policy, parse_params
from tests.unit.test_decision import COVERED, HISTORY, handle_view

PROMPT = HISTORY + [1, 2, 3]


def test_threshold_policy_is_vllm_s_rule():
    plan, predicted = ThresholdPolicy(pull_threshold_tokens=16).plan(PROMPT, handle_view(), prefill_worker="p")
    assert plan.choice is Choice.PULL and plan.reusable_tokens == COVERED and predicted is None
    plan, _ = ThresholdPolicy(pull_threshold_tokens=200).plan(PROMPT, handle_view(), prefill_worker="p")
    assert plan.choice is Choice.RECOMPUTE and "threshold 200" in plan.reason


def test_cost_policy_pulls_when_predicted_faster_and_says_by_how_much():
    plan, predicted = CostPolicy().plan(PROMPT, handle_view(), prefill_worker="p")
    assert plan.choice is Choice.PULL and predicted.pull_ms < predicted.recompute_ms
    assert "predicted pull" in plan.reason and "pull them all" in plan.reason


def test_cost_policy_recomputes_when_the_pull_is_predicted_slower():
    slow_link = PrefillPrior(ms_per_kpulled=5000.0, ms_per_transfer=100.0)
    plan, predicted = CostPolicy(prior=slow_link).plan(PROMPT, handle_view(), prefill_worker="p")
    assert plan.choice is Choice.RECOMPUTE and plan.reusable_tokens == 0
    assert plan.reason.startswith("cost model: recompute is faster") and predicted.pull_ms > predicted.recompute_ms


def test_cost_policy_never_pulls_what_is_unsafe():
    for handle in (handle_view(expires_in_s=1.0), handle_view(claimed=True), handle_view(source_alive=False)):
        plan, predicted = CostPolicy().plan(PROMPT, handle, prefill_worker="p")
        assert plan.choice is Choice.RECOMPUTE and predicted is None
    edited = PROMPT.copy()
    edited[5] = 7  # diverges in the first block: nothing verified to pull
    assert CostPolicy().plan(edited, handle_view(), prefill_worker="p")[0].choice is Choice.RECOMPUTE


def test_cost_policy_learns_that_pulls_got_slow_and_counts_regret():
    policy = CostPolicy()
    for _ in range(8):  # pulls of 4000 tokens now take 900 ms on p; recomputing 4100 tokens takes ~500 ms
        policy.observe(Outcome("p", 4100, 4000, 100, 900.0, Choice.PULL))
        policy.observe(Outcome("p", 4100, 0, 4100, 500.0, Choice.RECOMPUTE))
    predicted = policy.model.predict("p", prompt_tokens=4100, reusable_tokens=4000)
    assert not predicted.pull_is_faster
    assert policy.turns == 16 and policy.regrets >= 4 and policy.regret == policy.regrets / 16


def test_policies_are_made_by_name_with_checked_parameters():
    assert isinstance(make_policy("threshold", {"pull_threshold_tokens": "64"}), ThresholdPolicy)
    cost = make_policy("cost", parse_params("min_pull_tokens=8, forgetting=0.9, ms_per_kpulled=3.5"))
    assert isinstance(cost, CostPolicy) and cost.safety.pull_threshold_tokens == 8
    assert cost.model.prior.ms_per_kpulled == 3.5 and cost.model.forgetting == 0.9
    for name, params, words in [
        ("fastest", {}, "unknown policy"),
        ("threshold", {"pull_threshold_tokens": "x"}, "not a int"),
        ("threshold", {"pull_threshold_tokens": "0"}, ">= 1"),
        ("cost", {"forgetting": "2"}, "(0, 1]"),
        ("cost", {"bandwidth": "1"}, "unknown parameter(s) bandwidth"),
    ]:
        with pytest.raises(PolicyError, match=None) as err:
            make_policy(name, params)
        assert words in str(err.value), (name, params, str(err.value))
    with pytest.raises(PolicyError, match="key=value"):
        parse_params("a=1,b")
