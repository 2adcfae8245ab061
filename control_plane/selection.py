"""Choosing the prefill and decode workers for a turn (pure).

Two selectors, by name (``SELECTORS``):

- ``load`` (default): P is the worker with the lowest predicted time to the first token, i.e. its predicted prefill
  time for this turn times (1 + the requests ahead of it); D is the worker with the most free KV cache (so sessions
  spread over the decode workers instead of piling onto one), then the fewest requests. Workers whose load polls
  fail are used only when no other is left. Equal scores rotate, so an idle fleet is used round-robin.
- ``round_robin``: cycles through the live workers in id order (ignores load).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvshuttle.control_plane.load import WorkerLoad


class HasId(Protocol):
    worker_id: str


W = TypeVar("W", bound=HasId)
UNKNOWN = WorkerLoad()


@dataclass(frozen=True)
class Pick(Generic[W]):
    worker: W
    # Predicted milliseconds until this worker would start and finish the turn's prefill (P), or KV usage (D).
    score: float
    why: str


class RoundRobin(Generic[W]):
    """Cycles through candidates in worker-id order, skipping excluded ones; stable as workers come and go."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[W], exclude: Collection[str] = ()) -> W | None:
        pool = sorted((w for w in candidates if w.worker_id not in exclude), key=lambda w: w.worker_id)
        if not pool:
            return None
        return pool[next(self._counter) % len(pool)]


class _Rotating:
    """argmin with ties (within ``tolerance``, relative) broken round-robin, after the reachable/unreachable split."""

    def __init__(self, tolerance: float = 0.05):
        self._counter = itertools.count()
        self.tolerance = tolerance

    def best(self, scored: list[tuple[float, HasId, WorkerLoad]]) -> tuple[float, HasId, WorkerLoad] | None:
        if not scored:
            return None
        reachable = [s for s in scored if s[2].reachable] or scored
        low = min(s[0] for s in reachable)
        ties = sorted((s for s in reachable if s[0] <= low + self.tolerance * max(abs(low), 1e-9)),
                      key=lambda s: s[1].worker_id)
        return ties[next(self._counter) % len(ties)]


class LoadAwareSelector(Generic[W]):
    name = "load"

    def __init__(self) -> None:
        self._prefill, self._decode = _Rotating(), _Rotating()

    def pick_prefill(self, candidates: Sequence[W], loads: Mapping[str, WorkerLoad], exclude: Collection[str] = (),
                     prefill_ms: Callable[[str], float] | None = None) -> Pick[W] | None:
        """``prefill_ms(worker_id)``: the predicted prefill time of this turn on that worker (None: all alike)."""
        scored = []
        for w in candidates:
            if w.worker_id in exclude:
                continue
            load = loads.get(w.worker_id, UNKNOWN)
            service = prefill_ms(w.worker_id) if prefill_ms else 1.0
            scored.append((service * (1 + load.queued), w, load))
        best = self._prefill.best(scored)
        if best is None:
            return None
        score, worker, load = best
        why = (f"prefill {worker.worker_id}: {load.queued} request(s) ahead"
               + (f", predicted {score:.1f} ms to prefill" if prefill_ms else "")
               + ("" if load.reachable else " (load unknown)"))
        return Pick(worker, score, why)

    def pick_decode(self, candidates: Sequence[W], loads: Mapping[str, WorkerLoad],
                    exclude: Collection[str] = ()) -> Pick[W] | None:
        scored = []
        for w in candidates:
            if w.worker_id in exclude:
                continue
            load = loads.get(w.worker_id, UNKNOWN)
            # KV usage first (where the session's history will stay), then queued requests as a small tie-breaker.
            scored.append((load.usage + 0.001 * load.queued, w, load))
        best = self._decode.best(scored)
        if best is None:
            return None
        score, worker, load = best
        free = load.free_tokens
        why = (f"decode {worker.worker_id}: KV {load.usage:.0%} used"
               + (f" ({free} tokens free)" if free is not None else "") + f", {load.queued} request(s)"
               + ("" if load.reachable else " (load unknown)"))
        return Pick(worker, score, why)


class RoundRobinSelector(Generic[W]):
    name = "round_robin"

    def __init__(self) -> None:
        self._prefill, self._decode = RoundRobin(), RoundRobin()

    def pick_prefill(self, candidates: Sequence[W], loads: Mapping[str, WorkerLoad], exclude: Collection[str] = (),
                     prefill_ms: Callable[[str], float] | None = None) -> Pick[W] | None:
        worker = self._prefill.pick(candidates, exclude)
        return Pick(worker, 0.0, f"prefill {worker.worker_id}: round robin") if worker else None

    def pick_decode(self, candidates: Sequence[W], loads: Mapping[str, WorkerLoad],
                    exclude: Collection[str] = ()) -> Pick[W] | None:
        worker = self._decode.pick(candidates, exclude)
        return Pick(worker, 0.0, f"decode {worker.worker_id}: round robin") if worker else None


Selector = LoadAwareSelector | RoundRobinSelector
SELECTORS: dict[str, type] = {LoadAwareSelector.name: LoadAwareSelector, RoundRobinSelector.name: RoundRobinSelector}


def make_selector(name: str) -> Selector:
    if name not in SELECTORS:
        raise ValueError(f"unknown worker selector {name!r}; choose one of {', '.join(SELECTORS)}")
    return SELECTORS[name]()
