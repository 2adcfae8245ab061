"""Worker selection: load-aware picks (prefill by predicted time, decode by free KV), round robin, GetLoads parsing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kvshuttle.control_plane.load import WorkerLoad, parse_get_loads
from kvshuttle.control_plane.selection import LoadAwareSelector, RoundRobinSelector, make_selector


@dataclass(frozen=True)
class W:
    worker_id: str


WORKERS = [W("a"), W("b"), W("c")]


def test_get_loads_are_summed_over_data_parallel_ranks():
    load = parse_get_loads({"loads": [
        {"num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 100, "max_total_num_tokens": 1000,
         "num_waiting_uncached_tokens": 50, "cache_hit_rate": 0.5},
        {"num_running_reqs": 1, "num_used_tokens": 300, "max_total_num_tokens": 1000, "cache_hit_rate": 0.1},
    ]})
    assert (load.running, load.waiting, load.used_tokens, load.capacity_tokens) == (3, 1, 400, 2000)
    assert load.waiting_uncached_tokens == 50 and load.cache_hit_rate == pytest.approx(0.3)
    assert load.free_tokens == 1600 and load.usage == pytest.approx(0.2)
    assert parse_get_loads({}) == WorkerLoad() and WorkerLoad().free_tokens is None


def test_pending_turns_count_as_load_until_the_next_sample():
    load = WorkerLoad(running=1, used_tokens=500, capacity_tokens=1000, pending=2, pending_tokens=300)
    assert load.queued == 3 and load.free_tokens == 200 and load.usage == pytest.approx(0.8)


def test_prefill_goes_where_it_would_finish_first():
    pick = LoadAwareSelector()
    loads = {"a": WorkerLoad(running=3), "b": WorkerLoad(waiting=1), "c": WorkerLoad()}
    assert pick.pick_prefill(WORKERS, loads).worker.worker_id == "c"
    # c is idle but predicted 10x slower for this turn (e.g. a slow link to the session's KV): b wins
    times = {"a": 10.0, "b": 10.0, "c": 100.0}
    got = pick.pick_prefill(WORKERS, loads, prefill_ms=times.__getitem__)
    assert got.worker.worker_id == "b" and got.score == 20.0 and "1 request(s) ahead" in got.why
    assert pick.pick_prefill(WORKERS, loads, exclude={"a", "b", "c"}) is None


def test_decode_goes_where_the_kv_cache_has_room():
    pick = LoadAwareSelector()
    loads = {"a": WorkerLoad(used_tokens=900, capacity_tokens=1000), "b": WorkerLoad(used_tokens=100,
                                                                                     capacity_tokens=1000),
             "c": WorkerLoad(used_tokens=500, capacity_tokens=1000)}
    got = pick.pick_decode(WORKERS, loads)
    assert got.worker.worker_id == "b" and "10% used" in got.why and "900 tokens free" in got.why


def test_ties_rotate_and_unreachable_workers_are_a_last_resort():
    pick = LoadAwareSelector()
    assert {pick.pick_decode(WORKERS, {}).worker.worker_id for _ in range(3)} == {"a", "b", "c"}
    down = {"a": WorkerLoad(reachable=False), "b": WorkerLoad(reachable=False, running=0), "c": WorkerLoad(running=5)}
    assert {pick.pick_prefill(WORKERS, down).worker.worker_id for _ in range(4)} == {"c"}
    only_down = {"a": WorkerLoad(reachable=False)}
    assert pick.pick_prefill([W("a")], only_down).worker.worker_id == "a"


def test_round_robin_ignores_load_and_selectors_are_made_by_name():
    rr = make_selector("round_robin")
    assert isinstance(rr, RoundRobinSelector) and isinstance(make_selector("load"), LoadAwareSelector)
    busy = {"a": WorkerLoad(running=100)}
    assert [rr.pick_prefill(WORKERS, busy).worker.worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="unknown worker selector"):
        make_selector("random")
