import pytest

from control_plane.prefix import block_hash_chain, matched_prefix_tokens

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
