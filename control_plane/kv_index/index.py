"""Which prompt blocks each prefill worker holds in its prefix cache, learnt from its KV events (pure).

One view per worker: the set of block hashes (as the events name them, :mod:`.hashing`) that its engine reported
stored and not yet removed, bounded and least-recently-stored out first. A prompt's cached prefix on a worker is
its longest run of leading full-block hashes in that view (vLLM's own prefix lookup stops at the first miss too),
times the block size: :meth:`KvIndex.cached_prefix_tokens`; :meth:`KvIndex.best` ranks workers by it.

The view is only worth trusting while the worker's batches arrive in order, so :meth:`KvIndex.apply` checks each
batch's sequence number (numbered 0, 1, 2... by each vLLM publisher process):

- the first batch seen (or the first after :meth:`KvIndex.resync`) is taken whatever its number: blocks stored
  before it are unknown, so the view can only *under*-state what the worker holds;
- the next number: applied;
- a later one: a gap. Not applied; the worker is stale (scores 0) until the batches from
  :meth:`KvIndex.expected_seq` on are applied (from vLLM's replay socket), or the caller gives up and calls
  :meth:`KvIndex.resync` (the view is emptied and starts again: under-stating, never over-stating);
- an earlier one: a duplicate (a replay overlapping the live stream: ignored) when its ``ts`` is not newer than the
  last applied batch's; otherwise the engine restarted (new process, numbering from 0, empty cache): the view is
  emptied and the batch applied. A restart whose first batches are all lost looks like a duplicate: a worker that
  re-registers should be :meth:`KvIndex.forget`-ten by the caller.

A view is also distrusted (stale until resync or forget) on an event type this code does not know, on a stored
block of another block size, and when a prompt's first stored block does not hash here as the worker reported it
(another ``--prefix-caching-hash-algo`` or seed on that worker: every score would be 0 anyway, now it says why).
Only the engine's own cache counts (medium ``GPU``, KV-cache group 0); offload tiers and other groups are skipped.

Bounds: ``max_blocks_per_worker`` and ``max_blocks_total``; past either, the least recently stored block of that
worker (for the total: of the worker holding most) is dropped. Dropping only under-states. vLLM re-sends a
``BlockStored`` for the cached blocks a request reuses, so a used prefix stays recent; within one event the blocks
are taken last-to-first so that a chain's head is the last of it to go (vLLM frees a request's blocks tail first
for the same reason). Size the bounds at or above the workers' KV capacity in blocks and this rarely drops anything.

What this takes from the peers (ideas, not code): llm-d's kv-cache indexer (llm-d/llm-d-kv-cache: kvevents pool,
kvblock index, token processor) keys blocks by the engine's own hashes from the events, rebuilds the same hashes
for a prompt with a configured block size and ``PYTHONHASHSEED``-aligned seed, scores pods by the longest run of
leading block hits, and keeps the index LRU-bounded; from it also the check that the engine's hashes and ours
agree, done here on each prompt's first block. NVIDIA Dynamo's KV router (ai-dynamo/dynamo, lib/kv-router's
radix tree) applies Stored/Removed/Cleared per worker in event order, treats engine hashes as opaque ids, detects
event-id gaps and recovers by asking the worker again; kvshuttle has a few prefill workers, so a per-worker hash set
walked per worker replaces the shared radix tree. SMG's cache-aware policy (lightseekorg/smg) bounds its
approximate tree by size, and its users found the bound must hold at every insert, not on a periodic sweep: here
every store enforces both bounds at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from kvshuttle.control_plane.kv_index.events import (
    MEDIUM_ENGINE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
)
from kvshuttle.control_plane.kv_index.hashing import EventHash, HashScheme, block_hashes, event_hash


class Outcome(StrEnum):
    APPLIED = "applied"
    GAP = "gap"  # not applied: batches are missing before it (stale until they are applied, or resync)
    DUPLICATE = "duplicate"  # already applied: ignored
    RESTARTED = "restarted"  # the engine restarted: view emptied, batch applied


class Match(NamedTuple):
    worker_id: str
    cached_tokens: int


@dataclass
class _View:
    blocks: OrderedDict[EventHash, None] = field(default_factory=OrderedDict)
    next_seq: int | None = None  # None: take whatever comes next
    highest_seq: int = -1  # the highest sequence number seen, applied or not
    last_ts: float = float("-inf")
    distrust: str = ""  # a reason that only resync/forget clears

    def stale_reason(self) -> str:
        if self.distrust:
            return self.distrust
        if self.next_seq is not None and self.highest_seq >= self.next_seq:
            return f"missed batches from seq {self.next_seq} (seen up to {self.highest_seq})"
        return ""


class KvIndex:
    def __init__(self, scheme: HashScheme, max_blocks_per_worker: int = 1_000_000,
                 max_blocks_total: int = 4_000_000):
        if max_blocks_per_worker < 1 or max_blocks_total < 1:
            raise ValueError("max_blocks_per_worker and max_blocks_total must be >= 1")
        self.scheme = scheme
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_blocks_total = max_blocks_total
        self._views: dict[str, _View] = {}
        self._total = 0

    # -- events ------------------------------------------------------------------------------------------------

    def apply(self, worker_id: str, seq: int, batch: EventBatch) -> Outcome:
        """Apply the worker's batch number ``seq`` (see the module docstring for the order rules)."""
        view = self._views.setdefault(worker_id, _View())
        view.highest_seq = max(view.highest_seq, seq)
        outcome = Outcome.APPLIED
        if view.next_seq is not None and seq != view.next_seq:
            if seq > view.next_seq:
                return Outcome.GAP
            if batch.ts <= view.last_ts:
                return Outcome.DUPLICATE
            self._clear(view)
            view.highest_seq = seq
            outcome = Outcome.RESTARTED
        for event in batch.events:
            self._apply_event(view, event)
        view.next_seq = seq + 1
        view.last_ts = batch.ts
        return outcome

    def _apply_event(self, view: _View, event: object) -> None:
        if isinstance(event, BlockStored):
            if not self._counts(event.medium, event.group_idx):
                return
            if event.block_size != self.scheme.block_size:
                view.distrust = f"stored blocks of {event.block_size} tokens, the index hashes {self.scheme.block_size}"
                return
            wanted = int if self.scheme.int_hashes else bytes
            hashes = event.block_hashes
            # one worker's hashes are all of one kind: its first and last tell (a per-hash check costs as much as
            # storing them)
            if hashes and not (isinstance(hashes[0], wanted) and isinstance(hashes[-1], wanted)):
                view.distrust = (f"block hashes are not {wanted.__name__}s: the worker's "
                                 "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES differs from the index's int_hashes")
                return
            if not view.distrust and _first_block_mismatch(self.scheme, event):
                view.distrust = ("a prompt's first block hashes differently here: the worker's prefix-caching hash "
                                 "algorithm or seed differs from the index's")
            self._store(view, hashes)
        elif isinstance(event, BlockRemoved):
            if self._counts(event.medium, event.group_idx):
                blocks, gone = view.blocks, 0
                for h in event.block_hashes:
                    if blocks.pop(h, 0) is None:
                        gone += 1
                self._total -= gone
        elif isinstance(event, AllBlocksCleared):
            self._clear(view)
        elif isinstance(event, UnknownEvent):
            view.distrust = f"unknown KV event type {event.kind!r}"

    @staticmethod
    def _counts(medium: str | None, group_idx: int | None) -> bool:
        return medium in (None, MEDIUM_ENGINE) and group_idx in (None, 0)

    def _store(self, view: _View, hashes: Sequence[EventHash]) -> None:
        """Store a chain's blocks last to first (its head ends most recent), then enforce both bounds."""
        blocks = view.blocks
        before = len(blocks)
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self._total += len(blocks) - before
        while len(view.blocks) > self.max_blocks_per_worker:
            view.blocks.popitem(last=False)
            self._total -= 1
        while self._total > self.max_blocks_total:
            largest = max(self._views.values(), key=lambda v: len(v.blocks))
            largest.blocks.popitem(last=False)
            self._total -= 1

    def _clear(self, view: _View) -> None:
        self._total -= len(view.blocks)
        view.blocks.clear()

    def resync(self, worker_id: str) -> None:
        """Start the worker's view afresh (empty, trusted, taking whatever batch comes next): after a gap that
        replay could not fill, or when the caller knows the engine restarted."""
        view = self._views.get(worker_id)
        if view is not None:
            self._clear(view)
        self._views[worker_id] = _View()

    def forget(self, worker_id: str) -> None:
        """The worker left: drop its view."""
        view = self._views.pop(worker_id, None)
        if view is not None:
            self._total -= len(view.blocks)

    # -- state -------------------------------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        return list(self._views)

    @property
    def total_blocks(self) -> int:
        return self._total

    def blocks(self, worker_id: str) -> int:
        view = self._views.get(worker_id)
        return len(view.blocks) if view else 0

    def held(self, worker_id: str) -> list[EventHash]:
        """The worker's block hashes, least recently stored first (a snapshot of its view)."""
        view = self._views.get(worker_id)
        return list(view.blocks) if view else []

    def holds(self, worker_id: str, h: EventHash) -> bool:
        view = self._views.get(worker_id)
        return view is not None and h in view.blocks

    def expected_seq(self, worker_id: str) -> int | None:
        """The sequence number the worker's next batch must have (None: any; unknown worker: None)."""
        view = self._views.get(worker_id)
        return view.next_seq if view else None

    def stale_reason(self, worker_id: str) -> str:
        """Why the worker's view is not trusted now ('' when it is, or the worker is unknown)."""
        view = self._views.get(worker_id)
        return view.stale_reason() if view else ""

    # -- queries -----------------------------------------------------------------------------------------------

    def cached_prefix_tokens(self, worker_id: str, hashes: Sequence[EventHash], allow_stale: bool = False) -> int:
        """Tokens of the prompt (its full-block ``hashes``, :meth:`HashScheme.hashes`) the worker holds from the
        start on; 0 for an unknown worker and, unless ``allow_stale``, a stale one."""
        view = self._views.get(worker_id)
        if view is None or (not allow_stale and view.stale_reason()):
            return 0
        held = view.blocks
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * self.scheme.block_size

    def best(self, workers: Iterable[str], hashes: Sequence[EventHash]) -> list[Match]:
        """``workers`` by cached prefix tokens, most first; ties keep the given order (pass them load-sorted)."""
        matches = [Match(w, self.cached_prefix_tokens(w, hashes)) for w in workers]
        return sorted(matches, key=lambda m: -m.cached_tokens)


def _first_block_mismatch(scheme: HashScheme, event: BlockStored) -> bool:
    """True when ``event`` stores a prompt's first block (no parent), with no LoRA and at most a salt as its extra
    key, and that block's hash computed here differs from the one the worker reported."""
    if event.parent_block_hash is not None or event.lora_name is not None or not event.block_hashes:
        return False
    if len(event.token_ids) < event.block_size:
        return False
    keys = event.extra_keys[0] if event.extra_keys else None
    if keys is None:
        salt = ""
    elif isinstance(keys, tuple) and len(keys) == 1 and isinstance(keys[0], str) and keys[0]:
        salt = keys[0]
    else:
        return False  # multimodal or other keys: cannot tell
    ours = block_hashes(event.token_ids[:scheme.block_size], scheme.block_size, salt, scheme.algo, scheme.seed)[0]
    return event_hash(ours, scheme.int_hashes) != event.block_hashes[0]
