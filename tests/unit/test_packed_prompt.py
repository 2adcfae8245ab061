"""PlanTurnRequest.prompt_ids_packed: the prompt as int32 little-endian bytes reads as the same ids, hashes to the same
digests, and anything malformed is refused with a message naming the field."""

from __future__ import annotations

import random
from array import array

import pytest
from kvshuttle.control_plane.prefix import ids_bytes, prefix_digests
from kvshuttle.services.scheduler.planning import prompt_of
from kvshuttle.v1 import scheduler_pb2


def test_packed_ids_read_back_as_the_same_ids_and_digests():
    rng = random.Random(1)
    ids = [rng.randrange(0, 2**31 - 1) for _ in range(5000)] + [0, 2**31 - 1]
    packed = prompt_of(scheduler_pb2.PlanTurnRequest(prompt_ids_packed=ids_bytes(ids)))
    listed = prompt_of(scheduler_pb2.PlanTurnRequest(prompt_token_ids=ids))
    assert isinstance(packed, array) and list(packed) == listed == ids
    lengths = [1, 16, 4096, len(ids)]
    assert prefix_digests(packed, lengths) == prefix_digests(listed, lengths) == prefix_digests(ids_bytes(ids), lengths)
    assert ids_bytes(packed, 10) == ids_bytes(ids[:10])


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt_ids_packed": b"\x01\x00\x00"}, "4 bytes per id"),
    ({"prompt_ids_packed": ids_bytes([5, -1, 7])}, "non-negative"),
    ({"prompt_ids_packed": ids_bytes([5]), "prompt_token_ids": [5]}, "not both"),
    ({"prompt_token_ids": [3, -2]}, "non-negative"),
    ({}, "must not be empty"),
])
def test_a_malformed_prompt_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        prompt_of(scheduler_pb2.PlanTurnRequest(**fields))
