"""control_plane/kv_index/index.py: per-worker views of vLLM's prefix caches from their KV events: the events'
effect, batch order (gaps make a view stale, duplicates are ignored, restarts empty it), bounds, scores."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.control_plane.kv_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
)
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex, Match, Outcome

BS = 4
SCHEME = HashScheme(block_size=BS)


def stored(hashes, parent=None, tokens=None, medium="GPU", group_idx=0, block_size=BS) -> BlockStored:
    """Blocks with opaque ids (no tokens: the first-block hash check has nothing to compare)."""
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens or ()),
                       block_size=block_size, medium=medium, group_idx=group_idx)


def batch(*events, ts=1.0) -> EventBatch:
    return EventBatch(ts=ts, events=tuple(events))


class Feed:
    """One worker's publisher: numbers its batches 0, 1, 2... with growing timestamps."""

    def __init__(self, index: KvIndex, worker: str, seq: int = 0, ts: float = 100.0):
        self.index, self.worker, self.seq, self.ts = index, worker, seq, ts
        self.sent: list[tuple[int, EventBatch]] = []

    def make(self, *events) -> tuple[int, EventBatch]:
        self.ts += 1
        item = (self.seq, batch(*events, ts=self.ts))
        self.seq += 1
        self.sent.append(item)
        return item

    def send(self, *events) -> Outcome:
        return self.index.apply(self.worker, *self.make(*events))


def test_the_cached_prefix_is_the_longest_run_of_leading_blocks_held():
    index = KvIndex(SCHEME)
    p = Feed(index, "p1")
    assert p.send(stored([1, 2, 3])) == Outcome.APPLIED
    assert index.cached_prefix_tokens("p1", [1, 2, 3, 4]) == 3 * BS
    assert index.cached_prefix_tokens("p1", [1, 2]) == 2 * BS
    assert index.cached_prefix_tokens("p1", [9, 2, 3]) == 0
    p.send(BlockRemoved(block_hashes=(2,)))
    assert index.cached_prefix_tokens("p1", [1, 2, 3]) == BS  # 3 is still held, but the chain breaks at 2
    p.send(stored([2], parent=1))
    assert index.cached_prefix_tokens("p1", [1, 2, 3]) == 3 * BS
    p.send(AllBlocksCleared())
    assert index.cached_prefix_tokens("p1", [1, 2, 3]) == 0 and index.total_blocks == 0
    assert index.cached_prefix_tokens("unknown", [1]) == 0


def test_removing_unknown_blocks_and_storing_twice_keep_the_counts():
    index = KvIndex(SCHEME)
    p = Feed(index, "p1")
    p.send(stored([1, 2]), stored([2, 3]), BlockRemoved(block_hashes=(7, 7)))
    assert index.blocks("p1") == 3 == index.total_blocks
    p.send(BlockRemoved(block_hashes=(1, 1)))
    assert index.blocks("p1") == 2 == index.total_blocks and not index.holds("p1", 1)


def test_best_ranks_by_cached_tokens_and_keeps_the_given_order_for_ties():
    index = KvIndex(SCHEME)
    for worker, hashes in (("a", [1]), ("b", [1, 2, 3]), ("c", [1, 2]), ("d", [1, 2, 3])):
        Feed(index, worker).send(stored(hashes))
    assert index.best(["a", "d", "c", "b", "new"], [1, 2, 3]) == [
        Match("d", 12), Match("b", 12), Match("c", 8), Match("a", 4), Match("new", 0)]
    assert index.best([], [1]) == []


def test_only_the_engines_own_cache_counts():
    index = KvIndex(SCHEME)
    p = Feed(index, "p1")
    p.send(stored([1], medium="CPU"), stored([2], group_idx=1), stored([3], medium=None, group_idx=None))
    assert [index.holds("p1", h) for h in (1, 2, 3)] == [False, False, True]
    p.send(BlockRemoved(block_hashes=(3,), medium="CPU"))
    assert index.holds("p1", 3)


def test_the_first_batch_is_taken_whatever_its_number_then_the_order_is_checked():
    index = KvIndex(SCHEME)
    p = Feed(index, "p1", seq=57)  # the index started after the worker
    assert p.send(stored([1])) == Outcome.APPLIED and index.expected_seq("p1") == 58
    assert index.stale_reason("p1") == ""
    assert index.expected_seq("unknown") is None and index.stale_reason("unknown") == ""


def test_a_gap_makes_the_view_stale_until_the_missing_batches_are_applied_in_order():
    index = KvIndex(SCHEME)
    p = Feed(index, "p1")
    p.send(stored([1, 2]))
    missed = [p.make(BlockRemoved(block_hashes=(2,))), p.make(stored([5]))]
    assert p.send(stored([3])) == Outcome.GAP  # seq 3 while 1 is expected: not applied
    assert "missed batches from seq 1" in index.stale_reason("p1") and index.expected_seq("p1") == 1
    assert index.cached_prefix_tokens("p1", [1, 2]) == 0  # stale: no score
    assert index.cached_prefix_tokens("p1", [1, 2], allow_stale=True) == 2 * BS  # the view as of seq 0
    assert index.best(["p1"], [1, 2]) == [Match("p1", 0)]
    live = p.make(stored([6]))
    assert index.apply("p1", *live) == Outcome.GAP
    for seq, b in missed + [p.sent[3]]:  # replay from the expected number
        assert index.apply("p1", seq, b) == Outcome.APPLIED
    assert "seen up to 4" in index.stale_reason("p1")  # 4 was seen live but not yet applied
    assert index.apply("p1", *live) == Outcome.APPLIED
    assert index.stale_reason("p1") == ""
    assert [index.holds("p1", h) for h in (1, 2, 3, 5, 6)] == [True, False, True, True, True]


def test_duplicates_are_ignored_and_a_restart_empties_the_view():
    index = KvIndex(SCHEME)
    p = Feed(index, "p1")
    p.send(stored([1]))
    p.send(stored([2]))
    assert index.apply("p1", *p.sent[0]) == Outcome.DUPLICATE  # replay overlapping the live stream
    assert index.blocks("p1") == 2 and index.expected_seq("p1") == 2
    restarted = Feed(index, "p1", seq=0, ts=p.ts + 50)  # a new engine process: numbers from 0, later clock
    assert restarted.send(stored([9])) == Outcome.RESTARTED
    assert index.blocks("p1") == 1 == index.total_blocks and index.holds("p1", 9)
    assert index.expected_seq("p1") == 1 and index.stale_reason("p1") == ""


def test_resync_starts_afresh_and_forget_drops_the_worker():
    index = KvIndex(SCHEME)
    p, q = Feed(index, "p1"), Feed(index, "p2")
    p.send(stored([1, 2]))
    q.send(stored([1]))
    p.seq += 5
    assert p.send(stored([3])) == Outcome.GAP and index.stale_reason("p1")
    index.resync("p1")  # replay could not fill the gap
    assert index.blocks("p1") == 0 and index.stale_reason("p1") == "" and index.expected_seq("p1") is None
    assert p.send(stored([4])) == Outcome.APPLIED and index.holds("p1", 4)
    index.forget("p1")
    assert index.workers == ["p2"] and index.total_blocks == 1 and index.blocks("p1") == 0
    index.forget("p1")  # twice: nothing happens
    index.resync("new")
    assert index.expected_seq("new") is None


def test_blocks_hashed_otherwise_distrust_the_view_until_resync():
    index = KvIndex(SCHEME)
    cases = {
        "a": (stored([1], block_size=8), "8 tokens"),
        "b": (UnknownEvent("BlockMoved"), "unknown KV event type 'BlockMoved'"),
        "c": (stored([b"\x00" * 32]), "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"),
    }
    for worker, (event, reason) in cases.items():
        Feed(index, worker).send(stored([7]), event)
        assert reason in index.stale_reason(worker)
        assert index.cached_prefix_tokens(worker, [7]) == 0
        index.resync(worker)
        assert index.stale_reason(worker) == ""


def test_a_first_block_that_hashes_otherwise_here_is_caught():
    toks = list(range(10, 22))  # three blocks
    right = SCHEME.hashes(toks, salt="kvs1-t")
    index = KvIndex(SCHEME)
    p = Feed(index, "p1")
    p.send(BlockStored(block_hashes=tuple(right), parent_block_hash=None, token_ids=tuple(toks), block_size=BS,
                       medium="GPU", extra_keys=(("kvs1-t",), None, None)))
    assert index.stale_reason("p1") == "" and index.cached_prefix_tokens("p1", right) == 12
    other = HashScheme(block_size=BS, seed="1").hashes(toks, salt="kvs1-t")  # a worker with another seed
    q = Feed(index, "p2")
    q.send(BlockStored(block_hashes=tuple(other), parent_block_hash=None, token_ids=tuple(toks), block_size=BS,
                       medium="GPU", extra_keys=(("kvs1-t",), None, None)))
    assert "seed" in index.stale_reason("p2")
    # continuations (a parent), LoRA and multimodal keys are not checked: nothing to compare with
    r = Feed(index, "p3")
    r.send(BlockStored(block_hashes=(1,), parent_block_hash=right[0], token_ids=tuple(toks[4:8]), block_size=BS),
           BlockStored(block_hashes=(2,), parent_block_hash=None, token_ids=tuple(toks[:4]), block_size=BS,
                       lora_name="l"),
           BlockStored(block_hashes=(3,), parent_block_hash=None, token_ids=tuple(toks[:4]), block_size=BS,
                       extra_keys=((("mm", 0), "s"),)))
    assert index.stale_reason("p3") == ""


def test_bounds_drop_the_least_recently_stored_and_a_chain_head_goes_last():
    index = KvIndex(SCHEME, max_blocks_per_worker=3, max_blocks_total=5)
    p, q = Feed(index, "p"), Feed(index, "q")
    p.send(stored([1, 2, 3, 4, 5]))  # taken last to first: 5, 4, 3, 2, 1 -> keeps 3, 2, 1
    assert index.cached_prefix_tokens("p", [1, 2, 3, 4, 5]) == 3 * BS
    p.send(stored([1]))  # reused: recent again
    p.send(stored([6]))  # drops the least recent: 3
    assert [index.holds("p", h) for h in (1, 2, 3, 6)] == [True, True, False, True]
    q.send(stored([10, 11, 12]))  # total 6 > 5: p holds most, its least recent (2) goes
    assert index.total_blocks == 5 and index.blocks("p") == 2 and index.blocks("q") == 3
    assert not index.holds("p", 2)
    with pytest.raises(ValueError):
        KvIndex(SCHEME, max_blocks_per_worker=0)


ops = st.lists(st.tuples(st.sampled_from(["p", "q", "r"]),
                         st.sampled_from(["store", "remove", "clear", "forget"]),
                         st.lists(st.integers(0, 30), max_size=6)), max_size=60)


@settings(max_examples=200)
@given(ops, st.integers(1, 12), st.integers(1, 25))
def test_views_stay_within_bounds_and_never_hold_what_the_worker_does_not(operations, per_worker, total):
    """Whatever the events, the counts add up, both bounds hold, and every held block was stored and not removed
    since (the index may forget blocks, never invent them); with room enough it holds exactly those."""
    bounded = KvIndex(SCHEME, max_blocks_per_worker=per_worker, max_blocks_total=total)
    roomy = KvIndex(SCHEME)
    truth: dict[str, set[int]] = {}
    feeds = {idx: {} for idx in (id(bounded), id(roomy))}
    for worker, op, hashes in operations:
        if op == "forget":
            for index in (bounded, roomy):
                index.forget(worker)
                feeds[id(index)].pop(worker, None)
            truth.pop(worker, None)
            continue
        event = {"store": lambda: stored(hashes), "remove": lambda: BlockRemoved(block_hashes=tuple(hashes)),
                 "clear": AllBlocksCleared}[op]()
        held = truth.setdefault(worker, set())
        if op == "store":
            held.update(hashes)
        elif op == "remove":
            held.difference_update(hashes)
        else:
            held.clear()
        for index in (bounded, roomy):
            feed = feeds[id(index)].setdefault(worker, Feed(index, worker))
            assert feed.send(event) == Outcome.APPLIED
        assert bounded.total_blocks == sum(bounded.blocks(w) for w in bounded.workers) <= total
        assert all(bounded.blocks(w) <= per_worker for w in bounded.workers)
        for w, blocks in truth.items():
            assert all(bounded.holds(w, h) <= (h in blocks) for h in range(31))
            assert all(roomy.holds(w, h) == (h in blocks) for h in range(31))


@given(st.lists(st.integers(0, 6), max_size=12), st.lists(st.integers(0, 6), max_size=12))
def test_the_score_is_the_length_of_the_held_leading_run(held, prompt):
    index = KvIndex(SCHEME)
    Feed(index, "p").send(stored(held))
    run = 0
    while run < len(prompt) and prompt[run] in held:
        run += 1
    assert index.cached_prefix_tokens("p", prompt) == run * BS
