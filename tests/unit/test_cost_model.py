"""The online prefill cost model: it converges, adapts to a change, keeps priors where it has no data."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.control_plane.cost_model import (
    PrefillCostModel,
    PrefillPrior,
    _least_of_every_set,
    nonnegative_least_squares,
)

COMPUTE = (8.0, 120.0, 15.0)  # fixed ms, per ktoken, per ktoken·kcontext
LINK = (6.0, 3.0)  # per transfer, per kpulled


def true_ms(computed: int, context: int, pulled: int, compute=COMPUTE, link=LINK) -> float:
    k = computed / 1000
    ms = compute[0] + compute[1] * k + compute[2] * k * context / 1000
    return ms + (link[0] + link[1] * pulled / 1000 if pulled else 0.0)


def feed(model: PrefillCostModel, rng: random.Random, n: int, noise=0.02, link=LINK, pull_share=0.5) -> None:
    for _ in range(n):
        context = rng.randrange(100, 8000)
        # a pull loads the history and computes the new turn (16 to 800 tokens)
        pulled = context - rng.randrange(16, min(800, context - 16)) if rng.random() < pull_share else 0
        ms = true_ms(context - pulled, context, pulled, link=link) * (1 + rng.uniform(-noise, noise))
        model.observe("p0", prompt_tokens=context, computed_tokens=context - pulled, pulled_tokens=pulled,
                      prefill_ms=ms, source="d0")


def errors(model: PrefillCostModel, link=LINK) -> list[float]:
    rng = random.Random(9)
    out = []
    for _ in range(60):
        context = rng.randrange(100, 8000)
        reusable = context - rng.randrange(16, min(800, context - 16))
        got = model.predict("p0", prompt_tokens=context, reusable_tokens=reusable, source="d0")
        for predicted, truth in ((got.pull_ms, true_ms(context - reusable, context, reusable, link=link)),
                                 (got.recompute_ms, true_ms(context, context, 0))):
            out.append(abs(predicted - truth) / truth)
    return sorted(out)


def test_converges_from_wrong_priors():
    model = PrefillCostModel(PrefillPrior(fixed_ms=50, ms_per_ktoken=10, ms_per_ktoken_per_kcontext=1,
                                          ms_per_kpulled=20, ms_per_transfer=1))
    before = errors(model)
    feed(model, random.Random(1), 60)  # measurements with ±2% noise
    after = errors(model)
    assert before[60] > 0.3, before[60]
    assert after[60] < 0.04 and after[108] < 0.1, (after[60], after[108])  # median and p90
    computed_only, pulls = model.observations("p0")
    assert computed_only + pulls == 60 and pulls > 10


def test_adapts_within_a_few_turns_when_the_link_slows_down():
    rng = random.Random(2)
    model = PrefillCostModel()
    feed(model, rng, 80)
    slow = (60.0, 40.0)  # each pull now costs 10x more, each pulled token 13x
    turn = {"prompt_tokens": 5000, "reusable_tokens": 4700, "source": "d0"}
    stale = model.predict("p0", **turn).pull_ms
    feed(model, rng, 12, link=slow)  # about 6 of them pulls
    fresh = model.predict("p0", **turn).pull_ms
    truth = true_ms(300, 5000, 4700, link=slow)
    assert abs(stale - truth) / truth > 0.4 and abs(fresh - truth) / truth < 0.15, (stale, fresh, truth)


def test_a_worker_that_never_pulled_keeps_the_pull_priors_and_links_are_separate():
    rng = random.Random(3)
    prior = PrefillPrior()
    model = PrefillCostModel(prior)
    feed(model, rng, 100, pull_share=0.0)
    assert model.transfer_ms("p0", "d0", 2000) == pytest.approx(prior.ms_per_transfer + 2 * prior.ms_per_kpulled)
    feed(model, rng, 40, link=(50.0, 30.0))  # d0 is far away
    for _ in range(10):  # d1 is close: measured separately
        model.observe("p0", prompt_tokens=3000, computed_tokens=100, pulled_tokens=2900,
                      prefill_ms=true_ms(100, 3000, 2900, link=(1.0, 1.0)), source="d1")
    assert model.transfer_ms("p0", "d0", 2900) > 5 * model.transfer_ms("p0", "d1", 2900)
    assert model.transfer_ms("p0", "d9", 2900) == model.transfer_ms("p0", "d0", 2900)  # unseen: best-known link


def test_predicts_both_options_and_prefers_the_faster():
    model = PrefillCostModel()
    feed(model, random.Random(4), 60)
    long_history = model.predict("p0", prompt_tokens=6000, reusable_tokens=5700, source="d0")
    assert long_history.pull_is_faster and long_history.recompute_ms > 3 * long_history.pull_ms
    assert model.predict("p0", prompt_tokens=500, reusable_tokens=0).pull_ms is None

    slow = PrefillCostModel()
    feed(slow, random.Random(5), 60, link=(300.0, 400.0))  # a link so slow that a short history is cheaper to redo
    short_history = slow.predict("p0", prompt_tokens=300, reusable_tokens=256, source="d0")
    assert not short_history.pull_is_faster


def test_p_s_own_cache_is_neither_pulled_nor_computed():
    model = PrefillCostModel(PrefillPrior(fixed_ms=0, ms_per_ktoken=100, ms_per_ktoken_per_kcontext=0,
                                          ms_per_kpulled=10, ms_per_transfer=0))
    got = model.predict("p0", prompt_tokens=3000, reusable_tokens=2000, cached_tokens=1000)
    assert got.recompute_ms == pytest.approx(200.0)  # 2000 tokens to compute
    assert got.pull_ms == pytest.approx(100.0 + 10.0)  # 1000 computed + 1000 pulled


def test_fits_never_go_negative():
    # y = 2·x1 − 1·x2 unconstrained; with θ ≥ 0 the best fit drops x2
    a = [[2.0, 1.0], [1.0, 2.0]]
    b = [3.0, 0.0]
    theta = nonnegative_least_squares(a, b)
    assert min(theta) >= 0 and theta[1] == 0 and theta[0] == pytest.approx(1.5)
    model = PrefillCostModel()
    for _ in range(20):  # pulls "faster than computing the new tokens alone": noise, not negative transfer costs
        model.observe("p0", prompt_tokens=3000, computed_tokens=3000, pulled_tokens=0, prefill_ms=400.0)
        model.observe("p0", prompt_tokens=3000, computed_tokens=500, pulled_tokens=2500, prefill_ms=10.0, source="d")
    assert model.transfer_ms("p0", "d", 2500) >= 0


def test_bad_observations_and_settings_are_refused():
    model = PrefillCostModel()
    with pytest.raises(ValueError):
        model.observe("p0", prompt_tokens=0, computed_tokens=0, pulled_tokens=0, prefill_ms=1)
    with pytest.raises(ValueError):
        model.observe("p0", prompt_tokens=10, computed_tokens=10, pulled_tokens=0, prefill_ms=-1)
    for bad in ({"window": 1}, {"half_life": 0}, {"ms_per_kpulled": -1}, {"change_after": 0}):
        with pytest.raises(ValueError):
            PrefillPrior(**bad)


def test_sizes_measured_long_ago_still_pin_down_small_turns():
    rng = random.Random(6)
    model = PrefillCostModel()
    for _ in range(10):  # short prompts first (a conversation just started)...
        context = rng.randrange(80, 300)
        model.observe("p0", prompt_tokens=context, computed_tokens=context, pulled_tokens=0,
                      prefill_ms=true_ms(context, context, 0) * (1 + rng.uniform(-0.02, 0.02)))
    for _ in range(200):  # ...then only long ones for a long while
        context = rng.randrange(3000, 8000)
        model.observe("p0", prompt_tokens=context, computed_tokens=context, pulled_tokens=0,
                      prefill_ms=true_ms(context, context, 0) * (1 + rng.uniform(-0.02, 0.02)))
    small = model.predict("p0", prompt_tokens=150, reusable_tokens=0).recompute_ms
    assert abs(small - true_ms(150, 150, 0)) / true_ms(150, 150, 0) < 0.1, small


def test_a_worker_not_measured_yet_is_taken_to_be_like_the_measured_ones():
    model = PrefillCostModel(PrefillPrior(fixed_ms=1.0, ms_per_ktoken=1.0, ms_per_ktoken_per_kcontext=0.0))
    feed(model, random.Random(7), 40)  # p0 is measured: far slower than the priors say
    measured = model.predict("p0", prompt_tokens=2000, reusable_tokens=1900, source="d0")
    new = model.predict("p9", prompt_tokens=2000, reusable_tokens=1900, source="d0")
    assert new == measured and new.recompute_ms > 100
    assert model.predict("p9", prompt_tokens=2000, reusable_tokens=1900, source="d7") == measured


def test_a_worker_not_measured_yet_is_taken_to_be_like_its_own_models_workers():
    """Issue #37: workers of two models (group = the model) cost differently; an unmeasured worker is priced like
    the most-measured one of its own model, never another's (even one with more measurements), and a model none of
    whose workers was measured gets the priors. Links and turns continued on D alike; and the state keeps it."""
    rng = random.Random(3)
    model = PrefillCostModel(PrefillPrior(fixed_ms=1.0, ms_per_ktoken=1.0, ms_per_ktoken_per_kcontext=0.0))
    big, small = (80.0, 900.0, 40.0), (2.0, 20.0, 1.0)
    for group, worker, compute, n in (("big", "big-p0", big, 20), ("small", "small-p0", small, 60)):
        for _ in range(n):
            context = rng.randrange(100, 8000)
            pulled = context - 200 if rng.random() < 0.5 else 0
            model.observe(worker, prompt_tokens=context, computed_tokens=context - pulled, pulled_tokens=pulled,
                          prefill_ms=true_ms(context - pulled, context, pulled, compute=compute),
                          source=f"{group}-d0", group=group)
        model.observe_local(f"{group}-d0", prompt_tokens=2000, computed_tokens=100, streams=2,
                            ms=true_ms(100, 2000, 0, compute=compute), group=group)

    def recompute(worker: str, group: str) -> float:
        return model.predict(worker, prompt_tokens=2000, reusable_tokens=0, group=group).recompute_ms

    assert recompute("big-p9", "big") == pytest.approx(recompute("big-p0", "big"))
    assert recompute("small-p9", "small") == pytest.approx(recompute("small-p0", "small"))
    assert recompute("big-p9", "big") > 20 * recompute("small-p9", "small")
    assert recompute("new-p0", "new") == pytest.approx(1.0 + 2.0)  # nothing of the model measured: the priors
    assert model.reference_worker_of("big") == "big-p0" and model.reference_worker_of("small") == "small-p0"
    assert model.reference_worker is None  # no worker of the "" group
    pull = model.predict("big-p9", prompt_tokens=2000, reusable_tokens=1800, source="big-d9", group="big")
    assert pull.pull_ms > 10 * model.predict("small-p9", prompt_tokens=2000, reusable_tokens=1800,
                                             source="small-d9", group="small").pull_ms
    local = {g: model.predict_local(f"{g}-d9", prompt_tokens=2000, cached_tokens=1900, streams=2, group=g).ms
             for g in ("big", "small")}
    assert local["big"] > 10 * local["small"]

    again = PrefillCostModel.from_state(model.state(), model.prior)
    for worker, group in (("big-p9", "big"), ("small-p9", "small"), ("big-p0", "big")):
        assert again.predict(worker, prompt_tokens=2000, reusable_tokens=1800, source=f"{group}-d0",
                             group=group) == model.predict(worker, prompt_tokens=2000, reusable_tokens=1800,
                                                           source=f"{group}-d0", group=group)
    legacy = {k: v for k, v in model.state().items()
              if k not in ("groups", "most_measured_of", "most_link_in", "most_local_of")}
    assert PrefillCostModel.from_state(legacy, model.prior).reference_worker is None  # a state from before groups


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.floats(-5, 5), min_size=n, max_size=n), min_size=n + 1, max_size=3 * n),
    st.lists(st.floats(-5, 5), min_size=n, max_size=n))))
def test_the_kkt_search_finds_the_minimum_every_free_set_s_search_finds(case):
    """Least squares of random rows (A = XᵀX + I: positive-definite, as the fits' normal equations with priors are):
    the first free set that meets the KKT conditions gives the weights the exhaustive search over every set gives."""
    rows, b = case
    n = len(b)
    a = [[sum(r[i] * r[j] for r in rows) + (i == j) for j in range(n)] for i in range(n)]
    got, want = nonnegative_least_squares(a, b), _least_of_every_set(a, b)
    assert min(got) >= 0
    assert got == pytest.approx(want, abs=1e-9)
