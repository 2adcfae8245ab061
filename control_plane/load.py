"""A worker's live load, as its vLLM engine reports it (``GetLoads``), plus what was sent to it since (pure).

The scheduler polls each engine off the request path; between two polls it counts the turns it assigned to the worker
itself (``pending``), so a burst of turns does not all land on the worker that looked idle at the last poll.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    # KV cache tokens in use and the engine's capacity (0: unknown).
    used_tokens: int = 0
    capacity_tokens: int = 0
    # Prompt tokens of waiting requests that the engine must still compute.
    waiting_uncached_tokens: int = 0
    cache_hit_rate: float = 0.0
    # Turns assigned to this worker by this scheduler since the sample was taken, and their prompt tokens.
    pending: int = 0
    pending_tokens: int = 0
    # Seconds since the sample was taken; False when the last polls failed (the worker may be gone or hung).
    age_s: float = 0.0
    reachable: bool = True

    @property
    def queued(self) -> int:
        """Requests ahead of a new one: running, waiting, and assigned since the sample."""
        return self.running + self.waiting + self.pending

    @property
    def free_tokens(self) -> int | None:
        """KV tokens still free, less what pending turns will take; None when the capacity is unknown."""
        if self.capacity_tokens <= 0:
            return None
        return max(0, self.capacity_tokens - self.used_tokens - self.pending_tokens)

    @property
    def usage(self) -> float:
        """Fraction of the KV cache in use, counting pending turns (0 when the capacity is unknown)."""
        if self.capacity_tokens <= 0:
            return 0.0
        return min(1.0, (self.used_tokens + self.pending_tokens) / self.capacity_tokens)


def parse_get_loads(loads: Mapping[str, Any]) -> WorkerLoad:
    """vLLM's ``GetLoadsResponse`` as a dict (snake_case keys) → one load summed over its data-parallel ranks."""
    ranks = list(loads.get("loads") or [])

    def total(key: str) -> int:
        return sum(int(r.get(key) or 0) for r in ranks)

    hit_rates = [float(r.get("cache_hit_rate") or 0.0) for r in ranks]
    return WorkerLoad(
        running=total("num_running_reqs"), waiting=total("num_waiting_reqs"),
        used_tokens=total("num_used_tokens"), capacity_tokens=total("max_total_num_tokens"),
        waiting_uncached_tokens=total("num_waiting_uncached_tokens"),
        cache_hit_rate=sum(hit_rates) / len(hit_rates) if hit_rates else 0.0,
    )


def smoothed(latest: WorkerLoad, previous: WorkerLoad | None) -> WorkerLoad:
    """The latest sample, with its queue no shorter than the previous sample's: vLLM reports its scheduler's
    numbers after the last engine step, and a busy engine between two requests (one finished, the next not yet
    scheduled) can show an empty queue for one sample. Taking the larger of two consecutive samples keeps a busy
    worker busy in the planner's eyes; an idle one shows idle one sample later."""
    if previous is None:
        return latest
    return replace(latest, running=max(latest.running, previous.running),
                   waiting=max(latest.waiting, previous.waiting),
                   waiting_uncached_tokens=max(latest.waiting_uncached_tokens, previous.waiting_uncached_tokens))
