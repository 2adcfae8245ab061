"""The online prefill cost model: it converges, adapts to a change, keeps priors where it has no data."""

from __future__ import annotations

import random

import pytest

from control_plane.cost_model import PrefillCostModel, PrefillPrior, RecursiveLeastSquares, features

TRUE = [8.0, 120.0, 15.0, 3.0, 6.0]  # fixed, per ktoken, per ktoken·kcontext, per kpulled, per transfer


def true_ms(weights, computed, context, pulled):
    return sum(w * x for w, x in zip(weights, features(computed, context, pulled), strict=True))


def turns(rng: random.Random, n: int):
    for _ in range(n):
        context = rng.randrange(200, 8000)
        pulled = rng.choice([0, rng.randrange(0, context - 50)])
        yield context, context - pulled, pulled


def feed(model: PrefillCostModel, weights, rng, n, noise=0.02):
    for context, computed, pulled in turns(rng, n):
        ms = true_ms(weights, computed, context, pulled) * (1 + rng.uniform(-noise, noise))
        model.observe("p0", prompt_tokens=context, computed_tokens=computed, pulled_tokens=pulled, prefill_ms=ms)


def relative_errors(model: PrefillCostModel, weights, rng) -> list[float]:
    errors = []
    for context, computed, pulled in turns(rng, 50):
        truth = true_ms(weights, computed, context, pulled)
        got = model.predict_ms("p0", prompt_tokens=context, computed_tokens=computed, pulled_tokens=pulled)
        errors.append(abs(got - truth) / truth)
    return sorted(errors)


def test_converges_from_wrong_priors():
    rng = random.Random(1)
    model = PrefillCostModel(PrefillPrior(fixed_ms=50, ms_per_ktoken=10, ms_per_ktoken_per_kcontext=1,
                                          ms_per_kpulled=20, ms_per_transfer=1))
    before = relative_errors(model, TRUE, random.Random(9))
    feed(model, TRUE, rng, 60)  # measurements with ±2% noise
    after = relative_errors(model, TRUE, random.Random(9))
    assert before[25] > 0.5, before[25]
    assert after[25] < 0.02 and after[45] < 0.1, (after[25], after[45])  # median and p90
    assert model.observations("p0") == 60


def test_adapts_within_a_few_turns_when_the_link_slows_down():
    rng = random.Random(2)
    model = PrefillCostModel()
    feed(model, TRUE, rng, 80)
    slow = [8.0, 120.0, 15.0, 40.0, 60.0]  # pulls now cost 13x per token and 10x per transfer
    pull_turn = {"prompt_tokens": 5000, "computed_tokens": 300, "pulled_tokens": 4700}
    stale = model.predict_ms("p0", **pull_turn)
    feed(model, slow, rng, 15)
    fresh = model.predict_ms("p0", **pull_turn)
    truth = true_ms(slow, 300, 5000, 4700)
    assert abs(stale - truth) / truth > 0.4 and abs(fresh - truth) / truth < 0.1, (stale, fresh, truth)


def test_a_worker_that_never_pulled_keeps_the_pull_priors():
    rng = random.Random(3)
    prior = PrefillPrior()
    model = PrefillCostModel(prior)
    for _ in range(200):  # recomputes only
        context = rng.randrange(200, 8000)
        model.observe("p0", prompt_tokens=context, computed_tokens=context, pulled_tokens=0,
                      prefill_ms=true_ms(TRUE, context, context, 0))
    fitted = model._models["p0"]
    assert fitted.theta[3] == pytest.approx(prior.ms_per_kpulled, abs=1e-6)
    assert fitted.theta[4] == pytest.approx(prior.ms_per_transfer, abs=1e-6)
    assert all(fitted.cov[i][i] <= prior.variance * (1 + 1e-9) for i in range(5))  # bounded, not blown up


def test_predicts_both_options_and_prefers_the_faster():
    rng = random.Random(4)
    model = PrefillCostModel()
    feed(model, TRUE, rng, 60)
    long_history = model.predict("p0", prompt_tokens=6000, reusable_tokens=5700)
    assert long_history.pull_is_faster and long_history.recompute_ms > 3 * long_history.pull_ms
    assert model.predict("p0", prompt_tokens=500, reusable_tokens=0).pull_ms is None

    slow = [8.0, 120.0, 15.0, 400.0, 300.0]  # a link so slow that a short history is cheaper to recompute
    feed(model, slow, rng, 40)
    short_history = model.predict("p0", prompt_tokens=300, reusable_tokens=256)
    assert not short_history.pull_is_faster


def test_p_s_own_cache_is_neither_pulled_nor_computed():
    model = PrefillCostModel(PrefillPrior(fixed_ms=0, ms_per_ktoken=100, ms_per_ktoken_per_kcontext=0,
                                          ms_per_kpulled=10, ms_per_transfer=0))
    got = model.predict("p0", prompt_tokens=3000, reusable_tokens=2000, cached_tokens=1000)
    assert got.recompute_ms == pytest.approx(200.0)  # 2000 tokens to compute
    assert got.pull_ms == pytest.approx(100.0 + 10.0)  # 1000 computed + 1000 pulled


def test_bad_observations_and_settings_are_refused():
    model = PrefillCostModel()
    with pytest.raises(ValueError):
        model.observe("p0", prompt_tokens=0, computed_tokens=0, pulled_tokens=0, prefill_ms=1)
    with pytest.raises(ValueError):
        model.observe("p0", prompt_tokens=10, computed_tokens=10, pulled_tokens=0, prefill_ms=-1)
    with pytest.raises(ValueError):
        RecursiveLeastSquares([0.0], 1.0, forgetting=0)
