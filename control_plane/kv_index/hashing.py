"""vLLM's prefix-cache block hashes, computed here byte for byte as vLLM 0.32 does (pure; vLLM is not imported).

What vLLM does (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``), and so what this module does:

- Only *full* blocks are hashed; a prompt's last partial block has no hash and is never a prefix-cache hit.
- Block ``i``'s hash is ``H((parent, tuple(block_token_ids), extra_keys))`` where ``parent`` is block ``i-1``'s hash,
  or ``NONE_HASH`` for the first block: a hash names the whole prefix up to the end of its block.
- ``NONE_HASH = H(seed)``: the seed is ``PYTHONHASHSEED`` of vLLM's engine process when set, else the fixed string
  ``"vllm-none-hash"`` for the sha256 algorithms (xxhash ones then get a random per-process seed, which nobody
  outside the process can reproduce: not supported here). Workers therefore pin it: ``--prefix-hash-seed``
  (workers/vllm_process.py) sets or removes ``PYTHONHASHSEED`` for vLLM, and :class:`HashScheme` ``seed`` must be
  the same value (None: removed, vLLM's default seed).
- ``extra_keys`` is None, or a tuple of tagged keys in this order: ``("lora", name, path)`` on every block of a
  LoRA request, multimodal keys (not supported here: kvshuttle's salted prompts are token ids only), then
  ``("cache_salt", salt)`` on the *first block only* (start token 0, and only for a non-empty salt). A salt thus
  changes every later hash through the chain: two tenants never share a block.
- ``H`` is ``--prefix-caching-hash-algo`` (default ``sha256``): ``sha256`` = SHA-256 of
  ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` (the same Python minor version on both sides: pickle's
  highest protocol is the interpreter's), ``sha256_cbor`` = SHA-256 of canonical CBOR (:mod:`.cbor`, portable).
- The block size that hashes are taken at is the KV block size of a model with one KV-cache group (vLLM's
  ``hash_block_size``; 128 by default on CPU). With several groups vLLM hashes at their gcd and a coarser block's
  hash is the last fine hash inside it: pass the fine size and take every n-th hash.
- KV events publish each hash as the low 64 bits of the digest, big-endian, as an int
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default on), or the raw digest bytes: :func:`event_hash`.

tests/slow/test_kv_index_vllm.py checks all of this against the installed vLLM's own functions.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvshuttle.control_plane.kv_index import cbor

ALGOS = ("sha256", "sha256_cbor")  # the --prefix-caching-hash-algo values reproducible outside vLLM
DEFAULT_ALGO = "sha256"  # vLLM 0.32's default
DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for sha256 algorithms when PYTHONHASHSEED is unset

EventHash = int | bytes  # a block hash as KV events carry it


class UnsupportedHashAlgo(ValueError):
    """A hash algorithm whose hashes cannot be reproduced here (xxhash ones: random seed, extra dependency)."""


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor.dumps(obj)).digest()


_HASHERS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def _hasher(algo: str):
    try:
        return _HASHERS[algo]
    except KeyError:
        raise UnsupportedHashAlgo(f"prefix-cache hash algorithm {algo!r} is not one of {list(ALGOS)}") from None


@functools.lru_cache(maxsize=16)
def none_hash(algo: str = DEFAULT_ALGO, seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``: the parent of every prompt's first block (``seed`` None: vLLM's default seed)."""
    return _hasher(algo)(DEFAULT_SEED if seed is None else seed)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "", algo: str = DEFAULT_ALGO,
                 seed: str | None = None, lora: tuple[str, str] | None = None) -> list[bytes]:
    """vLLM's hash of every full block of ``token_ids``, in order (``lora``: the request's (name, path))."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hasher = _hasher(algo)
    parent = none_hash(algo, seed)
    lora_keys: tuple[tuple[str, ...], ...] = (("lora", lora[0], lora[1]),) if lora else ()
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = lora_keys + ((("cache_salt", salt),) if start == 0 and salt else ())
        parent = hasher((parent, tuple(token_ids[start:start + block_size]), keys or None))
        out.append(parent)
    return out


def event_hash(block_hash: bytes, int_hashes: bool = True) -> EventHash:
    """A block hash as vLLM's KV events publish it: its low 64 bits as an unsigned int, or the digest itself."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF if int_hashes else block_hash


@dataclass(frozen=True)
class HashScheme:
    """How one fleet of workers hashes prompt blocks; must match their vLLM settings (a worker's
    ``prefix_hash_scheme``): block size, ``--prefix-caching-hash-algo``, ``PYTHONHASHSEED`` (None: unset) and
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""

    block_size: int
    algo: str = DEFAULT_ALGO
    seed: str | None = None
    int_hashes: bool = True

    def __post_init__(self) -> None:
        _hasher(self.algo)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def hashes(self, token_ids: Sequence[int], salt: str = "",
               lora: tuple[str, str] | None = None) -> list[EventHash]:
        """The prompt's full-block hashes as the workers' KV events name them (what the index is keyed by);
        ``lora``: the (name, path) of the adapter the prompt runs under, as the worker loaded it."""
        return [event_hash(h, self.int_hashes)
                for h in block_hashes(token_ids, self.block_size, salt, self.algo, self.seed, lora)]
