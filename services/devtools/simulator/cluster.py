"""The simulated fleet: prefill workers (a FIFO queue and a finite prefix cache) and decode workers (a KV cache that
running turns and held handles share).

A prefill worker's prefix cache is an LRU of *units* (``unit`` tokens each, whole units only, as vLLM caches whole
blocks), keyed by a chained hash of their content, so two prompts that share a prefix share its units. The fleet
keeps one index from a unit to the workers that hold it: the cache-aware router reads it (it stands for the
router's own approximate tree, exact here, which flatters that router).

A prefill node can extend its prefix cache with a CPU tier (:class:`CpuTier`: the ``cache_aware_offload`` deployment,
vLLM's OffloadingConnector / LMCache as llm-d deploys them): a unit evicted from the GPU cache moves there, and a later
prompt that continues into it restores it instead of recomputing it. A decode worker can keep a prefix cache of its
own (:class:`DecodePrefixCache`: vLLM's prefix cache on D, which keeps a finished turn's blocks until it needs the
room), which a turn prefilled on D itself reuses and a hand-off from P does not re-send.

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


class CpuTier:
    """A prefill node's CPU tier of the prefix cache: an LRU of units in host memory (``capacity_units``). A unit
    evicted from the node's GPU cache moves here; one restored to the GPU (a later prompt continues into it) or
    recomputed there leaves it (an exclusive tier: it never holds what the GPU holds, so the two add up; vLLM's
    OffloadingConnector actually stores blocks as they are computed, so its CPU tier also duplicates the GPU's: this
    model gives the tier the benefit of the doubt). ``index``: the fleet's unit -> nodes whose CPU tier holds it."""

    __slots__ = ("worker_id", "capacity_units", "units", "index")

    def __init__(self, worker_id: str, capacity_units: int, index: dict[int, set[str]]):
        self.worker_id, self.capacity_units, self.index = worker_id, capacity_units, index
        self.units: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.units

    def put(self, key: int) -> None:
        """``key`` evicted from the GPU: kept here (most recent), the least recent ones dropped past capacity."""
        if self.capacity_units <= 0:
            return
        if key in self.units:
            self.units.move_to_end(key)
            return
        self.units[key] = None
        self.index.setdefault(key, set()).add(self.worker_id)
        while len(self.units) > self.capacity_units:
            self._forget(self.units.popitem(last=False)[0])

    def take(self, key: int) -> bool:
        """``key`` leaves the tier (restored to the GPU, or computed there again); whether it was here."""
        if key not in self.units:
            return False
        del self.units[key]
        self._forget(key)
        return True

    def _forget(self, key: int) -> None:
        holders = self.index.get(key)
        if holders is not None:
            holders.discard(self.worker_id)
            if not holders:
                del self.index[key]


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
    cpu: CpuTier | None = None  # the node's CPU tier (cache_aware_offload)
    pending_tokens: int = 0  # tokens routed here and not prefilled yet, less the cache hits predicted at routing
    running_tokens: int = 0  # the prompt being prefilled now (its KV blocks in use)

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
            if self.cpu is not None:
                self.cpu.take(key)  # computed again on the GPU: the tier holds only what the GPU does not
        removed: list[EventHash] = []
        while len(self.cache) > self.capacity_units:
            gone, gone_hash = self.cache.popitem(last=False)
            if self.cpu is not None:
                self.cpu.put(gone)
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


class DecodePrefixCache:
    """What a decode worker's vLLM prefix cache holds: the whole units of the turns it served (prompt and answer).
    After a turn its blocks stay cached in D's free KV (evictable: not pinned, unlike a held handle), least recently
    used first out as running turns need the room (:meth:`trim` to the free room); a running turn's units are in use
    (reference counts) and not evictable. A turn prefilled on D reuses its cached prefix; a hand-off from P sends only
    what D does not hold (vLLM's NixlConnector reads just the blocks beyond D's local prefix hit)."""

    __slots__ = ("cached", "in_use")

    def __init__(self) -> None:
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.in_use: dict[int, int] = {}

    def held(self, keys: list[int]) -> int:
        """Leading units of ``keys`` D holds (cached or in use by a running turn): a look, no touch."""
        n = 0
        for key in keys:
            if key not in self.cached and key not in self.in_use:
                break
            n += 1
        return n

    def acquire(self, keys: list[int]) -> int:
        """A turn admitted on D uses the leading units of ``keys`` D holds; returns how many (it releases
        ``keys[:n]`` when it ends)."""
        n = self.held(keys)
        for key in keys[:n]:
            self.cached.pop(key, None)
            self.in_use[key] = self.in_use.get(key, 0) + 1
        return n

    def release(self, used: list[int], stored: list[int]) -> None:
        """A turn ended: the units it used are free again, and every whole unit of its prompt and answer
        (``stored``) is cached, most recent."""
        for key in used:
            left = self.in_use[key] - 1
            if left:
                self.in_use[key] = left
            else:
                del self.in_use[key]
        for key in stored:
            if key not in self.in_use:
                self.cached[key] = None
                self.cached.move_to_end(key)

    def trim(self, room_units: int) -> None:
        """Evict the least recently used cached units until at most ``room_units`` remain (D's free KV)."""
        while len(self.cached) > max(0, room_units):
            self.cached.popitem(last=False)


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
    prefix: DecodePrefixCache | None = None  # D's own prefix cache (the deployments that model it)
    local_prefill_tokens: int = 0  # tokens of the turns routed here to be prefilled on D, not prefilled yet

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
