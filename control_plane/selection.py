"""Choosing the prefill and decode workers for a turn (round-robin for now; a cost model comes later)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Generic, Protocol, TypeVar


class HasId(Protocol):
    worker_id: str


W = TypeVar("W", bound=HasId)


class RoundRobin(Generic[W]):
    """Cycles through candidates in worker-id order, skipping excluded ones; stable as workers come and go."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[W], exclude: Collection[str] = ()) -> W | None:
        pool = sorted((w for w in candidates if w.worker_id not in exclude), key=lambda w: w.worker_id)
        if not pool:
            return None
        return pool[next(self._counter) % len(pool)]
