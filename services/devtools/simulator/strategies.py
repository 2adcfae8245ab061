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

- ``conditional_disagg``: NVIDIA Dynamo's KV-aware router with conditional disaggregation (``--router-mode kv
  --router-conditional-disagg``), see :class:`ConditionalDisagg`: a turn whose uncached part on the decode worker the
  router picks is small is prefilled on that decode worker itself (no P, no transfer); otherwise a prefill worker
  chosen by Dynamo's KV cost computes it and hands it to a decode worker chosen by load. No pull; D keeps a finished
  turn's blocks in its prefix cache as vLLM does (evictable, not held handles).
- ``cache_aware_offload``: llm-d's precise prefix-cache routing over prefill workers whose prefix cache has a CPU tier
  (vLLM's OffloadingConnector / LMCache, Dynamo KVBM alike), see :class:`CacheAwareOffload`: a unit evicted from
  P's GPU cache moves to its node's CPU tier, and a later hit there is restored over PCIe instead of recomputed
  (``SimSettings.cpu_tier_gib``, ``cpu_restore_gb_s``; optionally pulled from a peer node's CPU tier over the
  network: ``peer_cpu_pull``). No pull from D.
- ``kvshuttle_pull`` (not in the default list): ``kvshuttle`` as it was before its third choice: pull or recompute,
  never continue on D (``continue_on_decode`` never): the baseline that says what continuing on D changes.

``kvshuttle`` decides among three: a turn the planner continues on the session's decode worker (``Choice.LOCAL``) is
prefilled there from the handle D holds, by the same engine path as ``conditional_disagg``'s D-prefills
(``serves_local``), and the planner prices it with D's streams (their delay counts against it; past
``decode_itl_slo_ms`` it is never taken).

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

NAMES = ("kvshuttle", "threshold", "recompute", "cache_aware", "cache_aware_pull", "conditional_disagg",
         "cache_aware_offload")
EXTRA = ("kvshuttle_pull", "kvshuttle_on_d")  # accepted by --strategies, not run by default
CHOICES = NAMES + EXTRA

# The planner's third choice (control_plane.decision.Choice.LOCAL: continue the turn on the session's decode worker
# from its own prefix cache); None on a control plane without it.
LOCAL = Choice.LOCAL
LOCAL_PREFILL, REMOTE_PREFILL = "local_prefill", "remote_prefill"  # conditional_disagg's two paths (decision codes)


@dataclass(slots=True)
class Routed:
    prefill: PrefillWorker | None  # None: no prefill worker (the turn is prefilled on its decode worker)
    decode: DecodeWorker
    choice: Choice
    code: str
    reusable: int = 0  # tokens a pull loads (PULL)
    pullable: int = 0  # a RECOMPUTE's safe alternative
    cached_estimate: int = 0
    policy: str = ""
    block_hashes: list | None = None  # the prompt's whole units' prefix-cache hashes (strategies that read events)
    local: bool = False  # prefilled on ``decode`` itself (conditional_disagg's bypass); choice LOCAL implies it


def is_local(routed: Routed) -> bool:
    """Whether the turn is prefilled on its decode worker: conditional_disagg's bypass, or the planner's LOCAL."""
    return routed.local or (LOCAL is not None and routed.choice is LOCAL)


class Strategy:
    name = ""
    keeps_kv = False  # D holds the turn's KV after it (a handle the next turn may pull)
    manages_kv = False  # kvshuttle's decode-KV capacity policy frees held handles
    frees_unused = False  # a recompute frees the session's unused handle at once
    reads_kv_events = False  # routes by an index of the prefill workers' KV events (needs the prompt's token ids)
    # The engine's decode-batch path: turns may be prefilled on their decode worker (:func:`is_local`), whose chunks
    # stretch the decode steps of every stream that worker is decoding meanwhile. Without it a turn the router marks
    # local is sent to the prefill worker it names, as before.
    # Every deployment runs vLLM on D, whose prefix cache keeps the blocks of the turns it served and whose NIXL
    # connector reads from P only the blocks beyond D's own prefix hit (measured: tests/e2e/test_local_turns.py).
    serves_local = True
    decode_prefix_cache = True  # D keeps a prefix cache of the turns it served (needs serves_local)
    cpu_tier = False  # prefill nodes have a CPU tier (SimSettings.cpu_tier_gib)

    def __init__(self, prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker], rng: random.Random,
                 candidates: int, unit: int):
        self.prefill, self.decode, self.rng, self.candidates, self.unit = list(prefill), list(decode), rng, \
            candidates, unit

    def route(self, session: tuple[str, str], prompt, handle: HandleView | None, source: str,
              unit_keys: list[int], adapter: str = "") -> Routed:
        """Where the turn runs and whether it pulls. ``source``: the decode worker holding the session's handle;
        ``unit_keys``: the prompt's whole prefix-cache units (the cache-aware router matches them; an adapter's
        turns have units of their own, so every strategy keeps adapters' caches apart); ``adapter``: the LoRA
        adapter the turn runs under ("": the base model)."""
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

    def route(self, session, prompt, handle, source, unit_keys, adapter="") -> Routed:
        tp = self.planner.plan(prompt, handle, prefill=self.prefill, decode=self.decode, loads=self.loads,
                               source_worker=source, disable_pull=self.disable_pull, session=session)
        plan = tp.plan
        return Routed(tp.prefill, tp.decode, plan.choice, plan.code, plan.reusable_tokens, plan.pullable_tokens,
                      tp.cached_tokens, tp.policy.name)

    def observe(self, outcome: Outcome) -> None:
        self.planner.observe(outcome)


class KvShuttle(PlannerStrategy):
    """The planner fed each prefill worker's prefix-cache hit for the prompt by a :class:`KvIndex` of the workers'
    KV events (blocks of one unit, hashed as vLLM hashes them), as the scheduler feeds it.

    The planner's LOCAL plans (continue on the session's decode worker) are served on D (``serves_local``): the
    engine prefills them on D from the handle D holds, as conditional_disagg's D-prefills."""

    name = "kvshuttle"
    keeps_kv = manages_kv = frees_unused = reads_kv_events = True
    serves_local = True
    continue_on_decode = "auto"

    def __init__(self, *args, prior: PrefillPrior, index: dict[int, set[str]] | None = None):
        model = PrefillCostModel(prior)
        super().__init__(*args, policy=CostPolicy(model, continue_on_decode=self.continue_on_decode), model=model)
        self.kv_index = KvIndex(HashScheme(self.unit))
        self.fleet_index = index
        for p in self.prefill:
            p.on_events, p.event_block_tokens = self.kv_index.apply, self.unit

    def route(self, session, prompt, handle, source, unit_keys, adapter="") -> Routed:
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
        # An adapter's prompt is its own segments here (its KV is the adapter's), hashed as the scheduler hashes it
        # under the adapter (services/scheduler/prefix_index.py): the index finds the adapter's cached blocks only.
        hits = {w: self.kv_index.cached_prefix_tokens(w, lookup) for w in asked}
        tp = self.planner.plan(prompt, handle, prefill=self.prefill, decode=self.decode, loads=self.loads,
                               source_worker=source, disable_pull=self.disable_pull, session=session,
                               prefix_hits=hits)
        plan = tp.plan
        return Routed(tp.prefill, tp.decode, plan.choice, plan.code, plan.reusable_tokens, plan.pullable_tokens,
                      tp.cached_tokens, tp.policy.name, hashes)


class KvShuttleOnD(KvShuttle):
    """``kvshuttle`` continuing every turn it can on D (``continue_on_decode=always``): what the bench's local lane
    runs, replayed by ``--validate-samples``."""

    name = "kvshuttle_on_d"
    continue_on_decode = "always"


class KvShuttlePull(KvShuttle):
    """``kvshuttle`` without its third choice: pull or recompute, as before it could continue turns on D."""

    name = "kvshuttle_pull"
    continue_on_decode = "never"


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

    def route(self, session, prompt, handle, source, unit_keys, adapter="") -> Routed:
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

    def route(self, session, prompt, handle, source, unit_keys, adapter="") -> Routed:
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


def _pick(rng: random.Random, workers: Sequence, key) -> object:
    """The worker with the lowest ``key`` (ties: one of them at random, as Dynamo's and llm-d's pickers break
    ties), in the order ``workers`` come."""
    costs = [key(w) for w in workers]
    best = min(costs)
    tied = [w for w, c in zip(workers, costs, strict=True) if c <= best + 1e-9]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class ConditionalDisagg(Strategy):
    """NVIDIA Dynamo's KV-aware router with conditional disaggregation, as ``python -m dynamo.frontend --router-mode
    kv --router-conditional-disagg`` runs it (ai-dynamo/dynamo, read 2026-12; experimental upstream).

    Per turn, as Dynamo's prefill router does (``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs``):

    1. it probes the decode router for the decode worker D it would pick: the lowest KV cost (below) over every
       decode worker, with D's cached prefix of the prompt seen through D's KV events (here: D's prefix cache,
       :class:`~.cluster.DecodePrefixCache`, exactly);
    2. the effective ISL is the prompt less that D's cached prefix; the ``isl_bounding`` policy
       (``lib/kv-router/src/conditional_disagg.rs``, ``IslBoundingPolicy``) bypasses remote prefill when the effective
       ISL is below ``eff_isl_threshold`` AND effective ÷ prompt is below ``eff_isl_ratio_threshold`` (both strict);
       then D prefills the turn itself, inside its decode batch (the engine's D-prefill: no P, no transfer);
    3. otherwise the prefill router picks P by the same KV cost over the prefill workers (prefill workers track no
       decode blocks) and P computes what its prefix cache lacks; the decode stage then picks D by load alone
       (disaggregated decode routing: ``overlap_score_credit=0``, prefill-token tracking off), and D reads from P
       only the blocks beyond its own prefix hit (vLLM's NixlConnector). Nothing is ever pulled from D.

    Dynamo's KV cost (``docs/components/router/README.md``, "Cost formula"; ``DefaultWorkerSelector``): per worker,
    ``overlap_score_weight × prefill_blocks + decode_blocks``, the lowest wins (``router_temperature`` 0: no
    sampling; ties at random); ``prefill_blocks``: the worker's in-flight prefill tokens plus this prompt's tokens it
    does not cache, in blocks; ``decode_blocks``: its active KV blocks plus this request's new ones. Defaults:
    ``overlap_score_weight`` 1.0 (``--router-kv-overlap-score-weight``).

    Thresholds: 4096 tokens and 0.6 are the configuration Dynamo's conditional-disaggregation guide shows
    (``--router-conditional-disagg-config '{"policy":"isl_or_load","eff_isl_threshold":4096,
    "eff_isl_ratio_threshold":0.6}'``; with no prefill busy threshold set, ``isl_or_load``'s load arm never fires, so
    it is ``isl_bounding``); the code's defaults are 2048 and 0.7 (``DEFAULT_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD``,
    ``docs/components/router/router-disaggregated-serving.md``): ``--cd-eff-isl-threshold``, ``--cd-eff-isl-ratio``.
    The decode-busy guard (``decode_busy_threshold``) is unset by default, as upstream."""

    name = "conditional_disagg"
    serves_local = decode_prefix_cache = True

    def __init__(self, *args, eff_isl_threshold: int = 4096, eff_isl_ratio_threshold: float = 0.6,
                 overlap_score_weight: float = 1.0):
        super().__init__(*args)
        self.eff_isl_threshold, self.eff_isl_ratio_threshold = eff_isl_threshold, eff_isl_ratio_threshold
        self.overlap_score_weight = overlap_score_weight

    def route(self, session, prompt, handle, source, unit_keys, adapter="") -> Routed:
        n, unit, w = len(prompt), self.unit, self.overlap_score_weight
        overlap = {d.worker_id: (d.prefix.held(unit_keys) * unit if d.prefix is not None else 0) for d in self.decode}

        def decode_cost(d: DecodeWorker) -> float:
            new = n - overlap[d.worker_id]
            return (w * (d.local_prefill_tokens + new) + d.running_tokens + d.reserved_tokens + new) / d.block_size

        d = _pick(self.rng, self.decode, decode_cost)
        eff = n - overlap[d.worker_id]
        if eff < self.eff_isl_threshold and eff / max(n, 1) < self.eff_isl_ratio_threshold:
            return Routed(None, d, Choice.RECOMPUTE, LOCAL_PREFILL, cached_estimate=overlap[d.worker_id],
                          policy=self.name, local=True)
        hits = {p.worker_id: p.holds_units(unit_keys) * unit for p in self.prefill}
        p = _pick(self.rng, self.prefill, lambda p: w * (p.pending_tokens + n - hits[p.worker_id]) / p.block_size)
        d = _pick(self.rng, self.decode, lambda d: d.running_tokens + d.reserved_tokens)
        return Routed(p, d, Choice.RECOMPUTE, REMOTE_PREFILL, cached_estimate=hits[p.worker_id], policy=self.name)


class CacheAwareOffload(Strategy):
    """llm-d's P/D scheduling with precise prefix-cache routing over prefill workers that offload their prefix
    cache to a CPU tier per node (vLLM's OffloadingConnector or LMCache, as llm-d's tiered-prefix-cache guides
    deploy them; Dynamo's KVBM works alike).

    Routing, as llm-d's default P/D EndpointPickerConfig (the ``prefill`` and ``decode`` profiles, always
    disaggregated: ``pd-profile-handler`` threshold 0, as KServe's LLMInferenceService configures llm-d): per
    profile, ``prefix-cache-scorer`` weight 3 + ``queue-scorer`` weight 2, highest total wins (``max-score-picker``,
    ties at random):

    - the precise prefix scorer (llm-d-kv-cache's index of the workers' KV events, exact here) counts the prompt's
      leading blocks a worker holds, a block in the GPU tier 1.0, one only in the CPU tier 0.8 (its
      ``kvCacheBackendConfigs`` defaults), then min-max normalises over the workers holding any (one holder, or all
      equal: 1.0; the others 0);
    - the queue scorer: ``(max − q) / (max − min)`` of the workers' waiting requests (all equal: 1.0).

    The decode profile scores D's own prefix cache the same way (GPU tier only): D reads from P only the blocks
    beyond it. P computes what neither its GPU cache nor its CPU tier holds; the CPU tier's run is restored at
    ``SimSettings.cpu_restore_gb_s``. Nothing is pulled from D."""

    name = "cache_aware_offload"
    serves_local = decode_prefix_cache = cpu_tier = True  # no turn is prefilled on D: the path models D's cache

    def __init__(self, *args, index: dict[int, set[str]], prefix_weight: float = 3.0, queue_weight: float = 2.0,
                 gpu_weight: float = 1.0, cpu_weight: float = 0.8):
        super().__init__(*args)
        self.index = index
        self.cpu_index: dict[int, set[str]] = {}  # unit -> prefill nodes whose CPU tier holds it (the engine fills)
        self.by_id = {w.worker_id: w for w in self.prefill}
        self.prefix_weight, self.queue_weight = prefix_weight, queue_weight
        self.gpu_weight, self.cpu_weight = gpu_weight, cpu_weight

    def _held(self, p: PrefillWorker, keys: list[int]) -> float:
        score = 0.0
        for key in keys:
            if key in p.cache:
                score += self.gpu_weight
            elif p.cpu is not None and key in p.cpu:
                score += self.cpu_weight
            else:
                break
        return score

    def _best(self, workers: Sequence, raw: dict[str, float], queued) -> object:
        held = [v for v in raw.values() if v > 0]
        low, high = (min(held), max(held)) if held else (0.0, 0.0)
        q = [queued(w) for w in workers]
        q_low, q_high = min(q), max(q)

        def score(w, queue: int) -> float:
            r = raw.get(w.worker_id, 0.0)
            prefix = 0.0 if r <= 0 else (1.0 if high == low else (r - low) / (high - low))
            queue_score = 1.0 if q_high == q_low else (q_high - queue) / (q_high - q_low)
            return -(self.prefix_weight * prefix + self.queue_weight * queue_score)

        costs = {w.worker_id: score(w, queue) for w, queue in zip(workers, q, strict=True)}
        return _pick(self.rng, workers, lambda w: costs[w.worker_id])

    def route(self, session, prompt, handle, source, unit_keys, adapter="") -> Routed:
        holders: set[str] = set()
        if unit_keys:
            holders = set(self.index.get(unit_keys[0], ())) | set(self.cpu_index.get(unit_keys[0], ()))
        raw = {w: self._held(self.by_id[w], unit_keys) for w in sorted(holders)}
        p = self._best(self.prefill, raw, lambda w: len(w.queue))
        d_raw = {d.worker_id: float(d.prefix.held(unit_keys)) for d in self.decode if d.prefix is not None}
        d = self._best(self.decode, d_raw, lambda w: len(w.waiting))
        return Routed(p, d, Choice.RECOMPUTE, reasons.NO_RECORD, cached_estimate=p.holds_units(unit_keys) * self.unit,
                      policy=self.name)


def make(name: str, prefill, decode, rng: random.Random, *, candidates: int, unit: int, prior: PrefillPrior,
         index: dict[int, set[str]], pull_threshold_tokens: int = 16, eff_isl_threshold: int = 4096,
         eff_isl_ratio_threshold: float = 0.6) -> Strategy:
    args = (prefill, decode, rng, candidates, unit)
    if name == "kvshuttle":
        return KvShuttle(*args, prior=prior, index=index)
    if name == "kvshuttle_pull":
        return KvShuttlePull(*args, prior=prior, index=index)
    if name == "kvshuttle_on_d":
        return KvShuttleOnD(*args, prior=prior, index=index)
    if name == "conditional_disagg":
        return ConditionalDisagg(*args, eff_isl_threshold=eff_isl_threshold,
                                 eff_isl_ratio_threshold=eff_isl_ratio_threshold)
    if name == "cache_aware_offload":
        return CacheAwareOffload(*args, index=index)
    if name == "threshold":
        return Threshold(*args, prior=prior, pull_threshold_tokens=pull_threshold_tokens)
    if name == "recompute":
        return Recompute(*args, prior=prior)
    if name == "cache_aware":
        return CacheAware(*args, index=index)
    if name == "cache_aware_pull":
        return CacheAwarePull(*args, index=index, pull_threshold_tokens=pull_threshold_tokens)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(CHOICES)}")
