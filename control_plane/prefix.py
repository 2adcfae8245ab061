"""Prefix digests: prove that a new prompt extends the tokens a KV handle covers, token for token.

A session record keeps one digest of its history's first ``covered`` ids (``prefix_digest``) and a bounded list of
*checkpoints*: digests of shorter prefixes, at the turn boundaries (where a re-tokenized or edited history usually
starts to differ), thinned so the list never outgrows ``MAX_CHECKPOINTS`` however long the session gets. The record
therefore stays the same size at 1k or 1M tokens (the ids themselves live in the history store).

A digest of ``n`` ids hashes their int32 little-endian bytes (blake2b, its own personalization). All the digests a
record or a check needs come from one pass over the ids (the hash state is copied at each length), so checking a
prompt costs one hash of it, not one per block. A prompt that extends all covered ids matches ``prefix_digest``;
otherwise the longest checkpoint it matches proves its first ``tokens`` ids, of which whole blocks may be pulled.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence

HASH_BYTES = 16
MAX_CHECKPOINTS = 32
_PERSON = b"kvshuttle/prefix"  # blake2b personalization (16 bytes at most)
_SWAP = sys.byteorder != "little"


def ids_bytes(tokens: Sequence[int] | bytes, n: int | None = None) -> bytes:
    """The first ``n`` (default: all) ids as int32 little-endian bytes (``bytes`` input is taken as such)."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        return bytes(tokens if n is None else tokens[: 4 * n])
    if isinstance(tokens, array) and tokens.typecode == "i" and not _SWAP:  # already the bytes: a slice copies them
        return (tokens if n is None or n >= len(tokens) else tokens[:n]).tobytes()
    arr = array("i", tokens if n is None or n >= len(tokens) else tokens[:n])
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def prefix_digests(tokens: Sequence[int] | bytes, lengths: Iterable[int]) -> dict[int, bytes]:
    """Digests of the first ``n`` ids of ``tokens`` for each ``n`` in ``lengths`` (each within 1..len), one pass."""
    wanted = sorted(set(lengths))
    if not wanted:
        return {}
    data = memoryview(ids_bytes(tokens, wanted[-1]))
    if wanted[0] <= 0 or 4 * wanted[-1] > len(data):
        raise ValueError(f"prefix lengths must be within 1..{len(data) // 4}, got {wanted[0]}..{wanted[-1]}")
    hasher, done, out = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON), 0, {}
    for n in wanted:
        hasher.update(data[4 * done : 4 * n])
        done = n
        out[n] = hasher.copy().digest()
    return out


def prefix_digest(tokens: Sequence[int] | bytes, covered: int) -> bytes:
    """One hash of the first ``covered`` ids (``b""`` for none): equal digests mean equal ids."""
    if covered < 0 or 4 * covered > (len(tokens) if isinstance(tokens, bytes) else 4 * len(tokens)):
        raise ValueError(f"covered={covered} outside the ids given")
    return prefix_digests(tokens, [covered])[covered] if covered else b""


def checkpoint_lengths(previous: Iterable[int], boundary: int, covered: int,
                       limit: int = MAX_CHECKPOINTS, extra: Iterable[int] = ()) -> list[int]:
    """The prefix lengths a new record keeps checkpoints at: ``previous`` ones (still valid only as far as the new
    history continues the old one: the caller passes none past that) plus ``boundary`` (where this turn's ids
    began) and ``extra`` ones (the ends of the prompt's messages the record is indexed under), each below
    ``covered``; then thinned to ``limit``: while too many, the length closest to its lower neighbour goes (the
    newest is kept), so old turns end up sparse and recent ones dense."""
    lengths = sorted({n for n in (*previous, boundary, *extra) if 0 < n < covered})
    while len(lengths) > limit:
        gaps = [lengths[i] - (lengths[i - 1] if i else 0) for i in range(len(lengths) - 1)]
        del lengths[gaps.index(min(gaps))]
    return lengths


def matched_prefix_tokens(covered: int, block_size: int, prompt: Sequence[int], digest: bytes,
                          checkpoints: Sequence[tuple[int, bytes]] = ()) -> int:
    """How many leading ids of ``prompt`` provably equal the handle's.

    ``covered`` when the prompt extends (or equals) all covered ids (its digest matches ``digest``); otherwise the
    whole blocks within the longest checkpoint ``(tokens, digest)`` it matches; 0 when none matches.
    """
    if block_size <= 0 or covered <= 0 or not digest:
        return 0
    lengths = [n for n, _ in checkpoints if 0 < n < covered and n <= len(prompt)]
    if covered <= len(prompt):
        lengths.append(covered)
    if not lengths:
        return 0
    got = prefix_digests(prompt, lengths)
    if got.get(covered) == digest:
        return covered
    proven = max((n for n, d in checkpoints if got.get(n) == d), default=0)
    return proven // block_size * block_size


class PrefixHasher:
    """The digest of a growing id sequence (a session's history, turn by turn), each id hashed once: the same digests
    as :func:`prefix_digests`, at O(new ids) per turn instead of O(history)."""

    __slots__ = ("_hasher", "length")

    def __init__(self) -> None:
        self._hasher = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON)
        self.length = 0

    def extend(self, ids: Sequence[int] | bytes) -> None:
        data = ids_bytes(ids)
        self._hasher.update(data)
        self.length += len(data) // 4

    def digest(self) -> bytes:
        """The digest of all ids so far (``b""`` for none, as :func:`prefix_digest`)."""
        return self._hasher.copy().digest() if self.length else b""

    def copy(self) -> PrefixHasher:
        out = PrefixHasher()
        out._hasher, out.length = self._hasher.copy(), self.length
        return out

    def digests_along(self, ids: Sequence[int], lengths: Iterable[int]) -> dict[int, bytes]:
        """Extend this hasher (over the first ``self.length`` of ``ids``) through all of ``ids``; returns the
        digests at ``lengths`` (each within ``self.length + 1 .. len(ids)``). Costs O(new ids)."""
        start, wanted = self.length, sorted(set(lengths))
        if wanted and not start < wanted[0] <= wanted[-1] <= len(ids):
            raise ValueError(f"lengths must be within {start + 1}..{len(ids)}, got {wanted[0]}..{wanted[-1]}")
        out = {}
        for n in [*wanted, len(ids)]:
            if n > self.length:
                self.extend(ids[self.length:n])
            if n in wanted:
                out[n] = self.digest()
        return out
