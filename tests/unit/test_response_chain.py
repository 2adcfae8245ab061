"""Stored Responses API conversations as chains (control_plane/response_chain.py): where a new response goes, the
bounds checked before a read, the walk along the history store's links, and input_items' pages."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane import response_chain as chains
from kvshuttle.control_plane.session import InvalidArgument
from kvshuttle.v1 import registry_pb2


def entry(rid: str, length: int, size: int = 100, chain_id: str = "r1", previous: str = "",
          body: bytes = b"") -> registry_pb2.StoredResponse:
    return registry_pb2.StoredResponse(response_id=rid, chain_id=chain_id, chain_length=length, chain_bytes=size,
                                       previous_response_id=previous, body_json=body,
                                       body_in_history_store=length > 0)


def test_a_new_conversation_starts_a_chain_and_a_continuation_joins_it():
    first = chains.place(None, "r1", 50)
    assert first == chains.ChainPlace("r1", 1, 50, shares_lease=False)
    second = chains.place(entry("r1", 1, 50), "r2", 70)
    assert second == chains.ChainPlace("r1", 2, 120, shares_lease=True)
    # A branch from the first: same conversation, same place as the second.
    assert chains.place(entry("r1", 1, 50), "r2b", 10) == chains.ChainPlace("r1", 2, 60, shares_lease=True)


def test_an_entry_written_before_chains_is_the_first_of_a_new_chain_with_a_lease_of_its_own():
    legacy = entry("old", 0, body=b"x" * 300)
    assert chains.size_of(legacy) == (1, 300)
    assert chains.place(legacy, "r2", 40) == chains.ChainPlace("old", 2, 340, shares_lease=False)


def test_bounds_count_responses_and_bytes_with_each_entrys_share():
    last = entry("r9", 9, 1000)
    chains.check_bounds(last, 9, 1000 + 9 * chains.ENTRY_BYTES)
    with pytest.raises(chains.ChainTooLong, match="9 stored responses; at most 8"):
        chains.check_bounds(last, 8, 1 << 30)
    with pytest.raises(chains.ChainTooLong, match="at most 5607"):
        chains.check_bounds(last, 9, 1000 + 9 * chains.ENTRY_BYTES - 1)
    chains.validate_bounds(1, 1)
    for bad in [(0, 5), (chains.MAX_CHAIN_RESPONSES + 1, 5), (5, 0), (5, -1)]:
        with pytest.raises(InvalidArgument):
            chains.validate_bounds(*bad)


def test_the_walk_follows_the_links_back_to_the_first_response():
    links = {"r1": "", "r2": "r1", "r3": "r2", "r3b": "r2", "r4": "r3"}
    assert chains.walk(links, entry("r4", 4, previous="r3")) == ["r1", "r2", "r3", "r4"]
    assert chains.walk(links, entry("r3b", 3, previous="r2")) == ["r1", "r2", "r3b"]
    assert chains.walk(links, entry("r1", 1)) == ["r1"]


@pytest.mark.parametrize("links, last, missing", [
    ({"r1": "", "r3": "r2", "r4": "r3"}, ("r4", 4), "r2"),  # a deleted response in the middle
    ({"r1": "", "r2": "r1"}, ("r3", 3), "r3"),  # the last's own link gone
    ({}, ("r1", 1), "r1"),
    ({"r1": "", "r2": "r1", "r3": ""}, ("r3", 3), "r3"),  # a link that ends too soon
    ({"r0": "", "r1": "r0", "r2": "r1"}, ("r2", 2), "r1"),  # one that goes on past the first
])
def test_a_broken_walk_names_the_missing_response(links, last, missing):
    with pytest.raises(chains.ChainBroken) as err:
        chains.walk(links, entry(last[0], last[1]))
    assert err.value.missing_id == missing and repr(missing) in str(err.value)


def test_the_walk_ends_at_a_first_response_written_before_chains():
    # r2 continued an entry written before chains ("old", the chain's id): its body is in etcd, not in the links.
    assert chains.walk({"r2": "old", "r3": "r2"}, entry("r3", 3, chain_id="old")) == ["old", "r2", "r3"]
    # The walk cannot tell it from a deleted first response: the registry reads that one's etcd entry (test_response_
    # chains.py::test_a_deleted_response_breaks_its_conversation_by_name).
    assert chains.walk({"r2": "r1", "r3": "r2"}, entry("r3", 3, chain_id="r1")) == ["r1", "r2", "r3"]
    with pytest.raises(chains.ChainBroken):  # only the chain's own first may be missing from the links
        chains.walk({"r2": "other", "r3": "r2"}, entry("r3", 3, chain_id="old"))


def test_the_walk_never_runs_longer_than_the_entry_says_even_on_a_cycle():
    links = {"a": "b", "b": "a"}
    with pytest.raises(chains.ChainBroken):
        chains.walk(links, entry("a", 5, chain_id="a"))


IDS = ["i0", "i1", "i2", "i3", "i4"]


@pytest.mark.parametrize("after, limit, order, want, more", [
    (None, 20, "desc", [4, 3, 2, 1, 0], False),
    (None, 2, "desc", [4, 3], True),
    ("i3", 2, "desc", [2, 1], True),
    ("i1", 2, "desc", [0], False),
    (None, 2, "asc", [0, 1], True),
    ("i1", 3, "asc", [2, 3, 4], False),
    ("i4", 3, "asc", [], False),
])
def test_pages_as_the_responses_api_pages_input_items(after, limit, order, want, more):
    assert chains.page(IDS, after, limit, order) == (want, more)


def test_bad_page_requests_are_refused_by_name():
    for args, says in [(("nope", 2, "asc"), "after"), ((None, 0, "asc"), "limit"), ((None, 101, "asc"), "limit"),
                       ((None, 2, "up"), "order")]:
        with pytest.raises(InvalidArgument, match=says):
            chains.page(IDS, *args)
