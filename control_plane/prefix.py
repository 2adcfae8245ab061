"""Token-block hash chains: prove that a new prompt extends the tokens a KV handle covers, token for token.

A chain over `tokens[:covered]` in `block_size` chunks: ``h[i] = H(h[i-1] || chunk_i)``. The last chunk may be
partial (vLLM's handle covers `remote_num_tokens`, rarely a block multiple). Because each hash folds in all earlier
ones, equal ``h[i]`` means equal tokens up to the end of chunk ``i``.

A record also carries one digest of all of ``tokens[:covered]`` (same hash, its own personalization, so a digest is
never mistaken for a chain link): the usual prompt extends the whole covered history, and one hash over it proves
that at once; the chain is walked only when the digest differs, to find the last matching block.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

HASH_BYTES = 16
_SEED = b"kvshuttle/v1/block-chain"
_DIGEST_PERSON = b"kvshuttle/prefix"  # blake2b personalization (16 bytes at most)


def _chunk_bytes(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


def block_hash_chain(tokens: Sequence[int], covered: int, block_size: int) -> list[bytes]:
    """Hashes of ``tokens[:covered]`` chunked by ``block_size``; the last chunk may be partial."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if covered < 0 or covered > len(tokens):
        raise ValueError(f"covered={covered} outside 0..{len(tokens)}")
    chain: list[bytes] = []
    prev = hashlib.blake2b(_SEED, digest_size=HASH_BYTES).digest()
    for start in range(0, covered, block_size):
        chunk = tokens[start : min(start + block_size, covered)]
        prev = hashlib.blake2b(prev + _chunk_bytes(chunk), digest_size=HASH_BYTES).digest()
        chain.append(prev)
    return chain


def prefix_digest(tokens: Sequence[int], covered: int) -> bytes:
    """One hash of ``tokens[:covered]`` (``b""`` for none): equal digests mean equal covered tokens."""
    if covered < 0 or covered > len(tokens):
        raise ValueError(f"covered={covered} outside 0..{len(tokens)}")
    if covered == 0:
        return b""
    data = struct.pack(f"<{covered}i", *tokens[:covered])  # int32 little-endian; faster than array for a list
    return hashlib.blake2b(covered.to_bytes(8, "little") + data, digest_size=HASH_BYTES,
                           person=_DIGEST_PERSON).digest()


def matched_prefix_tokens(
    chain: Sequence[bytes], covered: int, block_size: int, prompt: Sequence[int], digest: bytes = b""
) -> int:
    """How many leading tokens of ``prompt`` provably equal the covered tokens.

    Returns ``covered`` when every chunk matches (the prompt extends the covered tokens, or equals them), otherwise
    the length of the whole blocks that match. A partial last chunk counts only when it matches in full. With the
    record's ``digest`` (``prefix_digest`` of the covered tokens) a prompt that extends them all is confirmed with
    one hash; without it, or when it differs, the chain decides.
    """
    if len(chain) != -(-covered // block_size):
        raise ValueError("chain length does not fit covered tokens and block size")
    if digest and covered and len(prompt) >= covered and prefix_digest(prompt, covered) == digest:
        return covered
    usable = min(covered, len(prompt))
    prev = hashlib.blake2b(_SEED, digest_size=HASH_BYTES).digest()
    matched = 0
    for i, start in enumerate(range(0, covered, block_size)):
        end = min(start + block_size, covered)
        if end > usable:
            break
        prev = hashlib.blake2b(prev + _chunk_bytes(prompt[start:end]), digest_size=HASH_BYTES).digest()
        if prev != chain[i]:
            break
        matched = end
    return matched
