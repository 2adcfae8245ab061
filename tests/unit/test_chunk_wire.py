"""engine/chunk_wire.plain_chunk against protobuf's own parse: it reads exactly what the parse reads, or nothing."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.services.engine.chunk_wire import plain_chunk
from smg_grpc_proto import vllm_engine_pb2 as pb

uint32 = st.integers(0, 2**32 - 1)


def parsed(message: bytes) -> tuple[list[int], int, int] | None:
    """What the usual parse makes of a message, as plain_chunk answers (None: not a chunk)."""
    response = pb.GenerateResponse.FromString(message)
    if response.WhichOneof("response") != "chunk":
        return None
    c = response.chunk
    return list(c.token_ids), c.prompt_tokens, c.cached_tokens


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


def chunk_message(body: bytes) -> bytes:
    return field(1, 2, varint(len(body)) + body)


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(uint32, max_size=40), prompt=uint32, completion=uint32, cached=uint32, index=uint32)
def test_a_plain_chunk_reads_as_the_parse_reads_it(ids, prompt, completion, cached, index):
    message = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
        index=index)).SerializeToString()
    got = plain_chunk(message)
    ids_bytes = sum(len(varint(i)) for i in ids)
    if ids_bytes < 0x80:  # the token path's chunks: read, always
        assert got == (ids, prompt, cached) == parsed(message)
    else:
        assert got is None or got == parsed(message)


def test_what_it_leaves_to_the_parse():
    with_logprobs = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=[5], prompt_tokens=3,
        output_logprobs=pb.OutputLogProbs(token_logprobs=[-0.5], token_ids=[5]))).SerializeToString()
    complete = pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[5], finish_reason="stop",
                                                                prompt_tokens=3)).SerializeToString()
    ids = field(1, 2, b"\x01\x05")  # packed: one byte, id 5
    unknown = chunk_message(field(9, 0, varint(1)) + ids)
    two_chunks = chunk_message(ids) + chunk_message(field(1, 2, b"\x01\x06"))
    too_big = chunk_message(ids + field(2, 0, varint(2**32)))
    for message in (with_logprobs, complete, unknown, two_chunks, too_big, b"", b"\x0a"):
        assert plain_chunk(message) is None, message.hex()
    assert parsed(two_chunks) == ([5, 6], 0, 0)  # merged by the parse: left to it
    assert parsed(too_big) == ([5], 0, 0)  # truncated to 32 bits by the parse: left to it
    crossing = chunk_message(field(1, 2, b"\x01" + varint(300)) + field(2, 0, varint(1)))  # an id past its run
    assert plain_chunk(crossing) is None
    with pytest.raises(DecodeError):
        parsed(crossing)


@pytest.mark.parametrize("message, expected", [
    # unpacked ids (a parser must take both encodings), mixed with a packed run
    (chunk_message(field(1, 0, varint(7)) + field(1, 0, varint(300))), ([7, 300], 0, 0)),
    (chunk_message(field(1, 0, varint(7)) + field(1, 2, varint(4) + varint(300) + varint(9) + varint(1))),
     ([7, 300, 9, 1], 0, 0)),
    # a scalar written twice: the last one counts; fields in any order
    (chunk_message(field(2, 0, varint(10)) + field(4, 0, varint(3)) + field(2, 0, varint(11))
                   + field(1, 2, varint(1) + varint(4))), ([4], 11, 3)),
    (chunk_message(b""), ([], 0, 0)),
])
def test_encodings_the_parse_takes(message, expected):
    assert plain_chunk(message) == expected == parsed(message)


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=24))
def test_any_bytes_read_as_the_parse_reads_them(body):
    message = chunk_message(body)
    got = plain_chunk(message)
    if got is None:
        return
    assert got == parsed(message)  # whatever it reads, the parse reads the same (it never reads a message it refuses)
