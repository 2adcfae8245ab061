"""control_plane/kv_index/hashing.py and cbor.py: the chain rules of vLLM's block hashes (that the bytes equal
vLLM's own: tests/slow/test_kv_index_vllm.py)."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvshuttle.control_plane.kv_index import cbor
from kvshuttle.control_plane.kv_index.hashing import (
    ALGOS,
    DEFAULT_SEED,
    HashScheme,
    UnsupportedHashAlgo,
    block_hashes,
    event_hash,
    none_hash,
)

tokens = st.lists(st.integers(0, 2**31 - 1), max_size=40)
algos = st.sampled_from(ALGOS)


@given(tokens, tokens, st.integers(1, 8), algos)
def test_a_longer_prompt_keeps_the_hashes_of_its_prefix_blocks(a, b, size, algo):
    whole = block_hashes(a + b, size, algo=algo)
    assert len(whole) == len(a + b) // size  # full blocks only
    head = block_hashes(a, size, algo=algo)
    assert whole[:len(head)] == head


@given(tokens, st.integers(1, 8), algos)
def test_each_hash_names_its_whole_prefix(toks, size, algo):
    """Changing one token changes the hash of its block and of every later block, never of an earlier one."""
    hashes = block_hashes(toks, size, algo=algo)
    for i in range(len(hashes) * size):
        changed = toks[:i] + [toks[i] + 1] + toks[i + 1:]
        other = block_hashes(changed, size, algo=algo)
        block = i // size
        assert other[:block] == hashes[:block]
        assert all(x != y for x, y in zip(other[block:], hashes[block:]))


@given(st.lists(st.integers(0, 1000), min_size=4, max_size=24), algos)
def test_a_salt_changes_every_block_and_an_empty_salt_is_no_salt(toks, algo):
    plain = block_hashes(toks, 4, algo=algo)
    salted = block_hashes(toks, 4, salt="kvs1-tenant", algo=algo)
    assert len(salted) == len(plain) and all(s != p for s, p in zip(salted, plain))
    assert block_hashes(toks, 4, salt="", algo=algo) == plain
    assert block_hashes(toks, 4, salt="kvs1-other", algo=algo)[0] != salted[0]


def test_the_salt_is_a_key_of_the_first_block_only():
    toks = list(range(12))
    salted = block_hashes(toks, 4, salt="s")
    first = hashlib.sha256(pickle.dumps((none_hash(), tuple(toks[:4]), (("cache_salt", "s"),)),
                                        protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, tuple(toks[4:8]), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert salted[:2] == [first, second]


def test_lora_is_a_key_of_every_block_before_the_salt():
    toks = list(range(8))
    h = block_hashes(toks, 4, salt="s", lora=("adapter", "/a"))
    first = hashlib.sha256(pickle.dumps(
        (none_hash(), (0, 1, 2, 3), (("lora", "adapter", "/a"), ("cache_salt", "s"))),
        protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, (4, 5, 6, 7), (("lora", "adapter", "/a"),)),
                                         protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert h == [first, second]


def test_the_seed_and_the_algorithm_change_every_hash():
    toks = list(range(16))
    base = block_hashes(toks, 4)
    assert none_hash() == hashlib.sha256(pickle.dumps(DEFAULT_SEED, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none_hash(seed=DEFAULT_SEED) == none_hash(seed=None)
    assert all(x != y for x, y in zip(block_hashes(toks, 4, seed="0"), base))
    assert all(x != y for x, y in zip(block_hashes(toks, 4, algo="sha256_cbor"), base))
    assert none_hash("sha256_cbor") == hashlib.sha256(b"\x6e" + DEFAULT_SEED.encode()).digest()


def test_unsupported_algorithms_and_sizes_are_refused():
    with pytest.raises(UnsupportedHashAlgo, match="xxhash"):
        block_hashes([1, 2], 1, algo="xxhash")
    with pytest.raises(UnsupportedHashAlgo):
        HashScheme(block_size=16, algo="xxhash_cbor")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        HashScheme(block_size=0)


def test_event_hash_is_the_low_64_bits_big_endian_or_the_digest():
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert event_hash(digest, int_hashes=False) == digest
    assert event_hash(b"\xff" * 32) == 2**64 - 1


def test_scheme_hashes_are_event_hashes_of_the_block_hashes():
    toks = list(range(300))
    scheme = HashScheme(block_size=128, seed="7")
    assert scheme.hashes(toks, salt="s") == [event_hash(h) for h in block_hashes(toks, 128, "s", seed="7")]
    assert HashScheme(block_size=128, int_hashes=False).hashes(toks) == block_hashes(toks, 128)
    assert scheme.hashes(toks[:127]) == []


# RFC 8949 appendix A examples (the subset of types vLLM's keys use)
@pytest.mark.parametrize(("value", "encoded"), [
    (0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"), (1000000, "1a000f4240"),
    (1000000000000, "1b000000e8d4a51000"), (2**64 - 1, "1bffffffffffffffff"), (-1, "20"), (-1000, "3903e7"),
    (-(2**64), "3bffffffffffffffff"), (None, "f6"), (True, "f5"), (False, "f4"), (b"", "40"), (b"\x01\x02\x03\x04", "4401020304"),
    ("", "60"), ("a", "6161"), ("\u00fc", "62c3bc"), ([], "80"), ((1, 2, 3), "83010203"),
    ([1, [2, 3], (4, 5)], "8301820203820405"), (list(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
])
def test_cbor_matches_the_rfc_examples(value, encoded):
    assert cbor.dumps(value).hex() == encoded


def test_cbor_refuses_what_it_cannot_write_exactly():
    for value in (1.5, {"a": 1}, 2**64, object()):
        with pytest.raises(TypeError):
            cbor.dumps(value)


edges = st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25, -(2**64)])


@given(st.lists(edges | st.integers(-(2**64), 2**64 - 1) | st.text(max_size=5) | st.none(), max_size=30))
def test_cbor_arrays_are_their_head_and_their_items(items):
    """The inline fast path for token ids writes each item as the general encoder does, at every width edge."""
    n = len(items)
    head = bytes([0x80 | n]) if n < 24 else bytes([0x98, n])  # an array of n items (n <= 30 here)
    assert cbor.dumps(items) == cbor.dumps(tuple(items)) == head + b"".join(cbor.dumps(i) for i in items)
