"""control_plane/kv_index against the installed vLLM's own code, by plain function calls (no engine starts):
its block hashes (request block hasher, NONE_HASH, the seed as `kvshuttle worker` starts vLLM), its KV-event
classes and the publisher's encoder, and its block pool's real events driving the index."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshuttle.control_plane.kv_index import cbor, events, hashing
from kvshuttle.control_plane.kv_index.index import KvIndex, Outcome
from kvshuttle.services.common.config import add_arguments, from_namespace
from kvshuttle.services.common.processes import child_env
from kvshuttle.workers.vllm_process import WorkerConfig, vllm_command

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")
cbor2 = pytest.importorskip("cbor2")
from vllm import SamplingParams  # noqa: E402
from vllm.config.cache import PrefixCachingHashAlgo  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

SALT = "kvs1-0123456789abcdef0123456789abcdef"


@pytest.fixture
def none_hash_of(monkeypatch):
    """Sets vLLM's NONE_HASH as its engine would with this process's PYTHONHASHSEED (``seed``: None unsets it);
    vLLM's globals are put back afterwards."""
    missing = object()
    saved = getattr(kv_cache_utils, "NONE_HASH", missing), kv_cache_utils._NONE_HASH_SEED  # unset until an engine

    def init(algo: str, seed: str | None):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        fn = vllm_hashing.get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(fn)
        return fn

    yield init
    if saved[0] is missing:
        del kv_cache_utils.NONE_HASH
    else:
        kv_cache_utils.NONE_HASH = saved[0]
    kv_cache_utils._NONE_HASH_SEED = saved[1]


def request(tokens, fn, block_size, salt=None, lora=None) -> Request:
    return Request("r", list(tokens), SamplingParams(max_tokens=1), None, cache_salt=salt,
                   lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
                   block_hasher=kv_cache_utils.get_request_block_hasher(block_size, fn))


def test_we_support_every_cryptographic_algorithm_vllm_offers_and_its_default():
    offered = set(PrefixCachingHashAlgo.__args__)
    assert set(hashing.ALGOS) == offered - {"xxhash", "xxhash_cbor"}
    from vllm.config.cache import CacheConfig
    assert CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default == hashing.DEFAULT_ALGO
    assert kv_cache_utils.DEFAULT_NONE_HASH_SEED == hashing.DEFAULT_SEED


@pytest.mark.parametrize("algo", hashing.ALGOS)
@pytest.mark.parametrize("seed", [None, "0", "4242"])
def test_block_hashes_equal_vllms_request_block_hasher(none_hash_of, algo, seed):
    fn = none_hash_of(algo, seed)
    assert hashing.none_hash(algo, seed) == kv_cache_utils.NONE_HASH
    rng = random.Random(f"{algo}{seed}")
    for block_size in (1, 16, 128):
        for _ in range(6):
            tokens = [rng.randrange(0, 2**31 - 1) for _ in range(rng.randrange(0, 5 * block_size))]
            for salt in (None, SALT):
                theirs = request(tokens, fn, block_size, salt).block_hashes
                assert hashing.block_hashes(tokens, block_size, salt or "", algo, seed) == theirs
            theirs = request(tokens, fn, block_size, SALT, lora=("adapter", "/loras/a")).block_hashes
            assert hashing.block_hashes(tokens, block_size, SALT, algo, seed, lora=("adapter", "/loras/a")) == theirs


def test_event_hashes_equal_vllms_conversion(none_hash_of):
    none_hash_of("sha256", None)
    for h in hashing.block_hashes(list(range(64)), 16):
        assert hashing.event_hash(h) == kv_cache_utils.maybe_convert_block_hash(h)  # VLLM_KV_EVENTS_USE_INT_... on


@pytest.mark.parametrize(("flags", "algo"), [([], "sha256"), (["--prefix-hash-seed", "4242",
                                                                 "--prefix-hash-algo", "sha256_cbor"], "sha256_cbor")])
def test_the_seed_as_the_worker_starts_vllm(monkeypatch, flags, algo):
    """vLLM in a child started with the environment `kvshuttle worker` gives it, under a parent that has its own
    PYTHONHASHSEED, derives the NONE_HASH of the worker's prefix_hash_scheme (and gets its algorithm flag)."""
    parser = argparse.ArgumentParser()
    add_arguments(WorkerConfig, parser)
    cfg = from_namespace(WorkerConfig, parser.parse_args(["--role", "prefill", "--model", "/m", *flags]), environ={})
    argv, env_changes = vllm_command(cfg)
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == algo
    code = ("import sys; from vllm.v1.core import kv_cache_utils as k; from vllm.utils.hashing import "
            "get_hash_fn_by_name as g; k.init_none_hash(g(sys.argv[1])); print(k.NONE_HASH.hex())")
    monkeypatch.setenv("PYTHONHASHSEED", "999")  # the worker's own environment: must not reach vLLM's hash seed
    out = subprocess.run([sys.executable, "-c", code, algo], env=child_env(env_changes), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    scheme = cfg.prefix_hash_scheme(block_size=128)
    assert out.stdout.split()[-1] == hashing.none_hash(scheme.algo, scheme.seed).hex()


def test_our_decoder_reads_vllms_encoded_batches():
    stored = kv_events.BlockStored(
        block_hashes=[2**64 - 1, 12345], parent_block_hash=77, token_ids=list(range(32)), block_size=16,
        lora_id=None, medium="GPU", lora_name=None, extra_keys=[(SALT,), None], group_idx=0)
    removed = kv_events.BlockRemoved(block_hashes=[b"\x07" * 32], medium="GPU", group_idx=0)
    encoder = msgspec.msgpack.Encoder()  # what ZmqEventPublisher sends as the payload frame
    for rank in (None, 0, 3):
        batch = kv_events.KVEventBatch(ts=1764880000.5, events=[stored, removed, kv_events.AllBlocksCleared()],
                                       data_parallel_rank=rank)
        seq, ours = events.decode_message([b"", (5).to_bytes(8, "big"), encoder.encode(batch)])
        assert seq == 5 and ours.ts == 1764880000.5 and ours.data_parallel_rank == rank
        assert ours.events == (
            events.BlockStored(block_hashes=(2**64 - 1, 12345), parent_block_hash=77, token_ids=tuple(range(32)),
                               block_size=16, medium="GPU", extra_keys=((SALT,), None), group_idx=0),
            events.BlockRemoved(block_hashes=(b"\x07" * 32,), medium="GPU", group_idx=0),
            events.AllBlocksCleared())
    assert events.decode_sequence(kv_events.ZmqEventPublisher.END_SEQ) == events.REPLAY_END
    with pytest.raises(events.BadEventPayload):
        events.decode_batch(encoder.encode(stored))  # an event, not a batch


def test_a_block_pools_real_events_drive_the_index(none_hash_of):
    """vLLM's block pool caches a salted prompt, evicts it for another, and resets: the index follows each step,
    and scores each prompt by our own hashes of its tokens."""
    fn = none_hash_of("sha256", None)
    bs = 16
    scheme = hashing.HashScheme(block_size=bs)
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=bs, enable_kv_cache_events=True)
    index = KvIndex(scheme)
    encoder = msgspec.msgpack.Encoder()
    seq = 0

    def publish():
        nonlocal seq
        payload = encoder.encode(kv_events.KVEventBatch(ts=float(seq), events=pool.take_events()))
        assert index.apply("p1", seq, events.decode_batch(payload)) == Outcome.APPLIED
        seq += 1

    rng = random.Random(7)
    a = [rng.randrange(50_000) for _ in range(4 * bs + 5)]
    b = [rng.randrange(50_000) for _ in range(5 * bs)]
    req_a = request(a, fn, bs, SALT)
    blocks_a = pool.get_new_blocks(5)
    pool.cache_full_blocks(req_a, blocks_a, 0, 4, bs, 0)
    publish()
    assert index.cached_prefix_tokens("p1", scheme.hashes(a, salt=SALT)) == 4 * bs
    assert index.cached_prefix_tokens("p1", scheme.hashes(a)) == 0  # unsalted: another tenant's prompt
    assert index.cached_prefix_tokens("p1", scheme.hashes(a[:2 * bs] + b, salt=SALT)) == 2 * bs
    assert index.stale_reason("p1") == ""  # its first block hashed alike here

    pool.free_blocks(reversed(blocks_a))  # tail first, as vLLM frees a request's blocks
    req_b = request(b, fn, bs)
    blocks_b = pool.get_new_blocks(5)  # the pool has 5 usable blocks: every cached block of A is evicted
    pool.cache_full_blocks(req_b, blocks_b, 0, 5, bs, 0)
    publish()
    assert index.cached_prefix_tokens("p1", scheme.hashes(a, salt=SALT)) == 0
    assert index.cached_prefix_tokens("p1", scheme.hashes(b)) == 5 * bs and index.blocks("p1") == 5

    pool.free_blocks(reversed(blocks_b))
    assert pool.reset_prefix_cache()
    publish()
    assert index.blocks("p1") == 0 and index.total_blocks == 0
    assert json.dumps(index.best(["p1"], scheme.hashes(b))) == '[["p1", 0]]'



leaves = (st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.binary(max_size=40)
          | st.text(max_size=40))


@settings(max_examples=300)
@given(st.recursive(leaves, lambda inner: st.lists(inner, max_size=8) | st.lists(inner, max_size=8).map(tuple),
                    max_leaves=40))
def test_our_cbor_is_cbor2s_canonical_encoding(value):
    assert cbor.dumps(value) == cbor2.dumps(value, canonical=True)  # what vLLM's sha256_cbor serializes with
