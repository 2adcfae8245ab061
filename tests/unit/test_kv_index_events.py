"""control_plane/kv_index/events.py and msgpack_reader.py: vLLM's KV-event batches decoded, bad ones refused with
BadEventPayload (the bytes of vLLM's own encoder: tests/slow/test_kv_index_vllm.py)."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvshuttle.control_plane.kv_index.events import (
    AllBlocksCleared,
    BadEventPayload,
    BlockRemoved,
    BlockStored,
    UnknownEvent,
    decode_batch,
    decode_message,
    decode_sequence,
)
from kvshuttle.control_plane.kv_index.msgpack_reader import MAX_DEPTH, MsgpackError, unpackb


def pack(value: Any) -> bytes:
    """A plain MessagePack encoder for the tests (shortest forms, as msgspec writes them)."""
    if value is None:
        return b"\xc0"
    if value is True or value is False:
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        if 0 <= value < 128:
            return bytes([value])
        if -32 <= value < 0:
            return struct.pack(">b", value)
        for code, fmt, lo, hi in ((0xCC, ">B", 0, 2**8), (0xCD, ">H", 0, 2**16), (0xCE, ">I", 0, 2**32),
                                  (0xCF, ">Q", 0, 2**64), (0xD0, ">b", -2**7, 2**7), (0xD1, ">h", -2**15, 2**15),
                                  (0xD2, ">i", -2**31, 2**31), (0xD3, ">q", -2**63, 2**63)):
            if lo <= value < hi:
                return bytes([code]) + struct.pack(fmt, value)
        raise ValueError(value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, bytes):
        return _sized(len(value), None, 0xC4, 0xC5, 0xC6) + value
    if isinstance(value, str):
        data = value.encode()
        return _sized(len(data), 0xA0 if len(data) < 32 else None, 0xD9, 0xDA, 0xDB) + data
    if isinstance(value, (list, tuple)):
        return _sized(len(value), 0x90 if len(value) < 16 else None, None, 0xDC, 0xDD) + b"".join(map(pack, value))
    if isinstance(value, dict):
        head = _sized(len(value), 0x80 if len(value) < 16 else None, None, 0xDE, 0xDF)
        return head + b"".join(pack(k) + pack(v) for k, v in value.items())
    raise TypeError(type(value))


def _sized(n: int, fix: int | None, c8: int | None, c16: int, c32: int) -> bytes:
    if fix is not None:
        return bytes([fix | n])
    if c8 is not None and n < 2**8:
        return bytes([c8, n])
    return bytes([c16]) + struct.pack(">H", n) if n < 2**16 else bytes([c32]) + struct.pack(">I", n)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.binary(max_size=40)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=10) | st.integers(-2**63, 2**64 - 1), inner,
                                                                 max_size=20),
    max_leaves=60)


@given(values)
def test_msgpack_round_trip(value):
    assert unpackb(pack(value)) == value


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_msgpack_error_only(data):
    try:
        unpackb(data)
    except MsgpackError:
        pass


@given(values, st.data())
def test_truncated_or_extended_values_are_refused(value, data):
    encoded = pack(value)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(MsgpackError):
        unpackb(encoded[:cut])
    with pytest.raises(MsgpackError, match="trailing"):
        unpackb(encoded + b"\x00")


def test_msgpack_refuses_extensions_deep_nesting_bad_text_and_non_bytes():
    with pytest.raises(MsgpackError, match="0xd4"):
        unpackb(b"\xd4\x01\x00")
    with pytest.raises(MsgpackError, match="nested"):
        unpackb(b"\x91" * (MAX_DEPTH + 2) + b"\x00")
    with pytest.raises(MsgpackError, match="UTF-8"):
        unpackb(b"\xa1\xff")
    with pytest.raises(MsgpackError, match="unhashable"):
        unpackb(b"\x81\x90\x00")  # {[]: 0}
    with pytest.raises(MsgpackError, match="bytes"):
        unpackb("text")  # type: ignore[arg-type]
    with pytest.raises(MsgpackError, match="truncated"):
        unpackb(b"\xdd\xff\xff\xff\xff")  # an array claiming 4G items


def stored(**fields) -> dict:
    return {"type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
            **fields}


def test_a_batch_decodes_into_our_types():
    payload = pack([1764880000.25, [
        stored(extra_keys=[["kvs1-salt"], None], group_idx=0),
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": None},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    ], 0])
    batch = decode_batch(payload)
    assert batch.ts == 1764880000.25 and batch.data_parallel_rank == 0
    assert batch.events == (
        BlockStored(block_hashes=(2**64 - 1, 7), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2,
                    medium="GPU", extra_keys=(("kvs1-salt",), None), group_idx=0),
        BlockRemoved(block_hashes=(b"\x01" * 32,)), AllBlocksCleared(), UnknownEvent("SomethingNew"))


def test_omitted_fields_take_defaults_and_the_rank_may_be_absent():
    batch = decode_batch(pack([3, [{"type": "BlockRemoved", "block_hashes": [5]}]]))
    assert batch.ts == 3.0 and batch.data_parallel_rank is None
    assert batch.events == (BlockRemoved(block_hashes=(5,), medium=None, group_idx=None),)
    assert decode_batch(pack([0.0, [stored(parent_block_hash=9)]])).events[0].parent_block_hash == 9


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", pack({"ts": 1}), pack([1.0]), pack([1.0, [], 0, 1]), pack(["1", []]), pack([True, []]),
    pack([1.0, {}]), pack([1.0, [], "0"]), pack([1.0, [5]]), pack([1.0, [{"block_hashes": []}]]),
    pack([1.0, [{"type": 3}]]),
    pack([1.0, [stored(block_hashes=[1.5])]]), pack([1.0, [stored(block_hashes=[True])]]),
    pack([1.0, [stored(block_hashes=None)]]), pack([1.0, [stored(token_ids=[1, "2"])]]),
    pack([1.0, [stored(token_ids=None)]]), pack([1.0, [stored(block_size=0)]]),
    pack([1.0, [stored(block_size=None)]]), pack([1.0, [stored(parent_block_hash="p")]]),
    pack([1.0, [stored(medium=3)]]), pack([1.0, [stored(group_idx="0")]]), pack([1.0, [stored(extra_keys="s")]]),
    pack([1.0, [{"type": "BlockRemoved", "block_hashes": 4}]]),
])
def test_malformed_batches_raise_bad_event_payload(payload):
    with pytest.raises(BadEventPayload):
        decode_batch(payload)


@given(st.binary(max_size=120))
def test_any_payload_decodes_or_raises_bad_event_payload_only(data):
    try:
        decode_batch(data)
    except BadEventPayload:
        pass


def test_messages_and_sequence_frames():
    seq, batch = decode_message([b"topic", (41).to_bytes(8, "big"), pack([1.0, []])])
    assert seq == 41 and batch.events == ()
    assert decode_sequence((-1).to_bytes(8, "big", signed=True)) == -1  # the replay socket's end marker
    for frames in ([b"", b"\x00" * 8], [b"", b"\x00" * 7, pack([1.0, []])]):
        with pytest.raises(BadEventPayload):
            decode_message(frames)
