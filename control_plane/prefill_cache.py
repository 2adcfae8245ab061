"""What a prefill worker probably still holds in its own prefix cache for a session (pure).

vLLM's prefix cache keeps the blocks of prompts it computed. When a session's next turn goes to the prefill worker
that prefilled its last turn, that worker still holds (unless evicted, or prefix caching is off) the previous prompt's
whole blocks, as far as the new prompt matches them: recomputing then costs only the rest, and a pull loads only the
rest. The scheduler notes which worker prefilled each session and how many tokens, and learns per worker how far
to trust that (a worker without prefix caching, or one that evicts a lot, hits less than noted): after each
recompute it compares the hit it estimated with the hit the worker reported.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Noted:
    worker_id: str
    prompt_tokens: int


class PrefillCacheHints:
    def __init__(self, max_sessions: int = 100_000, learning_rate: float = 0.3, initial_trust: float = 1.0):
        if max_sessions < 1 or not 0 < learning_rate <= 1 or not 0 <= initial_trust <= 1:
            raise ValueError("max_sessions >= 1, learning_rate in (0, 1], initial_trust in [0, 1]")
        self._noted: OrderedDict[Hashable, _Noted] = OrderedDict()
        self.max_sessions = max_sessions
        self.learning_rate = learning_rate
        self.initial_trust = initial_trust
        self.trust: dict[str, float] = {}  # per worker: the share of the estimated hit that it really had

    def note(self, session: Hashable, worker_id: str, prompt_tokens: int) -> None:
        """``worker_id`` prefills ``prompt_tokens`` tokens of ``session`` now."""
        self._noted[session] = _Noted(worker_id, prompt_tokens)
        self._noted.move_to_end(session)
        while len(self._noted) > self.max_sessions:
            self._noted.popitem(last=False)

    def worker_of(self, session: Hashable | None) -> str | None:
        """The prefill worker that prefilled ``session``'s last turn (None: not noted)."""
        noted = self._noted.get(session) if session is not None else None
        return noted.worker_id if noted else None

    def estimate(self, session: Hashable | None, worker_id: str, *, matched_tokens: int, prompt_tokens: int,
                 block_size: int) -> int:
        """Tokens of the new prompt ``worker_id`` likely holds: the last prompt it prefilled for ``session``, as far
        as the new prompt provably matches it (``matched_tokens``), in whole blocks, scaled by the learned trust."""
        noted = self._noted.get(session) if session is not None else None
        if noted is None or noted.worker_id != worker_id or block_size <= 0:
            return 0
        reach = min(noted.prompt_tokens, matched_tokens, prompt_tokens - 1)  # P always computes the last token
        blocks = (reach // block_size) * block_size
        return int(blocks * self.trust.get(worker_id, self.initial_trust))

    def observe(self, worker_id: str, *, estimated: int, actual: int) -> None:
        """A recompute on ``worker_id`` for which ``estimated`` cached tokens were predicted hit ``actual``."""
        if estimated <= 0:
            return
        trust = self.trust.get(worker_id, self.initial_trust)
        seen = max(0.0, min(1.0, actual / estimated))
        self.trust[worker_id] = trust + self.learning_rate * (seen - trust)
