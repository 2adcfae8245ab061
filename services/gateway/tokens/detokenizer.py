"""The answer's text, one piece per new token, such that the pieces a stream sends, the whole answer's text and the text
the session records are the same string.

Decoding token by token cannot just decode each id alone: a character may span several byte-level tokens, and a
tokenizer may merge or space tokens differently in context. So each step decodes a short window (from a few tokens
back) and sends what it adds to the window's earlier text, holding back text that ends in an unfinished character
(U+FFFD) until the next token completes it, as vLLM's incremental detokenizer does. The answer's text is the
concatenation of the pieces (plus what ``finish`` flushes): a client that echoes back what it was streamed echoes
the recorded text, and its next turn continues the recorded token ids.

Three ways, the same pieces: a byte-level tokenizer's table of each id's bytes (``GatewayTokenizer.byte_table``,
tokens/byte_pieces.py) makes a step a lookup and a UTF-8 decode of the new bytes, held back by the same rule; another
real tokenizer (``GatewayTokenizer.backend``) steps in the tokenizers library's own ``DecodeStream`` (the same
window-and-hold-back steps, in Rust: ~2 µs per token against ~8 for the window decoded from Python,
docs/performance.md); the Python window is the fallback (any tokenizer with ``decode``, or a step DecodeStream
refuses) and ``finish`` uses it after either of the last two.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"
_utf8 = codecs.utf_8_decode  # (bytes, errors, final) -> (text, bytes used): an unfinished character is left unused
WINDOW = 6  # tokens decoded before the first new one: enough for a character split over byte-level tokens


class IncrementalText:
    """One decode per token, mostly: the window's earlier text is the previous step's text while the window keeps
    its start; the start moves up (one more decode) once the window has grown ``WINDOW`` tokens past its floor."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # where the window starts
        self._read = 0  # ids whose text has been sent
        self._before = ""  # the text of ids[prefix:read] (the window's; unused while the stream runs)
        self._pieces: list[str] = []
        # A byte-level tokenizer's table: the new bytes are decoded on their own, after those an unfinished character
        # left over (``_rest``); text that ends in U+FFFD or before such a character waits in ``_held``.
        table = getattr(tokenizer, "byte_table", None)
        self._table: list[bytes] | None = table(skip_special_tokens) if table is not None else None
        self._rest, self._held = b"", ""
        backend = getattr(tokenizer, "backend", None)
        self._backend = backend if isinstance(backend, Tokenizer) and self._table is None else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None

    @property
    def text(self) -> str:
        """The pieces so far, joined."""
        return "".join(self._pieces)

    def _window(self, end: int) -> str:
        return self._decode(self._ids[self._prefix:end], self._skip)

    def add(self, ids: Sequence[int]) -> str:
        """The text that ``ids`` add (possibly "" while a character is unfinished)."""
        if not ids:
            return ""
        table = self._table
        if table is not None:  # the new bytes, after those an unfinished character left over
            data = (table[ids[0]] if len(ids) == 1 and ids[0] < len(table) else
                    b"".join(table[i] for i in ids if i < len(table)))
            if self._rest:
                data = self._rest + data
            text, used = _utf8(data, "replace", False)
            self._rest = data[used:]
            piece = self._held + text if self._held else text
            if not piece or self._rest or piece[-1] == REPLACEMENT:  # the window's rule: wait for what ends otherwise
                self._held = piece
                return ""
            self._held = ""
            self._pieces.append(piece)
            return piece
        self._ids.extend(ids)
        stream = self._stream
        if stream is not None:
            try:
                piece = stream.step(self._backend, ids[0] if len(ids) == 1 else list(ids))
            except Exception:  # noqa: BLE001 - e.g. a step whose text does not extend the last: the window goes on
                self._to_window()
            else:
                if not piece:
                    return ""
                self._read = len(self._ids)
                self._pieces.append(piece)
                return piece
        before = self._before
        now = self._window(len(self._ids))
        if len(now) <= len(before) or now.endswith(REPLACEMENT) or not now.startswith(before):
            return ""
        piece = now[len(before):]
        self._read = len(self._ids)
        if self._read - self._prefix > 2 * WINDOW:
            self._prefix = self._read - WINDOW
            self._before = self._window(self._read)
        else:
            self._before = now
        self._pieces.append(piece)
        return piece

    def _to_window(self) -> None:
        """Leave the stream for the Python window, the window ending where the sent text ends."""
        self._stream = None
        self._prefix = max(0, self._read - WINDOW)
        self._before = self._window(self._read)

    def finish(self) -> str:
        """What is still held back (an unfinished character comes out as U+FFFD), once the answer has ended."""
        if self._table is not None:
            piece = self._held + _utf8(self._rest, "replace", True)[0]
            self._rest, self._held = b"", ""
            self._pieces.append(piece)
            return piece
        if self._stream is not None:
            self._to_window()
        before, now = self._before, self._window(len(self._ids))
        piece = now[len(before):] if now.startswith(before) else ""
        self._read = len(self._ids)
        self._before = now
        self._pieces.append(piece)
        return piece
