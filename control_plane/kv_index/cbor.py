"""Canonical CBOR (RFC 8949 §4.2.1) for the few types vLLM's ``sha256_cbor`` block hashes serialize (pure).

vLLM hashes ``cbor2.dumps((parent_hash, token_ids, extra_keys), canonical=True)``. Those values are only bytes,
str, int, None, bool and tuples/lists of them, so this encoder covers exactly those: shortest-form heads, definite
lengths, arrays for tuples and lists (cbor2 writes both as arrays). Anything else raises ``TypeError`` rather than
producing bytes that might differ from cbor2's.
"""

from __future__ import annotations

import struct
from typing import Any


def _head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    if value < 0x100:
        return bytes([major << 5 | 24, value])
    if value < 0x10000:
        return bytes([major << 5 | 25]) + struct.pack(">H", value)
    if value < 0x100000000:
        return bytes([major << 5 | 26]) + struct.pack(">I", value)
    return bytes([major << 5 | 27]) + struct.pack(">Q", value)


_SMALL = [bytes([v]) for v in range(24)]


def _encode(value: Any, out: list[bytes]) -> None:
    if value is None:
        out.append(b"\xf6")
    elif value is True:
        out.append(b"\xf5")
    elif value is False:
        out.append(b"\xf4")
    elif isinstance(value, int):
        if not -(1 << 64) <= value < 1 << 64:
            raise TypeError(f"integer {value} needs a CBOR bignum, which this encoder does not write")
        out.append(_head(0, value) if value >= 0 else _head(1, -1 - value))
    elif isinstance(value, bytes):
        out.append(_head(2, len(value)))
        out.append(value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out.append(_head(3, len(data)))
        out.append(data)
    elif isinstance(value, (tuple, list)):
        out.append(_head(4, len(value)))
        for item in value:
            if type(item) is int and 0 <= item < 0x10000:  # token ids: the bulk, written inline
                out.append(_SMALL[item] if item < 24 else bytes((0x18, item)) if item < 0x100
                           else b"\x19" + item.to_bytes(2, "big"))
            elif type(item) is int and 0 <= item < 0x100000000:
                out.append(b"\x1a" + item.to_bytes(4, "big"))
            else:
                _encode(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def dumps(value: Any) -> bytes:
    """``value`` in canonical CBOR, byte for byte what ``cbor2.dumps(value, canonical=True)`` writes."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)
