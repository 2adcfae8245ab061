"""The third decision: continue a turn on the decode worker that holds its history (LOCAL), priced per decode worker
and never at the price of the decode inter-token SLO."""

from __future__ import annotations

import json

import pytest
from kvshuttle.control_plane import reasons
from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.control_plane.decision import Choice
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.policies import Outcome, PolicyError, make_policy
from kvshuttle.services.scheduler.learning import InvalidOutcome, outcome_of
from kvshuttle.v1 import scheduler_pb2

from tests.support.planning import BS, COVERED, PROMPT, W, handle_view, planner


def plan_with_holder(p, *, loads=None, policy="", prompt=PROMPT, handle=None, exclude=()):
    """A plan where the session's decode worker ``d`` is one of the decode workers (``d0`` is the other)."""
    return p.plan(prompt, handle_view() if handle is None else handle, prefill=[W("p0")], decode=[W("d0"), W("d")],
                  loads=loads or {}, source_worker="d", policy=policy, exclude=exclude)


def busy(running=0, waiting=0) -> WorkerLoad:
    return WorkerLoad(running=running, waiting=waiting)


def test_always_continues_a_safe_turn_on_the_worker_holding_it():
    p = planner(on_d="cost:continue_on_decode=always")
    got = plan_with_holder(p, policy="on_d")
    assert got.plan.choice is Choice.LOCAL and got.plan.code == reasons.LOCAL_ALWAYS
    assert got.decode.worker_id == "d"  # the holder, not the emptier d0
    # D's prefix cache holds whole blocks of the matched history: 96 of the 99 covered tokens, D computes the rest
    assert got.plan.reusable_tokens == COVERED // BS * BS and got.plan.compute_tokens == len(PROMPT) - 96
    assert got.plan.pullable_tokens == COVERED  # what the pull would have moved instead
    assert got.local is not None and got.local.cached_tokens == 96


@pytest.mark.parametrize("handle", [handle_view(expires_in_s=1.0), handle_view(claimed=True),
                                    handle_view(source_alive=False), handle_view(kv_freed="idle")])
def test_never_on_d_when_a_pull_would_be_unsafe(handle):
    got = plan_with_holder(planner(on_d="cost:continue_on_decode=always"), policy="on_d", handle=handle)
    assert got.plan.choice is Choice.RECOMPUTE and got.local is None


def test_never_on_d_when_the_prompt_diverges_from_what_d_holds():
    edited = PROMPT.copy()
    edited[3] = 7
    got = plan_with_holder(planner(on_d="cost:continue_on_decode=always"), policy="on_d", prompt=edited)
    assert got.plan.choice is Choice.RECOMPUTE and got.plan.code == reasons.DIVERGED


def test_an_excluded_holder_is_no_option():
    got = plan_with_holder(planner(on_d="cost:continue_on_decode=always"), policy="on_d", exclude=("d",))
    assert got.plan.choice is not Choice.LOCAL and got.local is None and got.decode.worker_id == "d0"


def test_the_threshold_policy_and_never_stay_disaggregated():
    for policy in ("t16", "off"):
        got = plan_with_holder(planner(off="cost:continue_on_decode=never"), policy=policy,
                               loads={"d": busy(running=1)})
        assert got.plan.choice is Choice.PULL and got.decode.worker_id == "d0"  # the emptier one


def test_auto_continues_on_d_when_predicted_as_fast_as_p():
    p = planner()  # priors: D priced like P; a busy P's queue makes D the faster
    got = plan_with_holder(p, loads={"p0": busy(running=4)})
    assert got.plan.choice is Choice.LOCAL and got.plan.code == reasons.LOCAL_FASTEST
    assert "vs" in got.plan.reason and "on p0" in got.plan.reason


def test_auto_stays_on_p_when_d_is_measured_slow():
    p = planner()
    for _ in range(6):  # D's local turns measured slow (its batch is long)
        p.observe(Outcome("p0", 103, 0, 10, 900.0, Choice.LOCAL, decode_worker="d", streams=2, pullable_tokens=99))
    got = plan_with_holder(p, loads={"d": busy(running=2)})
    assert got.plan.choice is Choice.PULL and "not continued on D" in got.plan.reason
    assert got.local.ms > 500


def test_the_decode_itl_slo_bounds_the_delay_to_d_s_streams():
    strict = "cost:continue_on_decode=always,decode_itl_slo_ms=1"
    p = planner(strict=strict)
    long_new = [*PROMPT, *range(5000, 8000)]  # 3,000 new tokens: a long prefill inside D's batch
    got = plan_with_holder(p, policy="strict", prompt=long_new, loads={"d": busy(running=3)})
    assert got.plan.choice is Choice.PULL and "inter-token SLO" in got.plan.reason
    assert got.local.itl_delay_ms > 1 and got.local.streams == 3
    # with no stream decoding on D there is nobody to delay
    got = plan_with_holder(p, policy="strict", prompt=long_new, loads={"d": busy()})
    assert got.plan.choice is Choice.LOCAL


def test_the_local_fit_learns_each_decode_worker_and_reports_its_prediction():
    model = PrefillCostModel()
    for computed, streams, ms in ((100, 0, 30.0), (1000, 0, 120.0), (500, 4, 95.0), (2000, 2, 240.0),
                                  (100, 8, 70.0), (1500, 1, 175.0)):
        model.observe_local("d", prompt_tokens=3000, computed_tokens=computed, streams=streams, ms=ms)
    # 20 ms + 100 ms per kilotoken + 5 ms per stream fits those six within a few ms
    for computed, streams, ms in ((100, 0, 30.0), (2000, 2, 240.0), (100, 8, 70.0)):
        predicted = model.predict_local("d", prompt_tokens=3000, cached_tokens=3000 - computed, streams=streams)
        assert predicted.ms == pytest.approx(ms, rel=0.15)
        assert predicted.itl_delay_ms < predicted.ms
    # an unmeasured decode worker predicts from the measured one; queued requests wait
    assert model.predict_local("d9", prompt_tokens=3000, cached_tokens=2900, streams=0).ms == pytest.approx(
        model.predict_local("d", prompt_tokens=3000, cached_tokens=2900, streams=0).ms)
    queued = model.predict_local("d", prompt_tokens=3000, cached_tokens=2900, streams=0, waiting=2)
    assert queued.ms == pytest.approx(3 * model.predict_local("d", prompt_tokens=3000, cached_tokens=2900,
                                                              streams=0).ms)
    state = json.loads(json.dumps(model.state()))
    assert PrefillCostModel.from_state(state).predict_local("d", prompt_tokens=3000, cached_tokens=1000,
                                                            streams=3) == model.predict_local(
        "d", prompt_tokens=3000, cached_tokens=1000, streams=3)


def test_a_local_outcome_teaches_the_local_fit_not_p_s():
    p = planner()
    before = p.model.compute_ms("p0", 500, 3000)
    p.observe(Outcome("p0", 3000, 0, 500, 80.0, Choice.LOCAL, decode_worker="d", streams=1, pullable_tokens=2900,
                      policy="cost"))
    assert p.model.compute_ms("p0", 500, 3000) == before
    assert p.model.local_fits()["d"].observations == 1
    assert p.regret.turns["cost"] == 1  # judged against the pull it could have made


def test_policy_parameters_are_checked():
    model = PrefillCostModel()
    with pytest.raises(PolicyError, match="continue_on_decode"):
        make_policy("cost", {"continue_on_decode": "sometimes"}, model=model)
    with pytest.raises(PolicyError, match="decode_itl_slo_ms"):
        make_policy("cost", {"decode_itl_slo_ms": "0"}, model=model)
    with pytest.raises(PolicyError, match="unknown parameter"):
        make_policy("threshold", {"continue_on_decode": "always"}, model=model)
    assert make_policy("cost", {}, model=model, decode_itl_slo_ms=40.0).decode_itl_slo_ms == 40.0
    assert make_policy("cost", {"decode_itl_slo_ms": "7"}, model=model, decode_itl_slo_ms=40.0).decode_itl_slo_ms == 7


def test_a_local_report_must_name_its_decode_worker_and_pull_nothing():
    base = dict(prefill_worker_id="p0", prompt_tokens=300, computed_tokens=20, prefill_ms=15.0,
                decision=scheduler_pb2.DECISION_LOCAL)
    outcome, _ = outcome_of(scheduler_pb2.ReportOutcomeRequest(**base, decode_worker_id="d", decode_streams=2))
    assert outcome.decision is Choice.LOCAL and outcome.decode_worker == "d" and outcome.streams == 2
    for bad in (dict(decode_worker_id=""), dict(decode_worker_id="d", pulled_tokens=5),
                dict(decode_worker_id="d", decode_streams=-1)):
        with pytest.raises(InvalidOutcome):
            outcome_of(scheduler_pb2.ReportOutcomeRequest(**base, **bad))


def test_a_report_names_its_model_and_the_cost_model_learns_it_per_model():
    base = dict(prefill_worker_id="p0", prompt_tokens=300, computed_tokens=300, prefill_ms=15.0,
                decision=scheduler_pb2.DECISION_RECOMPUTE)
    outcome, _ = outcome_of(scheduler_pb2.ReportOutcomeRequest(**base, model="org/big"))
    assert outcome.model == "org/big"
    with pytest.raises(InvalidOutcome, match="control characters"):
        outcome_of(scheduler_pb2.ReportOutcomeRequest(**base, model="big\n"))
