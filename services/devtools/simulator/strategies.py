"""What each simulated deployment does with a turn: where it runs, and whether the history's KV is pulled.

- ``kvshuttle``: the real :class:`~kvshuttle.control_plane.planner.Planner` with the cost policy (it learns from
  the turns the simulator reports), its load-aware selector and each prefill worker's prefix-cache hit as a
  :class:`~kvshuttle.control_plane.kv_index.index.KvIndex` of the workers' KV events says (``prefix_hits``; the
  simulated prefill workers publish them, :mod:`.cluster`), as the scheduler runs it, and the decode-KV capacity
  policy (:mod:`~kvshuttle.control_plane.kv_eviction`: idle, pressure and room, value ranking). A recompute frees
  the session's unused handle (the gateway does).
- ``threshold``: the same planner and selector with vLLM's own rule (pull when at least ``pull_threshold_tokens``
  are reusable), D keeping every handle until its TTL (vLLM's ``decoder_kv_blocks_ttl``), nothing freed early: what
  vLLM's example proxy does, with kvshuttle's routing.
- ``recompute``: the same planner and selector, pulls off; D frees a turn's KV when it ends.
- ``cache_aware``: no pull. P chosen as SMG's / SGLang router's ``cache_aware`` policy does (its defaults:
  ``cache_threshold`` 0.5, ``balance_abs_threshold`` 32, ``balance_rel_threshold`` 1.0001): when the loads are
  imbalanced past both thresholds, the least-loaded P; else the P holding the longest cached prefix if it covers more
  than ``cache_threshold`` of the prompt, else the P with the emptiest cache. D: the less loaded of two at random
  (power of two). D frees a turn's KV when it ends.
- ``cache_aware_pull``: what a user can assemble from SMG and vLLM alone: ``cache_aware``'s choice of P, then
  vLLM's pull rule on that P: pull the session's history from D when the handle is valid and extends into the prompt
  and the pull would load at least ``pull_threshold_tokens`` that P's own prefix cache does not hold; recompute
  otherwise. D keeps every handle until its TTL (vLLM's ``decoder_kv_blocks_ttl``), as with ``threshold``.

At 1,000 workers no router scores every worker per turn: the planner strategies run the planner with ``candidates``
(the scheduler's ``--candidates``): it scores that many workers of each role at random, plus the session's last
prefill worker.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvshuttle.control_plane import reasons
from kvshuttle.control_plane.cost_model import PrefillCostModel, PrefillPrior
from kvshuttle.control_plane.decision import Choice, HandleView, PullPolicy, decide
from kvshuttle.control_plane.kv_index.hashing import HashScheme
from kvshuttle.control_plane.kv_index.index import KvIndex
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.planner import Planner
from kvshuttle.control_plane.policies import CostPolicy, Outcome, ThresholdPolicy
from kvshuttle.control_plane.selection import LoadAwareSelector
from kvshuttle.services.devtools.simulator.cluster import DecodeWorker, PrefillWorker

NAMES = ("kvshuttle", "threshold", "recompute", "cache_aware", "cache_aware_pull")


@dataclass(slots=True)
class Routed:
    prefill: PrefillWorker
    decode: DecodeWorker
    choice: Choice
    code: str
    reusable: int = 0  # tokens a pull loads (PULL)
    pullable: int = 0  # a RECOMPUTE's safe alternative
    cached_estimate: int = 0
    policy: str = ""
    block_hashes: list | None = None  # the prompt's whole units' prefix-cache hashes (strategies that read events)


class Strategy:
    name = ""
    keeps_kv = False  # D holds the turn's KV after it (a handle the next turn may pull)
    manages_kv = False  # kvshuttle's decode-KV capacity policy frees held handles
    frees_unused = False  # a recompute frees the session's unused handle at once
    reads_kv_events = False  # routes by an index of the prefill workers' KV events (needs the prompt's token ids)

    def __init__(self, prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker], rng: random.Random,
                 candidates: int, unit: int):
        self.prefill, self.decode, self.rng, self.candidates, self.unit = list(prefill), list(decode), rng, \
            candidates, unit

    def route(self, session: tuple[str, str], prompt, handle: HandleView | None, source: str,
              unit_keys: list[int]) -> Routed:
        """Where the turn runs and whether it pulls. ``source``: the decode worker holding the session's handle;
        ``unit_keys``: the prompt's whole prefix-cache units (the cache-aware router matches them)."""
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        pass

    @property
    def model(self) -> PrefillCostModel | None:
        return None


class _Loads(Mapping[str, WorkerLoad]):
    """Every worker's load, read when the planner asks (it reads only its candidates')."""

    def __init__(self, prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker], unit: int):
        self._prefill = {w.worker_id: w for w in prefill}
        self._decode = {w.worker_id: w for w in decode}
        self._unit = unit

    def __getitem__(self, worker_id: str) -> WorkerLoad:
        p = self._prefill.get(worker_id)
        if p is not None:
            return p.load(self._unit)
        return self._decode[worker_id].load()

    def __iter__(self) -> Iterator[str]:
        return itertools.chain(self._prefill, self._decode)

    def __len__(self) -> int:
        return len(self._prefill) + len(self._decode)


class PlannerStrategy(Strategy):
    """The real planner, scoring ``candidates`` workers of each role per turn."""

    def __init__(self, *args, policy, model: PrefillCostModel, disable_pull: bool = False):
        super().__init__(*args)
        self.disable_pull = disable_pull
        self.planner = Planner({policy.name: policy}, policy.name, model, LoadAwareSelector(),
                               candidates=self.candidates, rng=self.rng)
        self.loads = _Loads(self.prefill, self.decode, self.unit)

    @property
    def model(self) -> PrefillCostModel:
        return self.planner.model

    def route(self, session, prompt, handle, source, unit_keys) -> Routed:
        tp = self.planner.plan(prompt, handle, prefill=self.prefill, decode=self.decode, loads=self.loads,
                               source_worker=source, disable_pull=self.disable_pull, session=session)
        plan = tp.plan
        return Routed(tp.prefill, tp.decode, plan.choice, plan.code, plan.reusable_tokens, plan.pullable_tokens,
                      tp.cached_tokens, tp.policy.name)

    def observe(self, outcome: Outcome) -> None:
        self.planner.observe(outcome)


class KvShuttle(PlannerStrategy):
    """The planner fed each prefill worker's prefix-cache hit for the prompt by a :class:`KvIndex` of the workers'
    KV events (blocks of one unit, hashed as vLLM hashes them), as the scheduler feeds it."""

    name = "kvshuttle"
    keeps_kv = manages_kv = frees_unused = reads_kv_events = True

    def __init__(self, *args, prior: PrefillPrior, index: dict[int, set[str]] | None = None):
        model = PrefillCostModel(prior)
        super().__init__(*args, policy=CostPolicy(model), model=model)
        self.kv_index = KvIndex(HashScheme(self.unit))
        self.fleet_index = index
        for p in self.prefill:
            p.on_events, p.event_block_tokens = self.kv_index.apply, self.unit

    def route(self, session, prompt, handle, source, unit_keys) -> Routed:
        hashes = self.kv_index.scheme.hashes(prompt)
        lookup = hashes[:(len(prompt) - 1) // self.unit]  # P always computes the last token
        if self.fleet_index is None or len(self.prefill) <= 64:
            asked = [p.worker_id for p in self.prefill]
        else:
            # At a thousand workers, ask the index only about the workers that hold the prompt's first unit (the
            # fleet's unit index names them: the same blocks the KV events stored) and the session's last prefill
            # worker; every other worker holds none of it, and absent from ``prefix_hits`` it is estimated 0 too.
            asked = sorted(self.fleet_index.get(unit_keys[0], ())) if unit_keys else []
            last = self.planner.cache_hints.worker_of(session)
            if last is not None:
                asked.append(last)
        hits = {w: self.kv_index.cached_prefix_tokens(w, lookup) for w in asked}
        tp = self.planner.plan(prompt, handle, prefill=self.prefill, decode=self.decode, loads=self.loads,
                               source_worker=source, disable_pull=self.disable_pull, session=session,
                               prefix_hits=hits)
        plan = tp.plan
        return Routed(tp.prefill, tp.decode, plan.choice, plan.code, plan.reusable_tokens, plan.pullable_tokens,
                      tp.cached_tokens, tp.policy.name, hashes)


class Threshold(PlannerStrategy):
    name = "threshold"
    keeps_kv = True

    def __init__(self, *args, prior: PrefillPrior, pull_threshold_tokens: int = 16):
        super().__init__(*args, policy=ThresholdPolicy(pull_threshold_tokens), model=PrefillCostModel(prior))


class Recompute(PlannerStrategy):
    name = "recompute"

    def __init__(self, *args, prior: PrefillPrior):
        super().__init__(*args, policy=ThresholdPolicy(), model=PrefillCostModel(prior), disable_pull=True)


class CacheAware(Strategy):
    """SMG's / SGLang router's ``cache_aware`` policy over the prefill workers (the fleet's unit index stands for
    its radix tree), power of two over the decode workers."""

    name = "cache_aware"

    def __init__(self, *args, index: dict[int, set[str]], cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.0001):
        super().__init__(*args)
        self.index = index
        self.by_id = {w.worker_id: w for w in self.prefill}
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs_threshold, balance_rel_threshold

    def _least(self, workers, key):
        best = min(key(w) for w in workers)
        return self.rng.choice([w for w in workers if key(w) == best])

    def route(self, session, prompt, handle, source, unit_keys) -> Routed:
        p, d = self._prefill_worker(len(prompt), unit_keys), self._decode_worker()
        return Routed(p, d, Choice.RECOMPUTE, reasons.NO_RECORD, policy=self.name)  # it keeps no handles

    def _prefill_worker(self, n: int, unit_keys: list[int]) -> PrefillWorker:
        def load(w: PrefillWorker) -> int:
            return len(w.queue) + w.busy

        loads = [load(w) for w in self.prefill]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            p = self._least(self.prefill, load)
        else:
            holders: set[str] | None = None
            matched = 0
            for key in unit_keys:
                found = self.index.get(key)
                common = found if holders is None else (holders & found if found else None)
                if not common:
                    break
                holders, matched = common, matched + 1
            if holders and matched * self.unit > self.cache_threshold * n:
                p = self._least([self.by_id[w] for w in sorted(holders)], load)  # sorted: runs repeat exactly
            else:
                p = self._least(self.prefill, lambda w: len(w.cache))
        return p

    def _decode_worker(self) -> DecodeWorker:
        a, b = self.rng.sample(self.decode, 2) if len(self.decode) > 1 else (self.decode[0],) * 2
        return a if a.used_tokens + a.reserved_tokens <= b.used_tokens + b.reserved_tokens else b


class CacheAwarePull(CacheAware):
    """``cache_aware``'s P, then vLLM's pull rule on it (see the module docstring); D keeps handles until the TTL."""

    name = "cache_aware_pull"
    keeps_kv = True

    def __init__(self, *args, index: dict[int, set[str]], pull_threshold_tokens: int = 16,
                 expiry_guard_s: float = 2.0):
        super().__init__(*args, index=index)
        self.safety = PullPolicy(pull_threshold_tokens, expiry_guard_s)

    def route(self, session, prompt, handle, source, unit_keys) -> Routed:
        n = len(prompt)
        p, d = self._prefill_worker(n, unit_keys), self._decode_worker()
        if handle is None:
            return Routed(p, d, Choice.RECOMPUTE, reasons.NO_RECORD, policy=self.name)
        safe = decide(prompt, handle, self.safety)
        if safe.choice is not Choice.PULL:
            return Routed(p, d, Choice.RECOMPUTE, safe.code, pullable=safe.pullable_tokens, policy=self.name)
        held = p.holds_units(unit_keys) * self.unit  # P's own prefix cache: what the pull need not load
        if safe.reusable_tokens - held < self.safety.pull_threshold_tokens:
            return Routed(p, d, Choice.RECOMPUTE, reasons.BELOW_THRESHOLD, pullable=safe.reusable_tokens,
                          cached_estimate=held, policy=self.name)
        return Routed(p, d, Choice.PULL, safe.code, safe.reusable_tokens, cached_estimate=held, policy=self.name)


def make(name: str, prefill, decode, rng: random.Random, *, candidates: int, unit: int, prior: PrefillPrior,
         index: dict[int, set[str]], pull_threshold_tokens: int = 16) -> Strategy:
    args = (prefill, decode, rng, candidates, unit)
    if name == "kvshuttle":
        return KvShuttle(*args, prior=prior, index=index)
    if name == "threshold":
        return Threshold(*args, prior=prior, pull_threshold_tokens=pull_threshold_tokens)
    if name == "recompute":
        return Recompute(*args, prior=prior)
    if name == "cache_aware":
        return CacheAware(*args, index=index)
    if name == "cache_aware_pull":
        return CacheAwarePull(*args, index=index, pull_threshold_tokens=pull_threshold_tokens)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(NAMES)}")
