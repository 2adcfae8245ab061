"""The history store's assembly rule and its id encoding (pure: no backend)."""

from __future__ import annotations

import pytest
from kvshuttle.control_plane.prefix import ids_bytes as ids_to_bytes
from kvshuttle.services.store.history import assemble, bytes_to_ids, truncated


def seg(start: int, ids: list[int]) -> tuple[int, bytes]:
    return start, ids_to_bytes(ids)


def test_ids_round_trip_as_int32_little_endian():
    ids = [0, 1, 151_643, 2**31 - 1, -1]
    b = ids_to_bytes(ids)
    assert len(b) == 4 * len(ids)
    assert b[4:8] == (1).to_bytes(4, "little")
    assert bytes_to_ids(b) == ids
    assert ids_to_bytes([]) == b"" and bytes_to_ids(b"") == []
    with pytest.raises(ValueError):
        bytes_to_ids(b"\x00" * 5)


def test_contiguous_segments_assemble_in_offset_order():
    segments = [seg(3, [3, 4]), seg(0, [0, 1, 2]), seg(5, [5])]
    assert bytes_to_ids(assemble(segments, 6)) == [0, 1, 2, 3, 4, 5]


def test_result_is_truncated_to_length():
    assert bytes_to_ids(assemble([seg(0, [0, 1, 2]), seg(3, [3, 4])], 4)) == [0, 1, 2, 3]
    assert assemble([seg(0, [7])], 0) == b""
    assert assemble([], 0) == b""


def test_a_segment_before_the_position_is_stale_and_skipped():
    # a later append rewrote [0, 4) as one segment; the old one at 2 lies inside it
    segments = [seg(0, [0, 1, 2, 3]), seg(2, [92, 93, 94]), seg(4, [4])]
    assert bytes_to_ids(assemble(segments, 5)) == [0, 1, 2, 3, 4]


def test_a_gap_or_too_few_ids_is_none():
    assert assemble([seg(0, [0, 1]), seg(3, [3])], 4) is None  # id 2 missing
    assert assemble([seg(1, [1, 2])], 2) is None  # nothing at 0
    assert assemble([seg(0, [0, 1])], 3) is None  # shorter than length
    assert assemble([], 1) is None


def test_segments_past_the_length_do_not_matter():
    # a gap after the ids asked for is no gap for this read
    assert bytes_to_ids(assemble([seg(0, [0, 1]), seg(9, [9])], 2)) == [0, 1]


def test_the_first_ids_of_a_lineage_are_its_segments_up_to_there_the_last_one_cut():
    segments = [seg(0, [0, 1, 2]), seg(1, [91]), seg(3, [3, 4, 5]), seg(6, [6])]
    assert truncated(segments, 5) == [seg(0, [0, 1, 2]), seg(3, [3, 4])]  # the stale one at 1 skipped
    assert truncated(segments, 3) == [seg(0, [0, 1, 2])]
    assert b"".join(ids for _, ids in truncated(segments, 7)) == assemble(segments, 7)
    assert truncated([seg(0, [0]), seg(2, [2])], 3) == []  # a gap: nothing
    assert truncated(segments, 9) == []  # fewer ids than asked for
