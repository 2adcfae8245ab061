"""A small MessagePack decoder (pure, standard library only), enough for vLLM's KV-event batches.

control_plane imports nothing outside the standard library, and neither ``msgpack`` nor ``msgspec`` is a dependency
of the control plane (msgspec comes with vLLM, on the workers). The whole format is decoded except extension types
(vLLM's encoder writes none for these events); maps become dicts (keys must be hashable: str, int, bytes...),
arrays lists, bin bytes, str str. Malformed input raises :class:`MsgpackError`, never anything else.
"""

from __future__ import annotations

import struct
from typing import Any

MAX_DEPTH = 32  # vLLM's batches nest 4 deep; refuse pathological input instead of recursing without bound


class MsgpackError(ValueError):
    """Bytes that are not one well-formed MessagePack value."""


_FIXED = {0xC0: None, 0xC2: False, 0xC3: True}
_NUMBERS = {  # type byte -> (struct format, size)
    0xCA: (">f", 4), 0xCB: (">d", 8),
    0xCC: (">B", 1), 0xCD: (">H", 2), 0xCE: (">I", 4), 0xCF: (">Q", 8),
    0xD0: (">b", 1), 0xD1: (">h", 2), 0xD2: (">i", 4), 0xD3: (">q", 8),
}
_LENGTHS = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
_LENGTH_FORMAT = {1: ">B", 2: ">H", 4: ">I"}


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise MsgpackError(f"truncated: needs {n} more bytes at offset {self.pos}")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise MsgpackError(f"nested deeper than {MAX_DEPTH}")
        code = self.take(1)[0]
        if code <= 0x7F:
            return code
        if code >= 0xE0:
            return code - 0x100
        if 0x80 <= code <= 0x8F:
            return self.map(code & 0x0F, depth)
        if 0x90 <= code <= 0x9F:
            return self.array(code & 0x0F, depth)
        if 0xA0 <= code <= 0xBF:
            return self.text(code & 0x1F)
        if code in _FIXED:
            return _FIXED[code]
        if code in _NUMBERS:
            fmt, size = _NUMBERS[code]
            return struct.unpack(fmt, self.take(size))[0]
        if code in _LENGTHS:
            size = _LENGTHS[code]
            n = struct.unpack(_LENGTH_FORMAT[size], self.take(size))[0]
            if code <= 0xC6:
                return self.take(n)
            if code <= 0xDB:
                return self.text(n)
            return self.array(n, depth) if code <= 0xDD else self.map(n, depth)
        raise MsgpackError(f"unsupported type byte 0x{code:02x} at offset {self.pos - 1} (extension or reserved)")

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MsgpackError(f"invalid UTF-8 in a string: {exc}") from None

    def array(self, n: int, depth: int) -> list:
        data, pos, size = self.data, self.pos, len(self.data)
        if n > size - pos:  # each element takes at least one byte
            raise MsgpackError(f"truncated: an array of {n} items in {size - pos} bytes")
        out: list = []
        append = out.append
        for _ in range(n):  # token ids: small unsigned ints read inline (the bulk of a batch), the rest by value()
            code = data[pos] if pos < size else -1
            if 0 <= code <= 0x7F:
                append(code)
                pos += 1
            elif 0xCC <= code <= 0xCE and pos + (2, 3, 5)[code - 0xCC] <= size:
                width = (1, 2, 4)[code - 0xCC]
                append(int.from_bytes(data[pos + 1:pos + 1 + width], "big"))
                pos += 1 + width
            else:
                self.pos = pos
                append(self.value(depth + 1))
                pos = self.pos
        self.pos = pos
        return out

    def map(self, n: int, depth: int) -> dict:
        if 2 * n > len(self.data) - self.pos:
            raise MsgpackError(f"truncated: a map of {n} entries in {len(self.data) - self.pos} bytes")
        out = {}
        for _ in range(n):
            key = self.value(depth + 1)
            try:
                out[key] = self.value(depth + 1)
            except TypeError:
                raise MsgpackError(f"unhashable map key of type {type(key).__name__}") from None
        return out


def unpackb(data: bytes) -> Any:
    """The one MessagePack value ``data`` holds (trailing bytes are an error)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MsgpackError(f"expected bytes, got {type(data).__name__}")
    reader = _Reader(bytes(data))
    value = reader.value()
    if reader.pos != len(reader.data):
        raise MsgpackError(f"{len(reader.data) - reader.pos} trailing bytes after the value")
    return value
