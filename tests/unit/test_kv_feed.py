"""control_plane/kv_index/feed.py and feed_codec.py: following the KV feed (entries numbered per agent epoch, plus
snapshots) into an index: joins mid-epoch, gaps, duplicates, new epochs and snapshots, against the exact view; and
the feed's wire form round trip, the relay's events (services/engine/kv_events.py) included."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.control_plane.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvshuttle.control_plane.kv_index.feed import FeedFollower
from kvshuttle.control_plane.kv_index.feed_codec import BadFeedEntry, from_feed, snapshot, to_feed
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex
from kvshuttle.services.engine.kv_events import relay_events
from kvshuttle.v1 import kv_feed_pb2
from smg_grpc_proto.generated import common_pb2

BS = 4
SCHEME = HashScheme(block_size=BS)
W = "prefill-0"


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(), block_size=BS)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes)


class Agent:
    """A worker's agent: its exact view, the entries it published and its snapshots."""

    def __init__(self, epoch: int = 1):
        self.epoch, self.seq = epoch, 0
        self.view = KvIndex(SCHEME)
        self.entries: list[tuple[int, EventBatch]] = []

    def publish(self, *events) -> tuple[int, EventBatch]:
        batch = EventBatch(ts=float(self.seq), events=tuple(events))
        self.view.apply(W, self.seq, batch)
        self.entries.append((self.seq, batch))
        self.seq += 1
        return self.entries[-1]

    def snapshot(self) -> tuple[int, EventBatch]:
        entry = snapshot(W, self.epoch, self.seq - 1, float(self.seq - 1), self.view.held(W), BS)
        return entry.seq, from_feed(entry)


def held(index: KvIndex) -> set[int]:
    return set(index.held(W))


def test_an_epoch_followed_from_its_start_is_exact():
    agent, index = Agent(), KvIndex(SCHEME)
    follower = FeedFollower(index)
    for events in ((AllBlocksCleared(), stored(1, 2, 3)), (removed(2),), (stored(4),)):
        seq, batch = agent.publish(*events)
        assert follower.on_entry(W, agent.epoch, seq, batch) is False
    assert held(index) == {1, 3, 4} == held(agent.view)
    assert follower.waiting() == []


def test_a_reader_joining_mid_epoch_understates_until_a_snapshot_then_is_exact():
    agent, index = Agent(), KvIndex(SCHEME)
    follower = FeedFollower(index)
    agent.publish(stored(1, 2))
    agent.publish(stored(3))
    seq, batch = agent.publish(stored(5))
    assert follower.on_entry(W, agent.epoch, seq, batch) is True  # joined at seq 2: awaits a snapshot
    assert held(index) == {5}, "it knows only what it saw: under-states, never over-states"
    snap_seq, snap = agent.snapshot()
    seq, batch = agent.publish(removed(1), stored(6))  # published after the snapshot was taken
    follower.on_entry(W, agent.epoch, seq, batch)
    assert follower.on_snapshot(W, agent.epoch, snap_seq, snap) is True
    assert held(index) == held(agent.view) == {2, 3, 5, 6}
    assert follower.waiting() == []


def test_a_gap_waits_for_a_snapshot_at_least_as_new_as_the_gap():
    agent, index = Agent(), KvIndex(SCHEME)
    follower = FeedFollower(index)
    for _ in range(2):
        follower.on_entry(W, agent.epoch, *agent.publish(stored(agent.seq + 10)))
    old_seq, old = agent.snapshot()  # as of seq 1
    agent.publish(stored(20))  # seq 2: lost
    agent.publish(stored(21))  # seq 3: lost
    seq, batch = agent.publish(removed(10))
    assert follower.on_entry(W, agent.epoch, seq, batch) is True
    assert follower.on_snapshot(W, agent.epoch, old_seq, old) is False, "too old: seq 2 and 3 are not in it"
    assert follower.stats.stale_snapshots == 1
    new_seq, new = agent.snapshot()
    assert follower.on_snapshot(W, agent.epoch, new_seq, new) is True
    assert held(index) == held(agent.view) == {11, 20, 21}


def test_duplicates_and_older_epochs_are_ignored_and_a_new_epoch_starts_afresh():
    agent, index = Agent(epoch=5), KvIndex(SCHEME)
    follower = FeedFollower(index)
    first = agent.publish(stored(1))
    follower.on_entry(W, 5, *first)
    follower.on_entry(W, 5, *first)
    assert follower.stats.duplicates == 1
    follower.on_entry(W, 4, 7, EventBatch(ts=0.0, events=(stored(99),)))  # a late entry of an older epoch
    assert held(index) == {1}
    restarted = Agent(epoch=6)
    follower.on_entry(W, 6, *restarted.publish(AllBlocksCleared(), stored(2)))
    assert held(index) == {2} and follower.waiting() == []
    assert follower.on_snapshot(W, 5, *agent.snapshot()) is False, "a snapshot of the old epoch"


def test_a_snapshot_starts_a_worker_a_reader_has_not_seen():
    agent, index = Agent(), KvIndex(SCHEME)
    agent.publish(stored(1, 2))
    follower = FeedFollower(index)
    assert follower.on_snapshot(W, agent.epoch, *agent.snapshot()) is True
    follower.on_entry(W, agent.epoch, 0, agent.entries[0][1])  # the stream from the snapshot's id: a duplicate
    follower.on_entry(W, agent.epoch, *agent.publish(stored(3)))
    assert held(index) == {1, 2, 3} and follower.stats.duplicates == 1
    assert follower.on_snapshot(W, agent.epoch, *agent.snapshot()) is False, "a whole view needs none"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 30), max_size=4), st.lists(st.integers(1, 30), max_size=3),
                          st.booleans(), st.booleans()), min_size=1, max_size=40),
       st.integers(0, 2**32))
def test_any_loss_pattern_ends_exact_after_a_fresh_snapshot(steps, seed):
    """Entries stored/removed at random, some lost on the way (``lost``), snapshots offered now and then: once the
    reader has seen the latest entry it never holds a block the agent does not, and is exact unless it still awaits
    a snapshot; a snapshot of the latest entry makes it exact."""
    rng = random.Random(seed)
    agent, index = Agent(), KvIndex(SCHEME)
    follower = FeedFollower(index, max_kept=rng.choice((1, 3, 100)))
    snaps = []
    for store, remove, lost, snap in steps:
        events = ((stored(*store),) if store else ()) + ((removed(*remove),) if remove else ())
        seq, batch = agent.publish(*events)
        if not lost:
            follower.on_entry(W, agent.epoch, seq, batch)
        if snap:
            snaps.append(agent.snapshot())
        if snaps and rng.random() < 0.3:
            follower.on_snapshot(W, agent.epoch, *rng.choice(snaps))
        if index.expected_seq(W) == agent.seq:  # it has seen the latest entry (a loss shows at the next one)
            assert held(index) <= held(agent.view), "never over-states"
            if not follower.waiting():
                assert held(index) == held(agent.view)
    follower.on_snapshot(W, agent.epoch, *agent.snapshot())
    if follower.followed(W) and index.expected_seq(W) == agent.seq:
        assert held(index) == held(agent.view)


def test_feed_codec_round_trip_and_first_block_check_fields():
    tokens = tuple(range(10, 10 + BS))
    salted = BlockStored(block_hashes=(2**64 - 5, 7), parent_block_hash=None, token_ids=tokens + (1, 2),
                         block_size=BS, extra_keys=(("kvs1-salt",),))
    child = BlockStored(block_hashes=(9,), parent_block_hash=7, token_ids=(5, 6, 7, 8), block_size=BS)
    batch = EventBatch(ts=12.5, events=(AllBlocksCleared(), salted, child, removed(7)))
    entry = to_feed(W, 3, 4, batch)
    wire = kv_feed_pb2.KvFeedBatch.FromString(entry.SerializeToString())
    assert (wire.worker_id, wire.epoch, wire.seq, wire.ts) == (W, 3, 4, 12.5)
    back = from_feed(wire)
    assert back.events[0] == AllBlocksCleared()
    assert back.events[1].block_hashes == (2**64 - 5, 7) and back.events[1].token_ids == tokens
    assert back.events[1].extra_keys == (("kvs1-salt",),)
    assert back.events[2].parent_block_hash == 7 and back.events[2].token_ids == ()
    assert back.events[3] == removed(7)


def test_feed_codec_refuses_bytes_hashes_and_bad_entries():
    with pytest.raises(BadFeedEntry):
        to_feed(W, 1, 0, EventBatch(ts=0, events=(BlockStored((b"\x01" * 32,), None, (), BS),)))
    bad = kv_feed_pb2.KvFeedBatch(worker_id=W)
    bad.events.add(stored=kv_feed_pb2.KvFeedStored(block_hashes=[1], block_size=0))
    with pytest.raises(BadFeedEntry):
        from_feed(bad)
    with pytest.raises(BadFeedEntry):
        from_feed(kv_feed_pb2.KvFeedBatch(worker_id=W, events=[kv_feed_pb2.KvFeedEvent()]))


def test_the_first_block_check_catches_another_seed_through_the_feed():
    """A worker hashing with another seed: its first block's tokens travel with the entry, and the reader's index
    distrusts the view instead of scoring it 0 silently."""
    tokens = list(range(100, 100 + BS))
    theirs = HashScheme(block_size=BS, seed="7").hashes(tokens)[0]
    event = BlockStored(block_hashes=(theirs,), parent_block_hash=None, token_ids=tuple(tokens), block_size=BS)
    index = KvIndex(SCHEME)
    FeedFollower(index).on_entry(W, 1, 0, from_feed(to_feed(W, 1, 0, EventBatch(ts=1, events=(event,)))))
    assert "differs" in index.stale_reason(W)
    ours = SCHEME.hashes(tokens)[0]
    good = KvIndex(SCHEME)
    event = BlockStored(block_hashes=(ours,), parent_block_hash=None, token_ids=tuple(tokens), block_size=BS)
    FeedFollower(good).on_entry(W, 1, 0, from_feed(to_feed(W, 1, 0, EventBatch(ts=1, events=(event,)))))
    assert good.stale_reason(W) == "" and good.cached_prefix_tokens(W, [ours]) == BS


def test_relay_events_take_the_engine_cache_only_and_unsign_hashes():
    batch = common_pb2.KvEventBatch(sequence_number=3, timestamp=7.0)
    block = common_pb2.KvBlock(block_hash=-7294539855038053950, token_ids=list(range(BS)), block_size=BS)
    batch.events.add(stored=common_pb2.KvBlocksStored(blocks=[block], cache_salt="kvs1-x"))
    batch.events.add(stored=common_pb2.KvBlocksStored(blocks=[block], tier=common_pb2.KV_CACHE_TIER_HOST))
    batch.events.add(stored=common_pb2.KvBlocksStored(blocks=[block], group_idx=1))
    batch.events.add(removed=common_pb2.KvBlocksRemoved(block_hashes=[-1], medium="CPU"))
    batch.events.add(removed=common_pb2.KvBlocksRemoved(block_hashes=[-1]))
    batch.events.add(cleared=common_pb2.KvCacheCleared())
    events = relay_events(batch).events
    assert len(events) == 3, events
    first, rm, cleared = events
    assert first.block_hashes == (11152204218671497666,), "vLLM's unsigned low 64 bits"
    assert first.token_ids == tuple(range(BS)) and first.extra_keys == (("kvs1-x",),)
    assert rm == BlockRemoved(block_hashes=(2**64 - 1,)) and cleared == AllBlocksCleared()
    assert relay_events(common_pb2.KvEventBatch(sequence_number=3)).events == ()


def test_an_adapters_turn_is_looked_up_under_the_adapter_as_each_worker_loaded_it():
    """Issue #37: vLLM hashes an adapter's blocks under its name and path. The scheduler's prefix index looks an
    adapter's turn up that way, with each worker's registered path: it finds the adapter's cached blocks, never the
    base model's blocks of the same tokens (and a base-model turn never the adapter's)."""
    from kvshuttle.services.scheduler.prefix_index import PrefixIndex
    from kvshuttle.v1 import common_pb2 as kvs_common

    scheme = HashScheme(block_size=4)
    tokens = list(range(100, 117))  # four full blocks and one token
    base, lora = scheme.hashes(tokens), scheme.hashes(tokens, lora=("sql", "/adapters/sql"))
    assert base != lora
    prefix = PrefixIndex(workers=None, url="redis://unused", key_prefix="/x/")
    prefix.index = KvIndex(scheme)
    prefix.follower = FeedFollower(prefix.index)

    def worker(worker_id: str, *adapters: tuple[str, str]) -> kvs_common.Worker:
        return kvs_common.Worker(worker_id=worker_id, kv_events=True, block_size=4, prefix_hash_algo="sha256",
                                 adapters=[kvs_common.LoraAdapter(name=n, id=1, path=p) for n, p in adapters])

    for worker_id, hashes in (("p-base", base[:3]), ("p-lora", lora[:2])):
        # (the feed carries a chain's first tokens only for blocks a reader can re-hash: not an adapter's)
        first = tuple(tokens[:4 * len(hashes)]) if worker_id == "p-base" else ()
        batch = EventBatch(ts=0.0, events=(BlockStored(block_hashes=tuple(hashes), parent_block_hash=None,
                                                       token_ids=first, block_size=4),))
        assert prefix.follower.on_snapshot(worker_id, 1, 1, batch)
    workers = [worker("p-base", ("sql", "/adapters/sql")), worker("p-lora", ("sql", "/adapters/sql"))]
    assert prefix.hits(tokens, "", workers) == {"p-base": 12, "p-lora": 0}
    assert prefix.hits(tokens, "", workers, adapter="sql") == {"p-base": 0, "p-lora": 8}
    moved = [worker("p-base"), worker("p-lora", ("sql", "/elsewhere/sql"))]  # loaded from another path: another KV
    assert prefix.hits(tokens, "", moved, adapter="sql") == {"p-lora": 0}
    assert prefix.hits(tokens, "", [worker("p-base")], adapter="sql") is None  # no worker serves it
