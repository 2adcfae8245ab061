"""What a decode worker frees, and in which order (kvshuttle.control_plane.kv_eviction: pure)."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane import kv_eviction as ev

NOW = 10_000.0
BS = 128


def held(sid: str, *, tokens: int = 1000, idle: float = 10.0, turns: int = 1, span: float = 0.0,
         tenant: str = "t", ttl_left: float = 400.0, bpt: int = 4096) -> ev.HeldKv:
    """A handle of ``tokens`` tokens whose last turn ended ``idle`` s ago, after ``turns`` turns over ``span`` s."""
    last = NOW - idle
    return ev.HeldKv(tenant, sid, revision=7, tokens=tokens, block_size=BS, last_used=last, created=last - span,
                     turns=turns, expires_at=NOW + ttl_left, bytes_per_token=bpt)


def linear_saving(tokens: int) -> float:
    return tokens * 0.1  # a pull saves 0.1 ms per history token


def test_sizes_are_whole_blocks():
    h = held("a", tokens=129)
    assert (h.blocks, h.kv_tokens, h.bytes) == (2, 256, 256 * 4096)
    assert held("b", tokens=128).blocks == 1


def test_limits_are_checked():
    for bad in (dict(high_water=0.5, low_water=0.6), dict(low_water=0), dict(high_water=1.2),
                dict(held_budget=-0.1), dict(idle_limit_s=-1)):
        with pytest.raises(ValueError):
            ev.KvLimits(**bad)


def test_idle_sessions_past_the_limit_are_freed_unless_about_to_expire():
    limits = ev.KvLimits(idle_limit_s=240)
    out = ev.idle_evictions([held("fresh", idle=100), held("old", idle=300), held("expiring", idle=300, ttl_left=5)],
                            NOW, limits)
    assert [(e.held.session_id, e.reason) for e in out] == [("old", ev.IDLE)]
    assert ev.idle_evictions([held("old", idle=10_000)], NOW, ev.KvLimits(idle_limit_s=0)) == []


def test_no_pressure_below_the_high_water_mark():
    hs = [held(str(i)) for i in range(5)]
    out = ev.pressure_evictions(hs, used_tokens=790, capacity_tokens=1000, now=NOW,
                                limits=ev.KvLimits(held_budget=0), ranking=ev.LruRanking())
    assert out == []


def test_pressure_frees_down_to_the_low_water_mark_in_ranking_order():
    # 10 handles of 1 block each on a 1,280-token worker, all of it held: free until used <= 60%.
    hs = [held(f"s{i}", tokens=BS, idle=100 - i) for i in range(10)]
    out = ev.pressure_evictions(hs, used_tokens=10 * BS, capacity_tokens=10 * BS, now=NOW,
                                limits=ev.KvLimits(held_budget=0), ranking=ev.LruRanking())
    assert [e.held.session_id for e in out] == ["s0", "s1", "s2", "s3"]  # the least recently used, 4 blocks
    assert {e.reason for e in out} == {ev.PRESSURE}


def test_the_held_budget_triggers_on_its_own():
    hs = [held(f"s{i}", tokens=BS, idle=100 - i) for i in range(8)]  # 8 blocks held of 10
    limits = ev.KvLimits(high_water=0.9, low_water=0.7, held_budget=0.6)  # used 80% < high water
    out = ev.pressure_evictions(hs, used_tokens=8 * BS, capacity_tokens=10 * BS, now=NOW, limits=limits,
                                ranking=ev.LruRanking())
    assert len(out) == 4  # down to (0.6 - 0.2) x 10 = 4 blocks


def test_room_is_made_for_a_turn_but_never_from_its_own_session():
    hs = [held("mine", tokens=4 * BS, idle=500), held("other", tokens=2 * BS, idle=50), held("third", idle=10)]
    out = ev.room_evictions(hs, need_tokens=3 * BS, free_tokens=BS, now=NOW, limits=ev.KvLimits(),
                            ranking=ev.LruRanking(), keep=("t", "mine"))
    assert [(e.held.session_id, e.reason) for e in out] == [("other", ev.ROOM)]
    assert ev.room_evictions(hs, need_tokens=BS, free_tokens=BS, now=NOW, limits=ev.KvLimits(),
                             ranking=ev.LruRanking()) == []


def test_a_session_idle_far_past_its_usual_gap_is_unlikely_to_return():
    model = ev.ReturnModel(prior_gap_s=60)
    regular = held("regular", idle=20, turns=5, span=80)  # a turn every 20 s, idle 20 s
    overdue = held("overdue", idle=200, turns=5, span=80)  # same habit, idle 200 s
    assert model.probability(regular, NOW) > 3 * model.probability(overdue, NOW)


def test_a_session_with_long_gaps_keeps_its_chance_over_the_same_idle_time():
    model = ev.ReturnModel(prior_gap_s=60)
    slow = held("slow", idle=150, turns=4, span=3 * 200)  # comes back every ~200 s
    fast = held("fast", idle=150, turns=4, span=3 * 15)  # came back every ~15 s, silent for 150 s now
    assert model.probability(slow, NOW) > model.probability(fast, NOW)


def test_no_chance_past_the_handle_expiry():
    model = ev.ReturnModel()
    assert model.probability(held("x", idle=10, ttl_left=-1), NOW) == pytest.approx(0.0, abs=1e-9)


def test_tenants_teach_the_model_their_gaps_and_how_often_sessions_continue():
    model = ev.ReturnModel(prior_gap_s=60, prior_continue=0.5, prior_weight=1)
    # tenant "agents": sessions of 10 turns 10 s apart; tenant "oneshot": single-turn sessions
    model.learn([held(f"a{i}", tenant="agents", turns=10, span=90) for i in range(20)]
                + [held(f"o{i}", tenant="oneshot", turns=1) for i in range(20)])
    agents, oneshot = model.tenants["agents"], model.tenants["oneshot"]
    assert agents.gap_s == pytest.approx(10, rel=0.05)
    assert agents.continue_prob > 0.85 and oneshot.continue_prob < 0.1
    # A first-turn session of each tenant, idle 5 s: the agent's is far more likely to come back.
    p_agent = model.probability(held("new-a", tenant="agents", idle=5), NOW)
    p_oneshot = model.probability(held("new-o", tenant="oneshot", idle=5), NOW)
    assert p_agent > 5 * p_oneshot


def test_value_ranking_frees_the_unlikely_and_the_cheap_to_recompute_first():
    ranking = ev.ValueRanking(linear_saving, ev.ReturnModel(prior_gap_s=30))
    likely = held("likely", idle=5, turns=6, span=100)
    abandoned = held("abandoned", idle=400, turns=6, span=100)
    order = [h.session_id for h in ranking.order([likely, abandoned], NOW)]
    assert order == ["abandoned", "likely"]
    # Value per token held: a saving that does not grow with the history makes small handles worth more per byte.
    flat = ev.ValueRanking(lambda tokens: 50.0, ev.ReturnModel(prior_gap_s=30))
    small, big = held("small", tokens=BS, idle=5), held("big", tokens=40 * BS, idle=5)
    assert [h.session_id for h in flat.order([small, big], NOW)] == ["big", "small"]


def test_lru_differs_from_value_when_recency_misleads():
    # The most recently used session never comes back (its tenant's sessions are one-shot); LRU keeps it.
    model = ev.ReturnModel(prior_gap_s=60, prior_weight=1)
    records = ([held(f"o{i}", tenant="oneshot", turns=1, idle=1) for i in range(10)]
               + [held(f"a{i}", tenant="agents", turns=8, span=7 * 60, idle=90) for i in range(10)])
    model.learn(records)
    value = ev.ValueRanking(linear_saving, model)
    one_shot, agent = records[0], records[10]
    assert value.order([one_shot, agent], NOW)[0] is one_shot
    assert ev.LruRanking().order([one_shot, agent], NOW)[0] is agent


def test_freed_tokens_count_until_the_engine_shows_them_or_they_settle():
    ledger = ev.FreedLedger(settle_s=15)
    ledger.note(100.0, 512, used_before=4000)
    ledger.note(105.0, 256, used_before=3900)
    assert ledger.unseen(sampled_at=99.0, used=4000, now=106) == 768  # the sample predates both frees
    assert ledger.unseen(sampled_at=101.0, used=4000, now=106) == 768  # newer, but the usage has not moved
    assert ledger.unseen(sampled_at=101.0, used=3700, now=106) == 256  # the first one shows; the second not yet
    assert ledger.unseen(sampled_at=106.0, used=3400, now=107) == 0  # both show
    ledger.note(200.0, 1024, used_before=4000)
    assert ledger.unseen(sampled_at=201.0, used=4000, now=214) == 1024
    assert ledger.unseen(sampled_at=214.0, used=4000, now=216) == 0  # settled: the engine's figure is believed
    assert ledger.frees == []
