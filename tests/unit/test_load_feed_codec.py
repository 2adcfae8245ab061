"""The load feed's wire form (control_plane/load_feed.py): a sample goes out and comes back as the same load, a
failed poll as its error, and entries no publisher writes are refused."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.load_feed import BadLoadSample, from_feed, to_feed
from kvshuttle.v1 import kv_feed_pb2


def test_a_sample_round_trips():
    load = WorkerLoad(running=3, waiting=2, used_tokens=4000, capacity_tokens=10_000, waiting_uncached_tokens=700,
                      cache_hit_rate=0.25)
    wire = kv_feed_pb2.WorkerLoadSample.FromString(to_feed("p-1", 1_700_000_000.5, 0.5, load).SerializeToString())
    got = from_feed(wire)
    assert (got.worker_id, got.polled_at, got.interval_s, got.load, got.error) == ("p-1", 1_700_000_000.5, 0.5, load,
                                                                                  "")


def test_a_failed_poll_carries_its_error_and_no_load():
    got = from_feed(to_feed("d-0", 1.0, 0.5, None, "AioRpcError: UNAVAILABLE"))
    assert got.load is None and got.error == "AioRpcError: UNAVAILABLE"
    assert from_feed(to_feed("d-0", 1.0, 0.5, None)).error == "no answer"


@pytest.mark.parametrize("bad", [
    kv_feed_pb2.WorkerLoadSample(polled_at=1.0, interval_s=0.5),  # no worker
    kv_feed_pb2.WorkerLoadSample(worker_id="p", interval_s=0.5),  # no poll time
    kv_feed_pb2.WorkerLoadSample(worker_id="p", polled_at=1.0, interval_s=float("nan")),
    kv_feed_pb2.WorkerLoadSample(worker_id="p", polled_at=1.0, interval_s=0.5, running=-1),
    kv_feed_pb2.WorkerLoadSample(worker_id="p", polled_at=1.0, interval_s=0.5, cache_hit_rate=1.5),
])
def test_entries_no_publisher_writes_are_refused(bad):
    with pytest.raises(BadLoadSample):
        from_feed(bad)
