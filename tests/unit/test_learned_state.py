"""The planner's learned state, snapshotted and loaded: a replica that starts from a snapshot and then sees the same
turns stays bit-for-bit the replica that ran all along."""

from __future__ import annotations

import copy
import json
import random

import pytest
from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.control_plane.decision import Choice
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import Outcome, make_policy, make_prior, parse_params
from kvshuttle.control_plane.selection import make_selector

PARAMS = "window=6, change_after=3"
WORKERS = ("p0", "p1", "p2")
SOURCES = ("d0", "d1")
SPEED = {"p0": (8.0, 120.0, 15.0), "p1": (12.0, 90.0, 10.0), "p2": (5.0, 150.0, 20.0)}  # fixed, /ktok, /ktok·kctx
LINK = {(p, d): (4.0 + i, 2.0 + i / 2) for i, (p, d) in enumerate((p, d) for p in WORKERS for d in SOURCES)}


def make_planner() -> Planner:
    """As the scheduler makes it: one cost model shared by the policies."""
    model = PrefillCostModel(make_prior(parse_params(PARAMS)))
    policies = {"cost": make_policy("cost", {}, model=model),
                "t16": make_policy("threshold", {"pull_threshold_tokens": "16"}, model=model, name="t16")}
    return Planner(policies, "cost", model, make_selector("load"))


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def outcomes(rng: random.Random, n: int, *, slow_after: int | None = None) -> list[Outcome]:
    """``n`` turns over 3 prefill and 2 decode workers: pulls and recomputes (some with a prefix-cache hit, some that
    could have pulled) of varied sizes; from turn ``slow_after`` on, p1 computes 3x slower and p0's link to d1
    pulls 5x slower."""
    out = []
    for i in range(n):
        worker, source = rng.choice(WORKERS), rng.choice(SOURCES)
        slow = slow_after is not None and i >= slow_after
        fixed, per_k, per_kk = SPEED[worker]
        compute_scale = 3.0 if slow and worker == "p1" else 1.0
        context = rng.randrange(40, 9000)
        if rng.random() < 0.5:  # a pull of the history, computing the new turn
            pulled = context - rng.randrange(16, max(17, min(800, context - 16)))
            computed, cached_estimate, pullable = context - pulled, 0, 0
        else:  # a recompute, maybe on the worker that holds part of the prompt in its prefix cache
            pulled = 0
            cached_estimate = (rng.randrange(0, context) // 16) * 16 if rng.random() < 0.4 else 0
            hit = int(cached_estimate * rng.choice((1.0, 1.0, 0.5, 0.0)))
            computed = context - hit
            pullable = context - 20 if rng.random() < 0.5 else 0
        k = computed / 1000
        ms = compute_scale * (fixed + per_k * k + per_kk * k * context / 1000)
        if pulled:
            latency, per_kpulled = LINK[(worker, source)]
            ms += (5.0 if slow and (worker, source) == ("p0", "d1") else 1.0) * (latency + per_kpulled * pulled / 1000)
        ms *= 1 + rng.uniform(-0.05, 0.05)
        if rng.random() < 0.1:
            ms = round(ms)  # an int now and then: JSON must keep it one
        out.append(Outcome(worker, context, pulled, computed, ms, Choice.PULL if pulled else Choice.RECOMPUTE,
                           source_worker=source if pulled or pullable else "", pullable_tokens=pullable,
                           policy=rng.choice(("cost", "t16")), cached_estimate=cached_estimate))
    return out


def predictions(p: Planner) -> list:
    """Predictions for measured and unseen workers (p9) and links (d7), with and without a prefix-cache hit."""
    return [p.model.predict(w, prompt_tokens=n, reusable_tokens=r, cached_tokens=c, source=s)
            for w in (*WORKERS, "p9") for s in (*SOURCES, "d7")
            for n, r, c in ((300, 0, 0), (4000, 3900, 0), (7000, 6800, 1600), (900, 850, 880))]


def all_fits(state: dict) -> list[dict]:
    model = state["model"]
    return list(model["compute"].values()) + [fit for _, _, fit in model["links"]]


def test_a_replica_loaded_from_a_snapshot_stays_identical_to_the_one_that_ran_all_along():
    rng = random.Random(20240611)
    along = make_planner()
    for outcome in outcomes(rng, 300, slow_after=150):
        along.observe(outcome)
    along.observe(Outcome("p0", 3000, 0, 3000, 400.0, Choice.RECOMPUTE, policy="cost"))  # p0's links go stale
    slow_p2 = Outcome("p2", 3000, 0, 3000, 3000.0, Choice.RECOMPUTE, policy="cost")  # far off: p2 slowed down
    along.observe(slow_p2)
    along.observe(slow_p2)  # two far-off in a row: one more and p2's fit forgets older observations
    snapshot = along.learned_state()
    assert snapshot["model"]["stale"], "a snapshot with a link refit pending"
    assert snapshot["model"]["compute"]["p2"]["streak"] == 2
    assert any(fit["changes"] > 0 for fit in all_fits(snapshot)), "the speed change was detected"
    assert len(snapshot["model"]["links"]) == 6 and set(snapshot["model"]["compute"]) == set(WORKERS)
    assert snapshot["regret"]["turns"] and snapshot["cache_trust"] and snapshot["reported"] == 303
    assert along.learned_state() == snapshot  # taking it refits nothing

    replica = make_planner()
    replica.observe(Outcome("p2", 500, 0, 500, 1.0, Choice.RECOMPUTE, policy="cost"))  # whatever it had is replaced
    replica.load_learned_state(roundtrip(snapshot))
    assert replica.learned_state() == snapshot
    assert all(policy.model is replica.model for policy in replica.policies.values() if hasattr(policy, "model"))
    assert replica.policies["cost"].model.pulls_on_link("p0", "d1") == along.model.pulls_on_link("p0", "d1") > 0
    assert predictions(replica) == predictions(along)

    changes = along.model.compute_fits()["p2"].changes
    assert replica.observe(slow_p2) == along.observe(slow_p2)
    assert replica.model.compute_fits()["p2"].changes == along.model.compute_fits()["p2"].changes == changes + 1
    for outcome in outcomes(random.Random(7), 200):
        assert replica.observe(outcome) == along.observe(outcome)
    assert replica.learned_state() == along.learned_state()
    assert predictions(replica) == predictions(along)
    assert replica.regret.regret("cost") == along.regret.regret("cost")


def test_the_cost_model_alone_round_trips_through_json():
    along = make_planner()
    for outcome in outcomes(random.Random(3), 120, slow_after=60):
        along.observe(outcome)
    state = along.model.state()
    model = PrefillCostModel.from_state(roundtrip(state), along.model.prior)
    assert model.state() == state
    assert model.link_fits().keys() == along.model.link_fits().keys()
    for worker in (*WORKERS, "p9"):
        assert model.observations(worker) == along.model.observations(worker)
        assert model.predict(worker, prompt_tokens=5000, reusable_tokens=4800, source="d0") == along.model.predict(
            worker, prompt_tokens=5000, reusable_tokens=4800, source="d0")


def trained() -> Planner:
    p = make_planner()
    for outcome in outcomes(random.Random(11), 60):
        p.observe(outcome)
    return p


def _set(path, value):
    def change(state):
        *parents, last = path
        target = state
        for key in parents:
            target = target[key]
        target[last] = value
    return change


def _drop(*path):
    def change(state):
        *parents, last = path
        target = state
        for key in parents:
            target = target[key]
        del target[last]
    return change


def _fit(change):
    """``change`` applied to p0's compute fit."""
    return lambda state: change(state["model"]["compute"]["p0"])


def _stuff_class(fit):
    size_class, kept = fit["classes"][0]
    fit["classes"][0] = [size_class, kept + [kept[0]] * 7]  # more than window=6 (nothing dropped silently)


BAD = {
    "no version": _drop("version"),
    "version 2": _set(("version",), 2),
    "version as text": _set(("version",), "1"),
    "version true": _set(("version",), True),
    "version 1.0": _set(("version",), 1.0),
    "no model": _drop("model"),
    "model a list": _set(("model",), []),
    "no links": _drop("model", "links"),
    "link of two fields": lambda s: s["model"]["links"].__setitem__(0, s["model"]["links"][0][:2]),
    "link twice": lambda s: s["model"]["links"].append(s["model"]["links"][0]),
    "stale unknown link": _set(("model", "stale"), [["p0", "nowhere"]]),
    "most measured unknown": _set(("model", "most_measured"), "p42"),
    "most link unknown": _set(("model", "most_link"), ["p0", "nowhere"]),
    "most link of unknown": _set(("model", "most_link_of"), {"p0": "nowhere"}),
    "theta too short": _fit(_set(("theta",), [1.0, 2.0])),
    "theta of text": _fit(_set(("theta",), ["a", 1.0, 2.0])),
    "observations negative": _fit(_set(("observations",), -1)),
    "observations true": _fit(_set(("observations",), True)),
    "streak missing": _fit(_drop("streak")),
    "class over the window": _fit(_stuff_class),
    "class twice": _fit(lambda f: f["classes"].append(f["classes"][0])),
    "index past observations": _fit(lambda f: f["recent"][0].__setitem__(1, f["observations"])),
    "turn of three fields": _fit(lambda f: f["recent"][0].__setitem__(2, [1, 2, 3])),
    "x too long": _fit(lambda f: f["recent"][0][3].__setitem__(0, [1.0, 2.0, 3.0, 4.0])),
    "recent too long": _fit(lambda f: f["recent"].extend(f["recent"] * 3)),
    "theta null": _fit(_set(("theta",), None)),
    "no regret": _drop("regret"),
    "negative regret count": _set(("regret", "turns", "cost"), -1),
    "trust above one": _set(("cache_trust", "p0"), 1.5),
    "trust of text": _set(("cache_trust", "p0"), "high"),
    "reported as text": _set(("reported",), "3"),
    "reported negative": _set(("reported",), -3),
}


@pytest.mark.parametrize("name", list(BAD))
def test_an_unknown_version_or_malformed_state_is_refused_and_changes_nothing(name):
    good = roundtrip(trained().learned_state())
    assert good["model"]["compute"]["p0"]["recent"] and good["model"]["links"]
    bad = copy.deepcopy(good)
    BAD[name](bad)
    p = trained()
    p.observe(Outcome("p1", 2000, 0, 2000, 250.0, Choice.RECOMPUTE, policy="cost"))
    before = p.learned_state()
    with pytest.raises(ValueError):
        p.load_learned_state(bad)
    assert p.learned_state() == before
    p.load_learned_state(good)  # the unchanged one loads
    assert p.learned_state() == good


@pytest.mark.parametrize("state", [None, [], "{}", 1])
def test_a_state_that_is_not_a_mapping_is_refused(state):
    with pytest.raises(ValueError):
        make_planner().load_learned_state(state)
    with pytest.raises(ValueError):
        PrefillCostModel.from_state(state)


def test_an_empty_planner_s_snapshot_loads_and_works():
    empty = make_planner()
    snapshot = roundtrip(empty.learned_state())
    assert snapshot == {"version": 1, "model": {"compute": {}, "links": [], "stale": [], "most_measured": None,
                                                "most_link": None, "most_link_of": {}, "local": {},
                                                "most_local": None, "groups": {}, "most_measured_of": {},
                                                "most_link_in": {}, "most_local_of": {}},
                        "regret": {"turns": {}, "regrets": {}}, "cache_trust": {}, "reported": 0}
    p = trained()
    p.load_learned_state(snapshot)  # forgets what it learned
    assert p.learned_state() == snapshot
    assert predictions(p) == predictions(empty)  # the priors
    for outcome in outcomes(random.Random(5), 50, slow_after=25):
        assert p.observe(outcome) == empty.observe(outcome)
    assert p.learned_state() == empty.learned_state() and predictions(p) == predictions(empty)
