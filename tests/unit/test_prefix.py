import random

import pytest
from kvshuttle.control_plane import prefix
from kvshuttle.control_plane.prefix import block_hash_chain, matched_prefix_tokens, prefix_digest

BS = 4


def test_chain_has_one_hash_per_block_including_partial():
    assert len(block_hash_chain(list(range(10)), 10, BS)) == 3
    assert len(block_hash_chain(list(range(10)), 8, BS)) == 2
    assert block_hash_chain(list(range(10)), 0, BS) == []


def test_extension_matches_all_covered_tokens():
    history = list(range(100, 110))
    chain = block_hash_chain(history, 9, BS)
    assert matched_prefix_tokens(chain, 9, BS, history + [1, 2, 3]) == 9
    assert matched_prefix_tokens(chain, 9, BS, history[:9]) == 9


def test_divergence_stops_at_last_whole_matching_block():
    history = list(range(100, 120))
    chain = block_hash_chain(history, 19, BS)
    edited = history.copy()
    edited[9] = 7  # third block (8..11) differs
    assert matched_prefix_tokens(chain, 19, BS, edited) == 8
    edited = history.copy()
    edited[18] = 7  # partial last block differs
    assert matched_prefix_tokens(chain, 19, BS, edited) == 16
    assert matched_prefix_tokens(chain, 19, BS, [1] + history) == 0


def test_truncated_prompt_matches_only_whole_blocks_it_contains():
    history = list(range(100, 120))
    chain = block_hash_chain(history, 19, BS)
    assert matched_prefix_tokens(chain, 19, BS, history[:10]) == 8


def test_hash_depends_on_all_earlier_blocks():
    a = block_hash_chain([1, 2, 3, 4, 5, 6, 7, 8], 8, BS)
    b = block_hash_chain([9, 2, 3, 4, 5, 6, 7, 8], 8, BS)
    assert a[1] != b[1]


def test_bad_arguments():
    with pytest.raises(ValueError):
        block_hash_chain([1, 2], 3, BS)
    with pytest.raises(ValueError):
        matched_prefix_tokens([b"x"], 9, BS, [1])


def test_digest_confirms_an_extension_with_one_hash(monkeypatch):
    history = list(range(100, 139))
    chain, digest = block_hash_chain(history, 37, BS), prefix_digest(history, 37)
    walked = []
    monkeypatch.setattr(prefix, "_chunk_bytes", lambda tokens: walked.append(1) or bytes(4 * len(tokens)))
    assert matched_prefix_tokens(chain, 37, BS, history + [1, 2], digest) == 37
    assert matched_prefix_tokens(chain, 37, BS, history[:37], digest) == 37
    assert walked == []  # the chain was not walked


@pytest.mark.parametrize("covered", [1, 4, 37, 40])
def test_any_single_token_change_falls_back_to_the_chain(covered):
    rng = random.Random(covered)
    history = [rng.randrange(50_000) for _ in range(41)]
    chain, digest = block_hash_chain(history, covered, BS), prefix_digest(history, covered)
    for i in range(covered):
        edited = history.copy()
        edited[i] += 1
        assert prefix_digest(edited, covered) != digest
        expected = (i // BS) * BS  # the whole blocks before the change
        assert matched_prefix_tokens(chain, covered, BS, edited, digest) == expected
        assert matched_prefix_tokens(chain, covered, BS, edited) == expected
    # A change after the covered tokens does not matter; a prompt shorter than them uses the chain.
    assert matched_prefix_tokens(chain, covered, BS, history[:covered] + [7], digest) == covered
    assert matched_prefix_tokens(chain, covered, BS, history[:covered - 1], digest) == ((covered - 1) // BS) * BS


def test_records_without_a_digest_use_the_chain():
    history = list(range(100, 120))
    chain = block_hash_chain(history, 19, BS)
    assert matched_prefix_tokens(chain, 19, BS, history + [1], b"") == 19
    edited = history.copy()
    edited[9] = 7
    assert matched_prefix_tokens(chain, 19, BS, edited, b"") == 8


def test_digest_is_not_a_chain_link_and_depends_on_length():
    history = list(range(100, 104))
    assert prefix_digest(history, 4) != block_hash_chain(history, 4, BS)[0]
    assert prefix_digest(history, 3) != prefix_digest(history, 4)
    assert prefix_digest(history, 0) == b""
    assert prefix_digest([0, 0], 1) != prefix_digest([0, 0], 2)
    with pytest.raises(ValueError):
        prefix_digest(history, 5)


def test_the_digest_is_trusted_like_the_chain():
    history = list(range(100, 120))
    chain = block_hash_chain(history, 19, BS)
    edited = history.copy()
    edited[9] = 7
    # Like a forged chain, a forged digest vouches for the tokens it was made of (the scheduler therefore re-checks
    # its plan against the record it claimed, digest included); a digest of nothing in particular proves nothing.
    assert matched_prefix_tokens(chain, 19, BS, edited, prefix_digest(edited, 19)) == 19
    assert matched_prefix_tokens(chain, 19, BS, edited, b"x" * 16) == 8
