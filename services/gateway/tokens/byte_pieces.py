"""Each token id's bytes, for a tokenizer whose decoder is byte-level alone (GPT-2's byte-to-character map: Qwen,
Llama 3, gpt-oss, DeepSeek): such a decoder writes each token's bytes and decodes their concatenation as UTF-8, an
invalid sequence becoming U+FFFD. With the table, a streamed token's text is a list lookup and a UTF-8 step (the
detokenizer's per-token path, issue #36) instead of the tokenizers library's two decodes per step.

A table is made only when it provably decodes every id as the tokenizer does: the decoder is ``ByteLevel`` with
nothing around it, and each id's bytes, decoded, equal the tokenizer's own decode of that id, special tokens skipped
or kept (one batch decode of the vocabulary). Any other tokenizer gets None and keeps the library's steps.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel


def _char_bytes() -> dict[str, int]:
    """GPT-2's map of the 256 bytes to printable characters, reversed: character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


CHAR_BYTES = _char_bytes()


def token_bytes(token: str) -> bytes:
    """A token's bytes as the byte-level decoder writes them: each character's byte, or the token's own UTF-8 when a
    character is outside the map (e.g. an added token such as ``<｜end▁of▁sentence｜>``)."""
    try:
        return bytes([CHAR_BYTES[c] for c in token])
    except KeyError:
        return token.encode()


def byte_tables(tok: Tokenizer) -> dict[bool, list[bytes]] | None:
    """Each id's bytes by ``skip_special_tokens`` (a skipped special token, an id with no token: ``b""``), or None
    when the tokenizer's decoder is not byte-level alone or a table would decode an id otherwise than it does."""
    if type(tok.decoder) is not ByteLevel:
        return None
    size = max(tok.get_vocab_size(with_added_tokens=True),
               1 + max(tok.get_added_tokens_decoder(), default=-1))
    kept = [b""] * size
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        kept[i] = token_bytes(token)
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    skipped = [b"" if i in special else piece for i, piece in enumerate(kept)]
    every = [[i] for i in range(size)]
    for table, skip in ((kept, False), (skipped, True)):
        if tok.decode_batch(every, skip_special_tokens=skip) != [piece.decode(errors="replace") for piece in table]:
            return None
    return {False: kept, True: skipped}
