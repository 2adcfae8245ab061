"""One turn's plan, start to finish (pure): safety rules, prefill worker, policy, expiry, decode worker.

The order matters. The safety rules (:func:`.decision.decide`) do not depend on the workers, so they
come first and say how many tokens a pull could reuse; that lets the prefill worker be chosen by its predicted time
for *this* turn (a worker with a slow link to the session's decode worker, or a long queue, loses); then the policy
judges pull vs recompute on that worker, and the expiry rule checks the predicted end of the pull against the
handle's expiry. The decode worker is chosen last, by free KV cache; or, when the policy continues the turn on the
decode worker that holds the session's KV (LOCAL), it is that one.

With ``candidates`` set, each turn scores only that many workers of each role, drawn at random, plus the prefill
worker that prefilled the session's last turn (its prefix cache): at a thousand workers, scoring all of them per
turn would cost more than the decision is worth (the power of d choices keeps the load spread nearly as well).

The scheduler adapts this to gRPC; a simulator (``kvshuttle simulate``) drives it directly with synthetic loads and
outcomes.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvshuttle.control_plane.cost_model import LocalPrediction, Prediction, PrefillCostModel
from kvshuttle.control_plane.decision import Choice, HandleView, Plan, decide
from kvshuttle.control_plane.load import WorkerLoad
from kvshuttle.control_plane.policies import (
    CostPolicy,
    Outcome,
    Policy,
    PolicyError,
    PolicyInputs,
    RegretMeter,
    plan_turn,
)
from kvshuttle.control_plane.prefill_cache import PrefillCacheHints
from kvshuttle.control_plane.selection import UNKNOWN, HasId, Selector

W = TypeVar("W", bound=HasId)

LEARNED_STATE_VERSION = 1


@dataclass
class TurnPlan(Generic[W]):
    plan: Plan
    policy: Policy
    prefill: W
    decode: W
    prediction: Prediction | None  # both options on the chosen prefill worker
    wait_ms: float  # predicted wait at the prefill worker
    worker_choice: str  # why these workers
    cached_tokens: int = 0  # the prefill worker's predicted prefix-cache hit
    local: LocalPrediction | None = None  # the turn continued on the session's decode worker (None: not an option)


class Planner(Generic[W]):
    def __init__(self, policies: Mapping[str, Policy], default: str, model: PrefillCostModel, selector: Selector,
                 candidates: int = 0, rng: random.Random | None = None):
        if default not in policies:
            raise PolicyError(f"default policy {default!r} is not among {', '.join(policies)}")
        if candidates < 0:
            raise PolicyError("candidates must be >= 0 (0: score every worker)")
        self.candidates = candidates
        self.rng = rng or random.Random()
        self.policies = dict(policies)
        self.default = default
        self.model = model
        self.selector = selector
        self.regret = RegretMeter()
        self.reported = 0
        self.cache_hints = PrefillCacheHints()

    def policy(self, name: str = "") -> Policy:
        policy = self.policies.get(name or self.default)
        if policy is None:
            raise PolicyError(f"unknown policy {name!r}; this scheduler has {', '.join(self.policies)}")
        return policy

    def plan(self, prompt: Sequence[int], handle: HandleView | None, *, prefill: Sequence[W], decode: Sequence[W],
             loads: Mapping[str, WorkerLoad], source_worker: str = "", exclude: Collection[str] = (),
             disable_pull: bool = False, policy: str = "", session: Hashable | None = None,
             prefix_hits: Mapping[str, int] | None = None, model: str = "") -> TurnPlan[W] | None:
        """The turn's plan; None when there is no live prefill or decode worker (outside ``exclude``).

        ``session`` (e.g. (tenant, session id)) lets the planner count on the prefix cache of the prefill worker that
        prefilled the session's last turn. ``prefix_hits``: worker id -> tokens of this prompt that worker's prefix
        cache holds, as an index of its KV events says (:meth:`.kv_index.index.KvIndex.best`); for a worker in it,
        that hit (in whole blocks of at most ``len(prompt) - 1`` tokens: P always computes the last token) replaces
        the session-based estimate of :class:`.prefill_cache.PrefillCacheHints`; workers not in it are estimated as
        without it. With ``candidates`` the sample keeps the worker with the most hits, besides the session's last
        prefill worker. ``model``: the turn's (its workers serve it): workers the cost model has not measured yet
        are priced like the most-measured one of that model: of the base model all its prefill workers serve, when
        they serve one (a turn naming none, or an adapter's turn), else of ``model``."""
        chosen_policy = self.policy(policy)
        n = len(prompt)
        model = _one_model(prefill) or model  # an adapter's turn is priced as its base model's
        holder = next((w for w in decode if w.worker_id == source_worker), None) if source_worker else None
        if self.candidates:
            keep = [self.cache_hints.worker_of(session)]
            if prefix_hits:
                top = max(prefix_hits, key=prefix_hits.__getitem__)
                if prefix_hits[top] > 0:
                    keep.append(top)
            prefill = self._sample(prefill, exclude, *keep)
            decode = self._sample(decode, exclude)
        safe = decide(prompt, handle, chosen_policy.safety, disable_pull=disable_pull)
        can_pull = safe.choice is Choice.PULL
        # tokens a pull would load: the planned pull's, or the one a threshold refused (predicted to explain it)
        reusable = safe.reusable_tokens if can_pull else safe.pullable_tokens
        predictions: dict[str, Prediction] = {}
        cached: dict[str, int] = {}
        block_sizes = {w.worker_id: getattr(w, "block_size", 0) for w in prefill}
        # Workers are compared by their work (what each must compute, given its cache, and pull over its link) and
        # queue, priced with the fleet's compute fit: a prefill pool is one kind of worker, and per-worker fits of
        # noisy measurements would otherwise outweigh a cached prefix. The chosen worker's own fit then judges pull
        # vs recompute on it.
        fleet = self.model.reference_worker_of(model)

        def cached_on(worker_id: str) -> int:
            if worker_id not in cached:
                hit = prefix_hits.get(worker_id) if prefix_hits else None
                if hit is None:
                    cached[worker_id] = self.cache_hints.estimate(
                        session, worker_id, matched_tokens=safe.matched_tokens, prompt_tokens=n,
                        block_size=block_sizes.get(worker_id, 0))
                else:
                    cached[worker_id] = _whole_blocks(hit, n, block_sizes.get(worker_id, 0))
            return cached[worker_id]

        def predict(worker_id: str, compute_as: str | None = None) -> Prediction:
            return self.model.predict(worker_id, prompt_tokens=n, reusable_tokens=reusable,
                                      cached_tokens=cached_on(worker_id), source=source_worker, compute_as=compute_as,
                                      group=model)

        def option_ms(predicted: Prediction) -> float:
            if not can_pull or predicted.pull_ms is None:
                return predicted.recompute_ms
            return predicted.best_ms if isinstance(chosen_policy, CostPolicy) else predicted.pull_ms

        def prefill_ms(worker_id: str) -> float:
            predicted = predictions.get(worker_id)
            if predicted is None:
                predicted = predictions[worker_id] = predict(worker_id, fleet)
            return option_ms(predicted)

        p = self.selector.pick_prefill(prefill, loads, exclude, prefill_ms)
        d = self.selector.pick_decode(decode, loads, exclude)
        if p is None or d is None:
            return None
        chosen = p.worker.worker_id
        load = loads.get(chosen, UNKNOWN)
        prediction = predict(chosen)
        wait_ms = load.queued * option_ms(prediction)
        local = None
        if can_pull and handle is not None and holder is not None and source_worker not in exclude:
            held = loads.get(source_worker, UNKNOWN)
            on_d = min(safe.matched_tokens, n - 1)  # D's prefix cache holds whole blocks
            local = self.model.predict_local(
                source_worker, prompt_tokens=n, streams=held.running + held.pending, waiting=held.waiting, group=model,
                cached_tokens=on_d // handle.block_size * handle.block_size if handle.block_size > 0 else 0)
        ctx = PolicyInputs(p.worker.worker_id, source_worker, prediction if can_pull else None, wait_ms,
                          handle.expires_in_s if handle else 0.0, local=local)
        final = plan_turn(chosen_policy, safe, ctx)
        hit = cached[chosen]
        why = f"{p.why}, {hit} of {n} prompt tokens cached there" if hit else p.why
        if final.choice is Choice.LOCAL:
            assert holder is not None
            return TurnPlan(final, chosen_policy, p.worker, holder, prediction, wait_ms,
                            f"{why}; decode {holder.worker_id}: holds the session's KV", hit, local)
        if session is not None:
            self.cache_hints.note(session, p.worker.worker_id, n)
        return TurnPlan(final, chosen_policy, p.worker, d.worker, prediction, wait_ms, f"{why}; {d.why}", hit, local)

    def _sample(self, workers: Sequence[W], exclude: Collection[str], *keep: str | None) -> Sequence[W]:
        """``candidates`` of ``workers`` (outside ``exclude``) at random, each of ``keep`` among them when it is
        there (as many as fit, in the given order)."""
        if len(workers) <= self.candidates:
            return workers
        pool = [w for w in workers if w.worker_id not in exclude] if exclude else workers
        if len(pool) <= self.candidates:
            return pool
        picked = self.rng.sample(pool, self.candidates)
        slot = 0
        for wanted in dict.fromkeys(k for k in keep if k):
            if slot >= len(picked):
                break
            at = next((i for i, w in enumerate(picked) if w.worker_id == wanted), None)
            if at is None:
                kept = next((w for w in pool if w.worker_id == wanted), None)
                if kept is None:
                    continue
                picked[slot] = kept
                at = slot
            picked[slot], picked[at] = picked[at], picked[slot]  # keep it out of the next kept one's way
            slot += 1
        return picked

    def observe(self, outcome: Outcome) -> bool | None:
        """Learn from a reported turn; returns whether it counts as a regret (None: it had no alternative)."""
        regret = self.regret.record(outcome, self.model)
        if outcome.decision is Choice.LOCAL:
            self.model.observe_local(outcome.decode_worker, prompt_tokens=outcome.prompt_tokens,
                                     computed_tokens=outcome.computed_tokens, streams=outcome.streams,
                                     ms=outcome.prefill_ms, group=outcome.model)
            self.reported += 1
            return regret
        if outcome.decision is Choice.RECOMPUTE:
            self.cache_hints.observe(outcome.prefill_worker, estimated=outcome.cached_estimate,
                                     actual=outcome.prompt_tokens - outcome.computed_tokens)
        self.model.observe(outcome.prefill_worker, prompt_tokens=outcome.prompt_tokens,
                           computed_tokens=outcome.computed_tokens, pulled_tokens=outcome.pulled_tokens,
                           prefill_ms=outcome.prefill_ms, source=outcome.source_worker, group=outcome.model)
        self.reported += 1
        return regret

    def learned_state(self) -> dict:
        """What this planner learned from reported turns, JSON-friendly, for another replica to start from
        (:meth:`load_learned_state`): the cost model, the regret counts, the per-worker trust in prefix-cache
        estimates and the count of reported turns. A replica that loads it and then observes the same turns as this
        one stays identical to it in all of these.

        Not in it: which worker prefilled each session (per session, and re-learnt within a turn or two), the
        policies' explore counters and the worker sampling's random state (per replica: they steer this replica's
        own choices, not what it learned), and the priors and settings (configuration: replicas should share it)."""
        return {
            "version": LEARNED_STATE_VERSION,
            "model": self.model.state(),
            "regret": {"turns": dict(self.regret.turns), "regrets": dict(self.regret.regrets)},
            "cache_trust": dict(self.cache_hints.trust),
            "reported": self.reported,
        }

    def load_learned_state(self, state: Mapping[str, Any]) -> None:
        """Replace what this planner learned with ``state`` (from :meth:`learned_state`, JSON round-trip included),
        in place: the policies and anyone else holding ``self.model`` see the loaded model.

        ValueError for an unknown ``version`` or a malformed state; nothing changes then."""
        if not isinstance(state, Mapping):
            raise ValueError("malformed learned state: not a mapping")
        version = state.get("version")
        if type(version) is not int or version != LEARNED_STATE_VERSION:
            raise ValueError(f"learned state version {version!r} is not supported (this planner reads version "
                             f"{LEARNED_STATE_VERSION})")
        try:
            regret = state["regret"]
            turns, regrets = _counts(regret["turns"], "regret turns"), _counts(regret["regrets"], "regrets")
            trust = state["cache_trust"]
            if not isinstance(trust, Mapping) or not all(
                    isinstance(w, str) and isinstance(t, int | float) and not isinstance(t, bool) and 0 <= t <= 1
                    for w, t in trust.items()):
                raise ValueError("cache_trust is not a mapping of worker to a share in [0, 1]")
            trust = dict(trust)
            reported = state["reported"]
            if isinstance(reported, bool) or not isinstance(reported, int) or reported < 0:
                raise ValueError(f"reported is not a count: {reported!r}")
            model = state["model"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed learned state: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"malformed learned state: {exc}") from None
        self.model.load_state(model)  # checks it all before changing anything: the last step that can fail
        for mine, loaded in ((self.regret.turns, turns), (self.regret.regrets, regrets),
                             (self.cache_hints.trust, trust)):
            mine.clear()
            mine.update(loaded)
        self.reported = reported


def _whole_blocks(hit: int, prompt_tokens: int, block_size: int) -> int:
    """An indexed prefix-cache hit as P can use it: at most the prompt less its last token (P always computes
    it), in whole blocks (``block_size`` 0: unknown, not rounded)."""
    reach = max(0, min(int(hit), prompt_tokens - 1))
    return reach // block_size * block_size if block_size > 0 else reach


def _counts(value: Any, what: str) -> dict[str, int]:
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0 for k, n in value.items()):
        raise ValueError(f"{what} is not a mapping of policy name to a count")
    return dict(value)


def _one_model(workers: Sequence[HasId]) -> str:
    """The base model every one of ``workers`` serves ("" when they serve several, or do not say): the cost-model
    group of a turn (an adapter's turns cost as its base model's; a turn naming no model is priced like the measured
    workers of the model its workers serve)."""
    models = {getattr(w, "model", "") for w in workers}
    return models.pop() if len(models) == 1 else ""
