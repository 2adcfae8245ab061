"""D's plain streamed chunk read straight from its wire bytes: the per-token message of a streamed Generate.

A ``GenerateResponse`` whose ``chunk`` carries token ids and counts only (no logprobs) is most of what a decode
worker sends, one per token and stream. ``plain_chunk`` reads its ids, ``prompt_tokens`` and ``cached_tokens`` from
the protobuf wire format with no message objects (protobuf's own parse, then a list of the ids and an attribute read
per field, cost ~2x more, hot, message to Chunk: docs/performance.md). Anything else (logprobs, a field it does not know,
the ``complete`` message, a malformed or unusual encoding) is None, and the caller parses the message with the
generated class as before: this reads exactly what that parse reads, or nothing
(tests/unit/test_chunk_wire.py checks it against protobuf's parse).

The field numbers come from the generated descriptors (smg-grpc-proto's ``vllm_engine.proto``), not from this file.
"""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2

_VARINT, _LEN = 0, 2
_CHUNK = vllm_engine_pb2.GenerateResponse.DESCRIPTOR.fields_by_name["chunk"].number
_FIELDS = vllm_engine_pb2.GenerateStreamChunk.DESCRIPTOR.fields_by_name
_IDS = _FIELDS["token_ids"].number
_PROMPT, _CACHED = _FIELDS["prompt_tokens"].number, _FIELDS["cached_tokens"].number
_OTHER_COUNTS = {_FIELDS[name].number for name in ("completion_tokens", "index")}  # read past: the lane needs none

_CHUNK_TAG = _CHUNK << 3 | _LEN
_PACKED_IDS, _ONE_ID = _IDS << 3 | _LEN, _IDS << 3 | _VARINT
_PROMPT_TAG, _CACHED_TAG = _PROMPT << 3 | _VARINT, _CACHED << 3 | _VARINT
_SKIPPED_TAGS = frozenset(number << 3 | _VARINT for number in _OTHER_COUNTS)
_UINT32 = 1 << 32
# Every tag this reads is one byte (field numbers under 16): a descriptor that says otherwise turns the reader off.
_ENABLED = all(tag < 0x80 for tag in (_CHUNK_TAG, _PACKED_IDS, _PROMPT_TAG, _CACHED_TAG, *_SKIPPED_TAGS))


def plain_chunk(message: bytes) -> tuple[list[int], int, int] | None:
    """``(token_ids, prompt_tokens, cached_tokens)`` of a plain chunk message, or None: parse it the usual way."""
    if not _ENABLED or not message or message[0] != _CHUNK_TAG:
        return None
    m = message
    try:
        # The chunk's length, which must cover the rest of the message exactly (a second chunk field would merge
        # into the first: the usual parse does that).
        b = m[1]
        i, size, shift = 2, b & 0x7F, 7
        while b >= 0x80:
            b = m[i]
            i += 1
            size |= (b & 0x7F) << shift
            shift += 7
        end = i + size
        if end != len(m):
            return None
        ids: list[int] = []
        prompt = cached = 0
        run_end = 0  # where the packed run of ids being read ends
        while i < end:
            in_run = i < run_end
            if in_run:
                tag = _ONE_ID
            else:
                tag = m[i]
                i += 1
            b = m[i]
            i += 1
            value, shift = b & 0x7F, 7
            while b >= 0x80:
                b = m[i]
                i += 1
                value |= (b & 0x7F) << shift
                shift += 7
            if value >= _UINT32 or (in_run and i > run_end):  # (an id that runs past its packed run)
                return None
            if tag == _ONE_ID:  # an id of a packed run, or an unpacked one (a parser must take both encodings)
                ids.append(value)
            elif tag == _PACKED_IDS:  # value: the run's length in bytes
                run_end = i + value
                if run_end > end:
                    return None
            elif tag == _PROMPT_TAG:
                prompt = value
            elif tag == _CACHED_TAG:
                cached = value
            elif tag not in _SKIPPED_TAGS:
                return None  # logprobs, a field this does not read, or a wire type it does not expect
    except IndexError:  # truncated: the usual parse says how
        return None
    return ids, prompt, cached
