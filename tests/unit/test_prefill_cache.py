"""Estimating a prefill worker's own prefix-cache hit for a session's next turn, and learning how far to trust it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kvshuttle.control_plane.cost_model import PrefillCostModel
from kvshuttle.control_plane.decision import Choice
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import Outcome, make_policy
from kvshuttle.control_plane.prefill_cache import PrefillCacheHints
from kvshuttle.control_plane.selection import make_selector

from tests.support.planning import HISTORY, handle_view


@dataclass(frozen=True)
class W:
    worker_id: str
    block_size: int = 16


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
