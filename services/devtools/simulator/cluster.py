"""The simulated fleet: prefill workers (a FIFO queue and a finite prefix cache) and decode workers (a KV cache that
running turns and held handles share).

A prefill worker's prefix cache is an LRU of *units* (``unit`` tokens each, whole units only, as vLLM caches whole
blocks), keyed by a chained hash of their content, so two prompts that share a prefix share its units. The fleet
keeps one index from a unit to the workers that hold it: the cache-aware router reads it (it stands for the
router's own approximate tree, exact here, which flatters that router).

A prefill worker can also publish its cache's changes as vLLM's KV events do (:mod:`control_plane.kv_index.events`:
``BlockStored`` for the units a prefill stores or reuses, ``BlockRemoved`` for the units it evicts), one batch per
prefill, numbered 0, 1, 2... with the units' real prefix-cache hashes (:class:`~control_plane.kv_index.hashing.
HashScheme` over the prompt's token ids, blocks of one unit): kvshuttle's planner reads them through a
:class:`~control_plane.kv_index.index.KvIndex`, as the scheduler reads the workers' events.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvshuttle.control_plane.kv_eviction import HeldKv
from kvshuttle.control_plane.kv_index.events import BlockRemoved, BlockStored, EventBatch
from kvshuttle.control_plane.kv_index.hashing import EventHash
from kvshuttle.control_plane.load import WorkerLoad


def token_ids(segments: Iterable[tuple[int, int]]) -> array:
    """The ids of ``segments`` (every token of a segment is its id)."""
    out = array("i")
    for seg, n in segments:
        out.extend(array("i", [seg]) * n)
    return out


class UnitChain:
    """A growing token sequence's unit keys (chained hashes of each whole ``unit`` of tokens)."""

    __slots__ = ("unit", "keys", "_pieces", "_filled", "tokens")

    def __init__(self, unit: int):
        self.unit = unit
        self.keys: list[int] = []
        self._pieces: list[tuple[int, int]] = []
        self._filled = 0
        self.tokens = 0

    def extend(self, seg: int, n: int) -> None:
        self.tokens += n
        while n > 0:
            take = min(n, self.unit - self._filled)
            self._pieces.append((seg, take))
            self._filled += take
            n -= take
            if self._filled == self.unit:
                self.keys.append(hash((self.keys[-1] if self.keys else 0, tuple(self._pieces))))
                self._pieces, self._filled = [], 0

    def copy(self) -> UnitChain:
        out = UnitChain(self.unit)
        out.keys, out._pieces, out._filled, out.tokens = list(self.keys), list(self._pieces), self._filled, self.tokens
        return out


@dataclass(eq=False)
class PrefillWorker:
    worker_id: str
    capacity_units: int
    block_size: int
    index: dict[int, set[str]]  # the fleet's unit -> holders (shared)
    cache: OrderedDict[int, EventHash | None] = field(default_factory=OrderedDict)  # unit -> its event hash
    queue: deque = field(default_factory=deque)
    busy: bool = False
    hits: int = 0
    looked_up: int = 0
    # KV events: called with (worker id, sequence number, batch) after each insert that has hashes
    on_events: Callable[[str, int, EventBatch], object] | None = None
    event_seq: int = 0
    event_block_tokens: int = 0  # the events' block size (the unit)

    def holds_units(self, keys: list[int]) -> int:
        """Leading units of ``keys`` this worker holds (a look, no touch)."""
        n = 0
        for key in keys:
            if key not in self.cache:
                break
            n += 1
        return n

    def cached_units(self, keys: list[int]) -> int:
        """Leading units of ``keys`` this worker holds (touched: they are about to be used)."""
        n = 0
        for key in keys:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            n += 1
        return n

    def insert(self, keys: list[int], hashes: Sequence[EventHash] | None = None) -> None:
        """A prefill's whole units (``keys``) stored or reused; ``hashes``: their prefix-cache hashes (as many),
        published as one batch of KV events when given."""
        for i, key in enumerate(keys):
            if key in self.cache:
                self.cache.move_to_end(key)
                continue
            self.cache[key] = hashes[i] if hashes is not None else None
            self.index.setdefault(key, set()).add(self.worker_id)
        removed: list[EventHash] = []
        while len(self.cache) > self.capacity_units:
            gone, gone_hash = self.cache.popitem(last=False)
            if gone_hash is not None:
                removed.append(gone_hash)
            holders = self.index.get(gone)
            if holders is not None:
                holders.discard(self.worker_id)
                if not holders:
                    del self.index[gone]
        if hashes is not None and self.on_events is not None and (keys or removed):
            events: list = []
            if keys:  # vLLM re-sends BlockStored for the blocks a request reused, too
                events.append(BlockStored(tuple(hashes[:len(keys)]), None, (), self.event_block_tokens, medium="GPU"))
            if removed:
                events.append(BlockRemoved(tuple(removed), medium="GPU"))
            seq, self.event_seq = self.event_seq, self.event_seq + 1
            self.on_events(self.worker_id, seq, EventBatch(float(seq), tuple(events)))

    def load(self, unit: int) -> WorkerLoad:
        return WorkerLoad(running=int(self.busy), waiting=len(self.queue), used_tokens=len(self.cache) * unit,
                          capacity_tokens=self.capacity_units * unit)


@dataclass(eq=False)
class DecodeWorker:
    worker_id: str
    capacity_tokens: int
    block_size: int
    running_tokens: int = 0  # KV of the turns it is decoding
    reserved_tokens: int = 0  # KV of the turns placed here that it has not admitted yet (the planner's "pending")
    held: dict[tuple[str, str], HeldKv] = field(default_factory=dict)  # unspent handles
    held_tokens: int = 0
    pinned: dict[tuple[str, str], HeldKv] = field(default_factory=dict)  # handles a planned pull is about to read
    pinned_tokens: int = 0
    waiting: deque = field(default_factory=deque)  # turns waiting for KV room (FIFO)
    running: int = 0
    peak_tokens: int = 0

    @property
    def used_tokens(self) -> int:
        return self.running_tokens + self.held_tokens + self.pinned_tokens

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def hold(self, h: HeldKv) -> None:
        self.release(h.key)
        self.held[h.key] = h
        self.held_tokens += h.kv_tokens
        self.peak_tokens = max(self.peak_tokens, self.used_tokens)

    def release(self, key: tuple[str, str]) -> HeldKv | None:
        h = self.held.pop(key, None)
        if h is not None:
            self.held_tokens -= h.kv_tokens
        return h

    def pin(self, key: tuple[str, str]) -> HeldKv | None:
        """A planned pull claims the handle: no freeing round may take it (the registry's claim)."""
        h = self.release(key)
        if h is not None:
            self.pinned[key] = h
            self.pinned_tokens += h.kv_tokens
        return h

    def unpin(self, key: tuple[str, str]) -> None:
        """The pull read it: D frees all of a handle's blocks after a read."""
        h = self.pinned.pop(key, None)
        if h is not None:
            self.pinned_tokens -= h.kv_tokens

    def admit(self, tokens: int) -> None:
        self.running_tokens += tokens
        self.running += 1
        self.peak_tokens = max(self.peak_tokens, self.used_tokens)

    def finish(self, tokens: int) -> None:
        self.running_tokens -= tokens
        self.running -= 1

    def load(self) -> WorkerLoad:
        return WorkerLoad(running=self.running, waiting=len(self.waiting), used_tokens=self.used_tokens,
                          capacity_tokens=self.capacity_tokens, pending_tokens=self.reserved_tokens)
