"""Following the KV feed into a :class:`~.index.KvIndex`, worker by worker (pure).

The feed (``protos/kvshuttle/v1/kv_feed.proto``) carries each prefill worker's cache changes as its agent publishes
them: numbered ``seq`` 0, 1, 2... within an ``epoch`` (one agent start; the agent's first batch of an epoch starts
from an emptied view, so seq 0 is a full account). Each agent also keeps a snapshot of its worker's whole view,
refreshed every few seconds: the blocks it holds as of some ``seq``.

A reader that joins late, or misses entries (the feed is bounded), cannot know what it missed; it asks for the
worker's snapshot. Meanwhile it keeps going with what it has: the view restarts empty and takes the entries as they
come (under-stating what the worker holds, never over-stating), and the entries since the break are kept (bounded)
so that a snapshot at least as new as the break, plus those entries after it, rebuild the view exactly.

Rules, per worker:

- a new epoch (or the first entry seen): the view is dropped; seq 0 is applied as a full account, a later seq starts
  an under-stating view and asks for a snapshot;
- the expected seq: applied; an earlier one: a duplicate, ignored; a later one: a break (as above);
- a snapshot of the current epoch whose seq is at or past the break, minus one: the view becomes the snapshot plus
  the kept entries after it; an older snapshot waits for the next one; one of another epoch is ignored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvshuttle.control_plane.kv_index.events import EventBatch
from kvshuttle.control_plane.kv_index.index import KvIndex


@dataclass
class _Follow:
    epoch: int
    next_seq: int
    kept: deque[tuple[int, EventBatch]] | None = None  # entries since a break, while a snapshot is awaited
    dropped: int = 0  # kept entries dropped (the bound): a snapshot must reach past them


@dataclass
class FeedStats:
    applied: int = 0
    duplicates: int = 0
    breaks: int = 0  # joins mid-epoch and gaps
    resyncs: int = 0  # snapshots applied
    stale_snapshots: int = 0  # snapshots too old to close a break
    epochs: int = 0  # new epochs seen (agent starts)


class FeedFollower:
    """``on_entry`` / ``on_snapshot`` / ``forget`` over one :class:`KvIndex`; ``waiting()`` names the workers whose
    view awaits a snapshot. ``max_kept``: entries kept per worker while waiting."""

    def __init__(self, index: KvIndex, max_kept: int = 4096):
        if max_kept < 1:
            raise ValueError("max_kept must be >= 1")
        self.index = index
        self.max_kept = max_kept
        self._follows: dict[str, _Follow] = {}
        self.stats = FeedStats()

    def on_entry(self, worker_id: str, epoch: int, seq: int, batch: EventBatch) -> bool:
        """Apply one feed entry; True when the worker's view now awaits a snapshot."""
        follow = self._follows.get(worker_id)
        if follow is not None and epoch < follow.epoch:
            return follow.kept is not None  # a late entry of an older epoch: ignored
        if follow is None or epoch > follow.epoch:
            self.index.forget(worker_id)
            self.stats.epochs += 1
            follow = self._follows[worker_id] = _Follow(epoch, 0)
            if seq != 0:
                self._break(worker_id, follow, seq)
            self._apply(worker_id, follow, seq, batch)
            return follow.kept is not None
        if seq < follow.next_seq:
            self.stats.duplicates += 1
            return follow.kept is not None
        if seq > follow.next_seq:
            self._break(worker_id, follow, seq)
        self._apply(worker_id, follow, seq, batch)
        return follow.kept is not None

    def _break(self, worker_id: str, follow: _Follow, seq: int) -> None:
        """Entries before ``seq`` are missing: restart the view empty (under-stating) and keep what follows."""
        self.stats.breaks += 1
        self.index.resync(worker_id)
        if follow.kept is None:
            follow.kept, follow.dropped = deque(), 0
        else:  # a second break while waiting: what was kept before it can no longer be replayed in order
            follow.kept.clear()
        follow.next_seq = seq

    def _apply(self, worker_id: str, follow: _Follow, seq: int, batch: EventBatch) -> None:
        self.index.apply(worker_id, seq, batch)
        follow.next_seq = seq + 1
        self.stats.applied += 1
        if follow.kept is not None:
            follow.kept.append((seq, batch))
            if len(follow.kept) > self.max_kept:
                follow.kept.popleft()
                follow.dropped += 1

    def on_snapshot(self, worker_id: str, epoch: int, seq: int, batch: EventBatch) -> bool:
        """A snapshot of the worker's whole view as of its entry ``seq`` (``batch`` empties and refills the view);
        True when it was applied. Taken for a worker not seen yet (a reader starting from snapshots) and for one
        awaiting a snapshot, when it reaches the break."""
        follow = self._follows.get(worker_id)
        if follow is not None and epoch < follow.epoch:
            return False
        if follow is None or epoch > follow.epoch:
            self.index.forget(worker_id)
            follow = self._follows[worker_id] = _Follow(epoch, seq + 1)
            self.index.apply(worker_id, seq, batch)
            self.stats.resyncs += 1
            return True
        if follow.kept is None:
            return False  # the view is whole already
        first = follow.kept[0][0] if follow.kept else follow.next_seq
        if seq + 1 < first:
            self.stats.stale_snapshots += 1
            return False
        kept = [(s, b) for s, b in follow.kept if s > seq]
        self.index.resync(worker_id)
        self.index.apply(worker_id, seq, batch)
        follow.next_seq = seq + 1
        follow.kept = None
        for s, b in kept:
            self._apply(worker_id, follow, s, b)
        self.stats.resyncs += 1
        return True

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self._follows.pop(worker_id, None)
        self.index.forget(worker_id)

    def waiting(self) -> list[str]:
        """Workers whose view awaits a snapshot."""
        return [w for w, f in self._follows.items() if f.kept is not None]

    def followed(self, worker_id: str) -> bool:
        """Whether the feed has told anything of the worker (its view may be partial: see :meth:`waiting`)."""
        return worker_id in self._follows
