import hashlib
import random
import struct

import pytest
from kvshuttle.control_plane import prefix
from kvshuttle.control_plane.prefix import (
    MAX_CHECKPOINTS,
    checkpoint_lengths,
    ids_bytes,
    matched_prefix_tokens,
    prefix_digest,
    prefix_digests,
)

BS = 4


def reference_digest(tokens, n) -> bytes:
    """The digest's definition, written out: blake2b-128, personalized, over the first n ids as int32 LE."""
    return hashlib.blake2b(struct.pack(f"<{n}i", *tokens[:n]), digest_size=16, person=b"kvshuttle/prefix").digest()


def checkpoints_of(tokens, lengths):
    got = prefix_digests(tokens, lengths)
    return [(n, got[n]) for n in sorted(lengths)]


# -- digests ---------------------------------------------------------------------------------------------------------

def test_ids_bytes_are_int32_little_endian():
    assert ids_bytes([1, 256, 2**31 - 1]) == struct.pack("<3i", 1, 256, 2**31 - 1)
    assert ids_bytes([1, 2, 3], 2) == struct.pack("<2i", 1, 2)
    assert ids_bytes([1, 2], 5) == struct.pack("<2i", 1, 2)
    raw = struct.pack("<3i", 7, 8, 9)
    assert ids_bytes(raw) == raw and ids_bytes(raw, 1) == raw[:4]


def test_the_digest_is_the_documented_hash():
    history = [5, 0, 2**31 - 1, 123_456, 7]
    for n in range(1, len(history) + 1):
        assert prefix_digest(history, n) == reference_digest(history, n)
        assert len(prefix_digest(history, n)) == prefix.HASH_BYTES


def test_equal_ids_have_equal_digests_and_any_change_differs():
    rng = random.Random(3)
    history = [rng.randrange(50_000) for _ in range(41)]
    digest = prefix_digest(history, 37)
    assert prefix_digest(list(history), 37) == digest
    assert prefix_digest(history[:37] + [1, 2, 3], 37) == digest  # ids after the covered ones do not count
    for i in range(37):
        edited = history.copy()
        edited[i] += 1
        assert prefix_digest(edited, 37) != digest, i
    assert prefix_digest(history, 36) != digest  # the length counts
    assert prefix_digest([0, 0], 1) != prefix_digest([0, 0], 2)
    assert prefix_digest(history, 0) == b""


def test_one_pass_digests_equal_separate_ones():
    rng = random.Random(5)
    history = [rng.randrange(50_000) for _ in range(100)]
    lengths = [100, 1, 37, 64, 37, 99]
    got = prefix_digests(history, lengths)
    assert sorted(got) == [1, 37, 64, 99, 100]
    for n, digest in got.items():
        assert digest == reference_digest(history, n) == prefix_digest(history[:n], n)
    assert prefix_digests(ids_bytes(history), lengths) == got  # bytes in, same digests
    assert prefix_digest(ids_bytes(history), 64) == got[64]
    assert prefix_digests(history, []) == {}


def test_bad_lengths():
    with pytest.raises(ValueError):
        prefix_digest([1, 2], 3)
    with pytest.raises(ValueError):
        prefix_digest(ids_bytes([1, 2]), 3)
    with pytest.raises(ValueError):
        prefix_digest([1, 2], -1)
    with pytest.raises(ValueError):
        prefix_digests([1, 2], [0, 1])
    with pytest.raises(ValueError):
        prefix_digests([1, 2], [1, 3])


# -- checkpoints -----------------------------------------------------------------------------------------------------

def test_checkpoint_lengths_keep_the_boundary_and_valid_previous_ones():
    assert checkpoint_lengths([5, 10, 15], 20, 21) == [5, 10, 15, 20]
    assert checkpoint_lengths([15, 5, 10, 10], 20, 21) == [5, 10, 15, 20]  # sorted, no duplicates
    # Each below covered and above 0: a checkpoint at covered would repeat prefix_digest.
    assert checkpoint_lengths([5, 10, 15], 20, 20) == [5, 10, 15]
    assert checkpoint_lengths([0, -3, 5, 5, 40], 12, 30) == [5, 12]
    assert checkpoint_lengths([], 0, 10) == []
    assert checkpoint_lengths([], 4, 0) == []
    # the ends of the prompt's messages (the record's text boundaries) are kept too, below covered
    assert checkpoint_lengths([5], 20, 30, extra=[17, 31, 0]) == [5, 17, 20]


def test_thinning_keeps_at_most_the_limit_and_the_newest():
    lengths = checkpoint_lengths(range(1, 100), 150, 200, limit=8)
    assert len(lengths) == 8 and lengths[-1] == 150
    assert lengths == sorted(set(lengths))
    assert set(lengths) <= {*range(1, 100), 150}


def test_a_long_session_keeps_a_bounded_list_that_reaches_back():
    kept, covered = [], 0
    for _ in range(500):
        boundary = covered + 50  # the turn's prompt, then its answer
        covered = boundary + 20
        kept = checkpoint_lengths(kept, boundary, covered)
        assert len(kept) <= MAX_CHECKPOINTS
        assert kept[-1] == boundary  # the newest turn boundary is always kept
        assert kept == sorted(set(kept))
    assert len(kept) == MAX_CHECKPOINTS
    # Old turns sparse, recent ones dense; the oldest kept still lies in the session's first tenth.
    gaps = [b - a for a, b in zip([0, *kept], kept, strict=False)]
    assert gaps[-1] < gaps[0]
    assert kept[0] < covered // 10


# -- matching a prompt -----------------------------------------------------------------------------------------------

def setup_handle(covered=37, total=45, at=(8, 19, 30)):
    rng = random.Random(covered)
    history = [rng.randrange(50_000) for _ in range(total)]
    return history, prefix_digest(history, covered), checkpoints_of(history, at)


def test_a_prompt_that_extends_the_covered_ids_matches_them_all():
    history, digest, cps = setup_handle()
    assert matched_prefix_tokens(37, BS, history, digest, cps) == 37
    assert matched_prefix_tokens(37, BS, history[:37], digest, cps) == 37  # equal to them
    assert matched_prefix_tokens(37, BS, history[:37] + [7, 7], digest) == 37  # no checkpoints needed


def test_a_prompt_that_diverges_after_a_checkpoint_keeps_its_whole_blocks():
    history, digest, cps = setup_handle()
    for i, expected in [(36, 28), (30, 28), (29, 16), (19, 16), (18, 8), (8, 8)]:
        edited = history.copy()
        edited[i] += 1
        # the longest checkpoint before the change: 30 -> 7 whole blocks (28); 19 -> 16; 8 -> 8
        assert matched_prefix_tokens(37, BS, edited, digest, cps) == expected, i


def test_a_prompt_that_diverges_before_every_checkpoint_matches_nothing():
    history, digest, cps = setup_handle()
    for i in range(8):
        edited = history.copy()
        edited[i] += 1
        assert matched_prefix_tokens(37, BS, edited, digest, cps) == 0
    edited = history.copy()
    edited[36] += 1
    assert matched_prefix_tokens(37, BS, edited, digest) == 0  # no checkpoints: all or nothing
    assert matched_prefix_tokens(37, BS, [1, *history], digest, cps) == 0


def test_a_prompt_shorter_than_the_covered_ids_uses_the_checkpoints_it_reaches():
    history, digest, cps = setup_handle()
    assert matched_prefix_tokens(37, BS, history[:36], digest, cps) == 28  # checkpoint 30
    assert matched_prefix_tokens(37, BS, history[:29], digest, cps) == 16  # checkpoint 19
    assert matched_prefix_tokens(37, BS, history[:7], digest, cps) == 0
    assert matched_prefix_tokens(37, BS, [], digest, cps) == 0
    assert matched_prefix_tokens(37, BS, history[:36], digest) == 0


def test_unusable_records_and_checkpoints_prove_nothing():
    history, digest, cps = setup_handle()
    assert matched_prefix_tokens(37, BS, history, b"", cps) == 0
    assert matched_prefix_tokens(0, BS, history, digest, cps) == 0
    assert matched_prefix_tokens(37, 0, history, digest, cps) == 0
    edited = history.copy()
    edited[36] += 1
    # Checkpoints at or beyond covered, or of nothing (0), are not trusted; a wrong digest proves nothing.
    beyond = checkpoints_of(history, [37, 40])
    assert matched_prefix_tokens(37, BS, edited, digest, beyond) == 0
    assert matched_prefix_tokens(37, BS, edited, digest, [(30, b"x" * 16)]) == 0
    assert matched_prefix_tokens(37, BS, edited, digest, [(0, b"")]) == 0


def test_the_digest_is_trusted_as_given():
    history, _, _ = setup_handle()
    edited = history.copy()
    edited[9] = 7
    # A forged digest vouches for the ids it was made of (the scheduler therefore re-checks its plan against the
    # record it claimed, digests included); a digest of nothing in particular proves nothing.
    assert matched_prefix_tokens(37, BS, edited, prefix_digest(edited, 37)) == 37
    assert matched_prefix_tokens(37, BS, edited, b"x" * 16) == 0


def test_prefix_hasher_gives_the_one_pass_digests_turn_by_turn():
    from kvshuttle.control_plane.prefix import PrefixHasher

    ids = list(range(1000, 1700))
    hasher, seen = PrefixHasher(), {}
    assert hasher.digest() == b""
    for start, end in ((0, 100), (100, 101), (101, 450), (450, 700)):
        hasher.extend(ids[start:end])
        seen[end] = hasher.digest()
    assert hasher.length == 700
    assert seen == prefix_digests(ids, seen)
    assert seen[450] == prefix_digest(ids, 450) != prefix_digest(ids, 449)


def test_a_resumed_hasher_gives_the_one_pass_digests_of_the_new_lengths():
    from kvshuttle.control_plane.prefix import PrefixHasher

    ids = list(range(5000, 6200))
    first = PrefixHasher()
    assert first.digests_along(ids[:700], [300, 700]) == prefix_digests(ids, [300, 700])
    assert first.length == 700
    resumed = first.copy()
    assert resumed.digests_along(ids, [701, 900, 1200]) == prefix_digests(ids, [701, 900, 1200])
    assert first.length == 700 and resumed.length == 1200  # the copy moved, the original did not
    assert resumed.digest() == prefix_digest(ids, 1200)
    with pytest.raises(ValueError, match="lengths must be within 701"):
        first.copy().digests_along(ids, [700, 900])
