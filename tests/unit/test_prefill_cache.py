"""Estimating a prefill worker's own prefix-cache hit for a session's next turn, and learning how far to trust it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.control_plane.decision import Choice
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.planner import Planner, _one_model
from kvshuttle.control_plane.policies import Outcome, make_policy
from kvshuttle.control_plane.prefill_cache import PrefillCacheHints
from kvshuttle.control_plane.selection import make_selector

from tests.support.planning import HISTORY, handle_view


@dataclass(frozen=True)
class W:
    worker_id: str
    block_size: int = 16


@dataclass(frozen=True)
class MW(W):
    model: str = ""


def test_the_worker_that_prefilled_the_last_turn_holds_its_whole_blocks():
    hints = PrefillCacheHints()
    hints.note("s", "p0", 90)
    kw = {"prompt_tokens": 200, "block_size": 16}
    assert hints.estimate("s", "p0", matched_tokens=99, **kw) == 80  # 90 noted → 5 whole blocks
    assert hints.estimate("s", "p0", matched_tokens=40, **kw) == 32  # the prompt diverges at 40
    assert hints.estimate("s", "p1", matched_tokens=99, **kw) == 0  # another worker holds nothing
    assert hints.estimate("other", "p0", matched_tokens=99, **kw) == 0 and hints.estimate(None, "p0", **kw,
                                                                                          matched_tokens=99) == 0


def test_trust_falls_on_a_worker_that_does_not_keep_what_was_noted():
    hints = PrefillCacheHints(learning_rate=0.5)
    hints.note("s", "p0", 160)
    for _ in range(4):  # prefix caching off: the worker hits nothing
        hints.observe("p0", estimated=160, actual=0)
    assert hints.trust["p0"] == pytest.approx(1 / 16)
    assert hints.estimate("s", "p0", matched_tokens=200, prompt_tokens=300, block_size=16) == 10
    hints.observe("p1", estimated=0, actual=50)  # nothing estimated: nothing learned
    assert "p1" not in hints.trust


def test_sessions_are_forgotten_oldest_first():
    hints = PrefillCacheHints(max_sessions=2)
    for s in ("a", "b", "c"):
        hints.note(s, "p0", 64)
    assert hints.estimate("a", "p0", matched_tokens=64, prompt_tokens=100, block_size=16) == 0
    assert hints.estimate("c", "p0", matched_tokens=64, prompt_tokens=100, block_size=16) == 64


def test_the_planner_prefers_the_warm_worker_and_recomputes_what_it_holds():
    model = PrefillCostModel()
    planner = Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"))
    for _ in range(3):  # measured pulls on the link, so the warm-up does not force a pull
        planner.observe(Outcome("p1", 103, 99, 4, 15.0, Choice.PULL, source_worker="d", policy="cost"))
    prompt = HISTORY + [1, 2, 3]
    planner.cache_hints.note(("t", "s"), "p1", 97)  # p1 prefilled the last turn's 97-token prompt
    got = planner.plan(prompt, handle_view(), prefill=[W("p0"), W("p1")], decode=[W("d0")], loads={},
                       source_worker="d", session=("t", "s"))
    assert got.prefill.worker_id == "p1" and got.cached_tokens == 96
    # p1 holds 96 of the 99 reusable tokens: recomputing 7 tokens beats a transfer's fixed cost
    assert got.plan.choice is Choice.RECOMPUTE and got.prediction.recompute_ms < got.prediction.pull_ms
    planner.observe(Outcome("p1", 103, 0, 7, 12.0, Choice.RECOMPUTE, policy="cost", cached_estimate=96))
    assert planner.cache_hints.trust["p1"] == pytest.approx(1.0)


def test_with_candidates_the_planner_scores_a_sample_that_keeps_the_warm_worker():
    import random

    model = PrefillCostModel()
    planner = Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"),
                      candidates=3, rng=random.Random(7))
    prefill = [W(f"p{i}") for i in range(200)]
    decode = [W(f"d{i}") for i in range(200)]
    scored: list[str] = []
    real_predict = model.predict

    def predict(worker, **kw):
        scored.append(worker)
        return real_predict(worker, **kw)

    model.predict = predict
    planner.cache_hints.note(("t", "s"), "p123", 97)
    for _ in range(20):
        scored.clear()
        got = planner.plan(HISTORY + [1, 2, 3], handle_view(), prefill=prefill, decode=decode, loads={},
                           source_worker="d", session=("t", "s"), exclude={"p5"})
        assert len(set(scored)) <= 3 and "p123" in scored and "p5" not in scored
        assert got.prefill.worker_id == "p123"  # the warm one wins among the sampled
    with pytest.raises(ValueError, match="candidates"):
        Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"), candidates=-1)
    small = Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"), candidates=8)
    assert small._sample(prefill[:5], ()) == prefill[:5]


# -- prefix hits from an index of the workers' KV events -------------------------------------------------------------


def _cost_planner(**kw) -> Planner:
    model = PrefillCostModel()
    planner = Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"), **kw)
    for _ in range(3):  # measured pulls on the link, so the warm-up does not force a pull
        planner.observe(Outcome("p1", 103, 99, 4, 15.0, Choice.PULL, source_worker="d", policy="cost"))
    return planner


def test_a_first_turn_goes_to_the_worker_whose_index_holds_its_prefix():
    planner = _cost_planner()
    prompt = list(range(500))
    got = planner.plan(prompt, None, prefill=[W("p0"), W("p1"), W("p2")], decode=[W("d0")], loads={},
                       prefix_hits={"p0": 0, "p1": 0, "p2": 330}, session=("t", "new"))
    assert got.prefill.worker_id == "p2" and got.cached_tokens == 320  # whole blocks of 16
    assert got.plan.choice is Choice.RECOMPUTE
    # the hit is capped below the whole prompt: P always computes the last token
    got = planner.plan(prompt, None, prefill=[W("p0")], decode=[W("d0")], loads={}, prefix_hits={"p0": 500})
    assert got.cached_tokens == 496
    assert planner.plan(prompt, None, prefill=[W("p0", block_size=0)], decode=[W("d0")], loads={},
                        prefix_hits={"p0": 800}).cached_tokens == 499


def test_a_long_queue_outweighs_a_cached_prefix():
    from kvshuttle.control_plane.load import WorkerLoad

    planner = _cost_planner()
    prompt = list(range(500))
    loads = {"p2": WorkerLoad(running=1, waiting=40)}
    got = planner.plan(prompt, None, prefill=[W("p0"), W("p2")], decode=[W("d0")], loads=loads,
                       prefix_hits={"p0": 0, "p2": 480})
    assert got.prefill.worker_id == "p0" and got.cached_tokens == 0


def test_indexed_hits_replace_the_session_estimate_only_for_the_workers_they_name():
    planner = _cost_planner()
    planner.cache_hints.note(("t", "s"), "p1", 97)  # the last turn ran on p1...
    prompt = HISTORY + [1, 2, 3]
    # ... but the index says p1 evicted it, and p0 holds the first 64 tokens
    got = planner.plan(prompt, handle_view(), prefill=[W("p0"), W("p1")], decode=[W("d0")], loads={},
                       source_worker="d", session=("t", "s"), prefix_hits={"p1": 0, "p0": 64})
    assert got.prefill.worker_id == "p0" and got.cached_tokens == 64
    # a combined plan: P holds the shared prefix, the pull brings the rest of the history (35 of 99 tokens)
    assert got.plan.choice is Choice.PULL and got.plan.reusable_tokens == 99
    model = planner.model
    combined = model.predict("p0", prompt_tokens=103, reusable_tokens=99, cached_tokens=64, source="d")
    assert combined.pull_ms == pytest.approx(model.compute_ms("p0", 4, 103) + model.transfer_ms("p0", "d", 35))
    # a worker the mapping does not name falls back to the session's estimate
    planner.cache_hints.note(("t", "s"), "p1", 97)
    got = planner.plan(prompt, handle_view(), prefill=[W("p1")], decode=[W("d0")], loads={}, source_worker="d",
                       session=("t", "s"), prefix_hits={"p0": 64})
    assert got.cached_tokens == 96


def test_with_candidates_the_sample_keeps_the_worker_with_the_most_hits():
    import random

    planner = _cost_planner(candidates=3, rng=random.Random(3))
    prefill = [W(f"p{i}") for i in range(200)]
    decode = [W(f"d{i}") for i in range(200)]
    hits = {w.worker_id: 0 for w in prefill} | {"p77": 480, "p78": 160}
    planner.cache_hints.note(("t", "s"), "p123", 97)
    for _ in range(20):
        got = planner.plan(list(range(500)), None, prefill=prefill, decode=decode, loads={}, session=("t", "s"),
                           prefix_hits=hits, exclude={"p5"})
        assert got.prefill.worker_id == "p77" and got.cached_tokens == 480
    sample = planner._sample(prefill, (), "p123", "p77")
    assert len(sample) == 3 and {"p123", "p77"} <= {w.worker_id for w in sample}
    assert planner._sample(prefill, {"p77"}, "p77") and all(w.worker_id != "p77"
                                                            for w in planner._sample(prefill, {"p77"}, "p77"))


def test_workers_are_compared_by_their_work_not_by_their_own_noisy_fits():
    """p0 holds the prompt's first 640 tokens; p1 holds nothing but its own measurements happened to come out twice
    as fast. The choice prices both with the fleet's fit (the most-measured worker's), so the cached prefix wins;
    the chosen worker's own fit then gives the plan's prediction."""
    model = PrefillCostModel()
    planner = Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"))
    for _ in range(6):  # p0 measured more (the fleet's fit), and slower than p1's few measurements
        planner.observe(Outcome("p0", 1300, 0, 1300, 600.0, Choice.RECOMPUTE, policy="cost"))
    for _ in range(3):
        planner.observe(Outcome("p1", 1300, 0, 1300, 250.0, Choice.RECOMPUTE, policy="cost"))
    assert model.reference_worker == "p0"
    prompt = list(range(1300))
    own = [model.predict(w, prompt_tokens=1300, reusable_tokens=0, cached_tokens=c).recompute_ms
           for w, c in (("p0", 640), ("p1", 0))]
    assert own[0] > own[1], "by their own fits, the cold p1 looks faster"
    got = planner.plan(prompt, None, prefill=[W("p0"), W("p1")], decode=[W("d0")], loads={},
                       prefix_hits={"p0": 640, "p1": 0})
    assert got.prefill.worker_id == "p0" and got.cached_tokens == 640
    assert got.prediction.recompute_ms == pytest.approx(own[0])
    assert "640 of 1300 prompt tokens cached there" in got.worker_choice


def test_a_turn_naming_no_model_prices_its_unmeasured_workers_like_their_models_measured_ones():
    """The gateway reports every turn with its model; a plan that names none (a client of the scheduler's own API)
    prices its prefill workers by the model they all serve. Before, the "" group had no measured worker, so the
    measured p0 (80 ms for a 4-token prompt on a slow machine, one turn pending) was compared with the unmeasured
    p1's priors, and 8 requests running on p1 did not outweigh the difference (the CI failure of
    tests/e2e/test_load_aware.py::test_busy_prefill_worker_is_avoided)."""
    model = PrefillCostModel()
    planner = Planner({"cost": make_policy("cost", {}, model=model)}, "cost", model, make_selector("load"))
    for i in range(6):
        planner.observe(Outcome("p0", 4, 0, 4, 80.0 + i % 2, Choice.RECOMPUTE, policy="cost", model="m"))
    assert model.reference_worker_of("m") == "p0" and model.reference_worker is None
    prefill = [MW("p0", model="m"), MW("p1", model="m")]
    loads = {"p0": WorkerLoad(pending=1), "p1": WorkerLoad(running=8)}
    for named in ("", "m"):
        got = planner.plan([11, 12, 13, 14], None, prefill=prefill, decode=[MW("d0", model="m")], loads=loads,
                           model=named)
        assert got.prefill.worker_id == "p0", (named, got.worker_choice)
    assert _one_model(prefill) == "m"
    assert _one_model([MW("p0", model="m"), MW("p1", model="other")]) == "" and _one_model([W("p0")]) == ""
