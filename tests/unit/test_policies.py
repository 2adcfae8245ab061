"""Pull-vs-recompute policies and the planner: same safety rules, different judgement of when a pull is worth it."""

from __future__ import annotations

import json

import pytest
from kvshuttle.control_plane.cost_model import PrefillCostModel, PrefillPrior
from kvshuttle.control_plane.decision import Choice
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.policies import (
    Outcome,
    PolicyError,
    ThresholdPolicy,
    make_policy,
    make_prior,
    parse_params,
    parse_policy_specs,
)
from kvshuttle.control_plane.prefix import prefix_digest

from tests.support.planning import COVERED, PROMPT, handle_view, plan, planner


def test_threshold_policy_is_vllm_s_rule():
    p = planner(t200="threshold:pull_threshold_tokens=200")
    got = plan(p, policy="t16")
    assert got.plan.choice is Choice.PULL and got.plan.reusable_tokens == COVERED and got.policy.name == "t16"
    got = plan(p, policy="t200")
    assert got.plan.choice is Choice.RECOMPUTE and "threshold 200" in got.plan.reason
    assert got.plan.pullable_tokens == COVERED  # the option not taken, for regret


def test_cost_policy_pulls_when_predicted_faster_and_says_by_how_much():
    got = plan(planner())
    assert got.plan.choice is Choice.PULL and got.prediction.pull_ms < got.prediction.recompute_ms
    assert "predicted pull" in got.plan.reason and "pull them all" in got.plan.reason


def test_cost_policy_recomputes_when_the_pull_is_predicted_slower():
    p = planner(PrefillPrior(ms_per_kpulled=5000.0, ms_per_transfer=100.0))
    for _ in range(3):  # measured pulls on this link (past the warm-up that pulls anyway to measure)
        p.observe(Outcome("p0", 103, 99, 4, 600.0, Choice.PULL, source_worker="d", policy="cost"))
    got = plan(p)
    assert got.plan.choice is Choice.RECOMPUTE and got.plan.reusable_tokens == 0 and got.plan.pullable_tokens == 99
    assert got.plan.reason.startswith("cost model: recompute is faster")
    assert got.prediction.pull_ms > got.prediction.recompute_ms


def test_a_new_link_is_measured_before_the_model_is_trusted():
    p = planner(PrefillPrior(ms_per_kpulled=50.0, ms_per_transfer=20.0))  # priors say: slower than recomputing
    got = plan(p)
    assert got.plan.choice is Choice.PULL and "keep measuring this link" in got.plan.reason


def test_no_policy_pulls_what_is_unsafe():
    for policy in ("cost", "t16"):
        p = planner()
        for handle in (handle_view(expires_in_s=1.0), handle_view(claimed=True), handle_view(source_alive=False)):
            assert plan(p, handle=handle, policy=policy).plan.choice is Choice.RECOMPUTE
        edited = PROMPT.copy()
        edited[5] = 7  # diverges in the first block: nothing verified to pull
        assert plan(p, prompt=edited, policy=policy).plan.choice is Choice.RECOMPUTE


def test_a_pull_predicted_to_end_too_close_to_expiry_is_refused():
    p = planner()
    for _ in range(6):  # this link's pulls take ~3 s
        p.observe(Outcome("p0", 103, 99, 4, 3000.0, Choice.PULL, source_worker="d", policy="t16"))
    assert plan(p, handle=handle_view(expires_in_s=60.0), policy="t16").plan.choice is Choice.PULL
    got = plan(p, handle=handle_view(expires_in_s=4.5), policy="t16")  # 4.5 s left - 3 s pull < 2 s guard
    assert got.plan.choice is Choice.RECOMPUTE and "expiry" in got.plan.reason, got.plan.reason
    busy = {"p0": WorkerLoad(running=1, waiting=2)}  # and waiting at P counts too
    got = plan(p, handle=handle_view(expires_in_s=9.0), loads=busy, policy="t16")
    assert got.plan.choice is Choice.RECOMPUTE and got.wait_ms > 8000, (got.wait_ms, got.plan.reason)


def test_the_cost_policy_learns_that_pulls_got_slow_and_regret_is_counted():
    p = planner()
    p.observe(Outcome("p0", 4100, 0, 4100, 500.0, Choice.RECOMPUTE, policy="cost"))
    regrets = [p.observe(Outcome("p0", 4100, 4000, 100, 900.0, Choice.PULL, source_worker="d", policy="cost"))
               for _ in range(8)]  # pulls of 4000 tokens take 900 ms; recomputing 4100 tokens takes ~500 ms
    assert regrets[-1] is True and p.regret.regret("cost") > 0.5
    prompt = list(range(4100))
    assert not p.model.predict("p0", prompt_tokens=4100, reusable_tokens=4000, source="d").pull_is_faster
    # a recompute that could not have pulled has no alternative: not judged
    assert p.observe(Outcome("p0", 4100, 0, 4100, 500.0, Choice.RECOMPUTE, policy="cost")) is None
    # a recompute that could have pulled, when pulls are this slow, was right
    assert p.observe(Outcome("p0", 4100, 0, 4100, 500.0, Choice.RECOMPUTE, source_worker="d",
                             pullable_tokens=4000, policy="cost")) is False
    assert p.regret.turns["cost"] == 9 and p.reported == 11 and len(prompt) == 4100


def test_the_prefill_worker_is_the_one_predicted_to_start_and_finish_first():
    p = planner()
    got = plan(p, prefill=("p0", "p1"), loads={"p0": WorkerLoad(running=2), "p1": WorkerLoad()})
    assert got.prefill.worker_id == "p1" and "0 request(s) ahead" in got.worker_choice
    # p1 is idle but its link to the session's decode worker is very slow: p0's queue is the smaller cost
    for _ in range(6):
        p.observe(Outcome("p1", 3000, 2900, 100, 2500.0, Choice.PULL, source_worker="d", policy="cost"))
        p.observe(Outcome("p1", 3000, 0, 3000, 300.0, Choice.RECOMPUTE, policy="cost"))
        p.observe(Outcome("p0", 3000, 0, 3000, 300.0, Choice.RECOMPUTE, policy="cost"))
        p.observe(Outcome("p0", 3000, 2900, 100, 30.0, Choice.PULL, source_worker="d", policy="cost"))
    history = list(range(2990))
    params = json.loads(handle_view().kv_transfer_params_json) | {"remote_num_tokens": 2989,
                                                                  "remote_block_ids": [list(range(187))]}
    handle = handle_view(kv_transfer_params_json=json.dumps(params), covered_tokens=2989,
                         prefix_digest=prefix_digest(history, 2989), checkpoints=())
    got = plan(p, prompt=history + [1] * 10, handle=handle, prefill=("p0", "p1"),
               loads={"p0": WorkerLoad(running=2), "p1": WorkerLoad()})
    assert got.prefill.worker_id == "p0" and got.plan.choice is Choice.PULL, (got.worker_choice, got.plan.reason)


def test_idle_workers_share_the_turns_and_unreachable_ones_are_avoided():
    p = planner()
    picks = {plan(p, prefill=("p0", "p1", "p2")).prefill.worker_id for _ in range(6)}
    assert picks == {"p0", "p1", "p2"}
    down = {"p0": WorkerLoad(reachable=False), "p2": WorkerLoad(reachable=False)}
    assert {plan(p, prefill=("p0", "p1", "p2"), loads=down).prefill.worker_id for _ in range(6)} == {"p1"}
    assert plan(p, prefill=("p0",), loads=down).prefill.worker_id == "p0"  # the last one left is still used
    assert plan(p, prefill=("p0",), exclude={"p0"}) is None


def test_policies_are_made_by_name_with_checked_parameters():
    model = PrefillCostModel()
    assert isinstance(make_policy("threshold", {"pull_threshold_tokens": "64"}, model=model), ThresholdPolicy)
    cost = make_policy("cost", parse_params("min_pull_tokens=8, explore_every=5"), model=model)
    assert cost.safety.pull_threshold_tokens == 8 and cost.explore_every == 5
    assert make_prior(parse_params("ms_per_kpulled=3.5, window=20")).window == 20
    assert parse_policy_specs("t64=threshold:pull_threshold_tokens=64; c = cost") == [
        ("t64", "threshold", {"pull_threshold_tokens": "64"}), ("c", "cost", {})]
    for make, words in [
        (lambda: make_policy("fastest", {}, model=model), "unknown policy"),
        (lambda: make_policy("threshold", {"pull_threshold_tokens": "x"}, model=model), "not an int"),
        (lambda: make_policy("threshold", {"pull_threshold_tokens": "0"}, model=model), ">= 1"),
        (lambda: make_policy("cost", {"explore_ratio": "0.5"}, model=model), "explore_ratio >= 1"),
        (lambda: make_policy("cost", {"bandwidth": "1"}, model=model), "unknown parameter(s) bandwidth"),
        (lambda: make_prior({"half_life": "0"}), "half_life"),
        (lambda: make_prior({"speed": "1"}), "unknown parameter(s) speed"),
        (lambda: parse_policy_specs("threshold"), "name=kind"),
        (lambda: parse_policy_specs("a b=threshold"), "letters, digits"),
        (lambda: parse_params("a=1,b"), "key=value"),
        (lambda: planner().policy("nope"), "unknown policy 'nope'"),
    ]:
        with pytest.raises(PolicyError) as err:
            make()
        assert words in str(err.value), (words, str(err.value))


def test_near_a_tie_the_cost_policy_pulls():
    p = planner(PrefillPrior(ms_per_kpulled=0.0, ms_per_transfer=0.0))
    for _ in range(3):  # measured pulls on the link: past the warm-up
        p.observe(Outcome("p0", 103, 99, 4, 21.0, Choice.PULL, source_worker="d", policy="cost"))
    got = plan(p)
    pull, recompute = got.prediction.pull_ms, got.prediction.recompute_ms
    assert recompute < pull < recompute / 0.9, (pull, recompute)  # recompute predicted faster, but by under 10%
    assert got.plan.choice is Choice.PULL
    strict = planner(PrefillPrior(ms_per_kpulled=0.0, ms_per_transfer=0.0), c0="cost:recompute_margin=0")
    for _ in range(3):
        strict.observe(Outcome("p0", 103, 99, 4, 21.0, Choice.PULL, source_worker="d", policy="c0"))
    assert plan(strict, policy="c0").plan.choice is Choice.RECOMPUTE
