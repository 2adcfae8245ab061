"""Stored Responses API conversations as chains, without I/O: where a new response goes in its conversation, the
bounds on reading a conversation back, the check of each link, and the pages of ``input_items``.

A stored response keeps only the items new in its turn (its input, then its output) and names the response it
continues (``previous_response_id``). Its conversation is the chain of responses back to the first one
(``chain_id``); ``chain_length`` is its place in it (1: the first) and ``chain_bytes`` the bodies' bytes up to it,
so the bounds are checked before anything is read. An entry written before chains (``chain_length`` 0) holds the
whole conversation in its own body: it is a chain of one, and the first of any chain that continues it.

The expiry rule: a conversation's responses share one lease, granted with the first response's TTL; each response
stored in the conversation refreshes it, so they expire together, the TTL after the conversation's last stored
response (one keep-alive per turn, whatever the length). A deleted response breaks the conversation after it:
reading a later response's chain names the missing one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshuttle.control_plane.session import InvalidArgument
from kvshuttle.v1 import registry_pb2

MAX_CHAIN_RESPONSES = 1_000_000  # the most a GetResponseChain request may ask for
# What one entry adds to a chain's answer besides its body (ids, tenant, session, times, framing), counted against
# the byte bound so that the answer itself stays within it.
ENTRY_BYTES = 512
PAGE_LIMIT_RANGE = (1, 100)  # input_items' limit
DEFAULT_PAGE_LIMIT = 20
ORDERS = ("asc", "desc")


class ChainTooLong(ValueError):
    """The conversation has more responses or bytes than the bounds allow (the message names which)."""


class ChainBroken(ValueError):
    """An earlier response of the conversation is gone or does not fit its place (the message names it)."""

    def __init__(self, missing_id: str, message: str):
        super().__init__(message)
        self.missing_id = missing_id


@dataclass(frozen=True)
class ChainPlace:
    """Where a new response goes: its conversation (``chain_id``), its place and the bodies' bytes up to it, and
    whether it shares the previous response's lease (False for the first response, and after an entry written
    before chains, whose lease is its own)."""

    chain_id: str
    chain_length: int
    chain_bytes: int
    shares_lease: bool


def size_of(entry: registry_pb2.StoredResponse) -> tuple[int, int]:
    """(responses, body bytes) of the conversation up to ``entry``, itself included."""
    if entry.chain_length == 0:
        return 1, len(entry.body_json)
    return entry.chain_length, entry.chain_bytes


def place(previous: registry_pb2.StoredResponse | None, response_id: str, body_bytes: int) -> ChainPlace:
    """Where a response of ``body_bytes`` that continues ``previous`` (None: a new conversation) goes."""
    if previous is None:
        return ChainPlace(response_id, 1, body_bytes, shares_lease=False)
    length, size = size_of(previous)
    if previous.chain_length == 0:
        return ChainPlace(previous.response_id, 2, size + body_bytes, shares_lease=False)
    return ChainPlace(previous.chain_id, length + 1, size + body_bytes, shares_lease=True)


def check_bounds(entry: registry_pb2.StoredResponse, max_responses: int, max_bytes: int) -> None:
    """ChainTooLong when reading the conversation up to ``entry`` would pass either bound (before any read)."""
    length, size = size_of(entry)
    if length > max_responses:
        raise ChainTooLong(f"the conversation up to response {entry.response_id!r} has {length} stored responses; "
                           f"at most {max_responses} are read back")
    total = size + length * ENTRY_BYTES
    if total > max_bytes:
        raise ChainTooLong(f"the conversation up to response {entry.response_id!r} is about {total} bytes "
                           f"({size} of items in {length} responses); at most {max_bytes} are read back")


def validate_bounds(max_responses: int, max_bytes: int) -> None:
    """A GetResponseChain request's bounds: InvalidArgument when out of range."""
    if not 1 <= max_responses <= MAX_CHAIN_RESPONSES:
        raise InvalidArgument(f"max_responses must be between 1 and {MAX_CHAIN_RESPONSES}, got {max_responses}")
    if max_bytes < 1:
        raise InvalidArgument(f"max_bytes must be at least 1, got {max_bytes}")


def walk(links: Mapping[str, str], last: registry_pb2.StoredResponse) -> list[str]:
    """The ids of the conversation up to ``last`` (a chain entry, ``chain_length`` >= 1), oldest first, along the
    history store's ``links`` (response id -> the id it continues, '' for the first): exactly ``chain_length`` of
    them, so a walk never runs longer than the bounds checked on ``last``. The first id may be absent from
    ``links`` only when it is the conversation's ``chain_id`` (an entry written before chains, whose body is its
    own: the caller reads it). ChainBroken names the first response found missing."""
    ids = [last.response_id]
    while len(ids) < last.chain_length:
        here = ids[-1]
        if here not in links:
            raise _gone(here, last.response_id)
        previous = links[here]
        if not previous:
            raise ChainBroken(here, f"response {here!r} is not in its place in the conversation of response "
                                    f"{last.response_id!r}: the conversation cannot be read back")
        ids.append(previous)
    first = ids[-1]
    if first in links:
        if links[first]:
            raise ChainBroken(first, f"response {first!r} is not the first of the conversation of response "
                                     f"{last.response_id!r}: the conversation cannot be read back")
    elif first != last.chain_id or len(ids) == 1:
        raise _gone(first, last.response_id)
    ids.reverse()
    return ids


def _gone(missing: str, last: str) -> ChainBroken:
    return ChainBroken(missing, f"response {missing!r} of the conversation of response {last!r} is gone (deleted, "
                                "or its items lost): the conversation cannot be read back")


def page(ids: Sequence[str], after: str | None, limit: int, order: str) -> tuple[list[int], bool]:
    """One page of a list of ``ids`` (oldest first), as the Responses API pages ``input_items``: the indices (in the
    page's order) of at most ``limit`` ids after the one named ``after`` (None: from the start), newest first for
    ``desc``; and whether more follow. InvalidArgument for a bad limit, order, or an ``after`` not in the list."""
    low, high = PAGE_LIMIT_RANGE
    if not low <= limit <= high:
        raise InvalidArgument(f"limit must be between {low} and {high}, got {limit}")
    if order not in ORDERS:
        raise InvalidArgument(f"order must be 'asc' or 'desc', got {order!r}")
    indices = list(range(len(ids)))
    if order == "desc":
        indices.reverse()
    start = 0
    if after is not None:
        where = {ids[i]: n for n, i in enumerate(indices)}
        if after not in where:
            raise InvalidArgument(f"after: no item {after[:80]!r} among this response's input items")
        start = where[after] + 1
    chosen = indices[start:start + limit]
    return chosen, start + limit < len(indices)
