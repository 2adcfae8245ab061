"""Pull-vs-recompute policies, chosen by name with validated parameters (pure).

Every policy first applies the safety rules of :func:`control_plane.decision.decide` (prefix check, expiry guard,
live source, unclaimed handle): no policy can pull what is unsafe to pull. They differ in when a safe pull is worth it.

- ``threshold``: pull when at least ``pull_threshold_tokens`` tokens are reusable (vLLM's own rule; the baseline).
- ``cost`` (experimental): pull when the learned prefill-time model (:mod:`control_plane.cost_model`) predicts the
  pull faster than recomputing on the chosen prefill worker; the model learns from each turn's reported outcome, and
  keeps pulling now and then so it never stops measuring pulls. Not yet reliable enough to be the default: with few,
  noisy measurements of correlated features its fit can extrapolate badly and recompute where a pull is faster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from control_plane.cost_model import Prediction, PrefillCostModel, PrefillPrior
from control_plane.decision import Choice, HandleView, Plan, PullPolicy, decide


class PolicyError(ValueError):
    """A policy name or parameter that is not valid (the message says which and why)."""


@dataclass(frozen=True)
class Outcome:
    """What one planned turn's prefill cost, as the gateway measured it."""

    prefill_worker: str
    prompt_tokens: int
    pulled_tokens: int
    computed_tokens: int
    prefill_ms: float
    decision: Choice


class ThresholdPolicy:
    name = "threshold"

    def __init__(self, pull_threshold_tokens: int = 16, expiry_guard_s: float = 2.0):
        if pull_threshold_tokens < 1:
            raise PolicyError("threshold: pull_threshold_tokens must be >= 1")
        if expiry_guard_s < 0:
            raise PolicyError("threshold: expiry_guard_s must be >= 0")
        self.safety = PullPolicy(pull_threshold_tokens, expiry_guard_s)

    def plan(self, prompt: Sequence[int], handle: HandleView | None, *, prefill_worker: str,
             disable_pull: bool = False) -> tuple[Plan, Prediction | None]:
        return decide(prompt, handle, self.safety, disable_pull=disable_pull), None

    def observe(self, outcome: Outcome) -> None:
        pass


class CostPolicy:
    name = "cost"

    def __init__(self, expiry_guard_s: float = 2.0, min_pull_tokens: int = 1, forgetting: float = 0.95,
                 prior: PrefillPrior | None = None, explore_every: int = 10, explore_ratio: float = 2.0,
                 warmup_pulls: int = 5):
        if expiry_guard_s < 0:
            raise PolicyError("cost: expiry_guard_s must be >= 0")
        if min_pull_tokens < 1:
            raise PolicyError("cost: min_pull_tokens must be >= 1")
        if not 0 < forgetting <= 1:
            raise PolicyError("cost: forgetting must be in (0, 1]")
        if explore_every < 0 or explore_ratio < 1 or warmup_pulls < 0:
            raise PolicyError("cost: explore_every and warmup_pulls must be >= 0, explore_ratio >= 1")
        self.safety = PullPolicy(min_pull_tokens, expiry_guard_s)
        # A model that stops pulling stops learning what pulls cost: pull anyway while a worker has fewer than
        # warmup_pulls measured pulls, and then one eligible turn in explore_every, when the pull is predicted at
        # most explore_ratio times slower than the recompute.
        self.explore_every, self.explore_ratio, self.warmup_pulls = explore_every, explore_ratio, warmup_pulls
        self._pulls_seen: dict[str, int] = {}
        self._eligible: dict[str, int] = {}
        self.model = PrefillCostModel(prior, forgetting)
        self.turns = 0
        self.regrets = 0

    def plan(self, prompt: Sequence[int], handle: HandleView | None, *, prefill_worker: str,
             disable_pull: bool = False) -> tuple[Plan, Prediction | None]:
        plan = decide(prompt, handle, self.safety, disable_pull=disable_pull)
        if plan.choice is not Choice.PULL:
            return plan, None
        predicted = self.model.predict(prefill_worker, prompt_tokens=len(prompt), reusable_tokens=plan.reusable_tokens)
        figures = f"predicted pull {predicted.pull_ms:.1f} ms vs recompute {predicted.recompute_ms:.1f} ms"
        if predicted.pull_is_faster:
            plan.reason = f"{plan.reason}; {figures}"
            return plan, predicted
        if self._explore(prefill_worker, predicted):
            plan.reason = f"{plan.reason}; {figures}; pulling anyway to keep measuring pulls"
            return plan, predicted
        return Plan(Choice.RECOMPUTE, f"cost model: recompute is faster ({figures})", plan.prompt_tokens,
                    matched_tokens=plan.matched_tokens), predicted

    def _explore(self, worker: str, predicted: Prediction) -> bool:
        if predicted.pull_ms is None or predicted.pull_ms > self.explore_ratio * predicted.recompute_ms:
            return False
        if self._pulls_seen.get(worker, 0) < self.warmup_pulls:
            return True
        self._eligible[worker] = self._eligible.get(worker, 0) + 1
        return bool(self.explore_every) and self._eligible[worker] % self.explore_every == 0

    def observe(self, outcome: Outcome) -> None:
        """Learn from a turn, and count it as a regret when the option not taken now looks faster than what the
        taken one cost (judged by the model as it stands after this turn)."""
        self.model.observe(outcome.prefill_worker, prompt_tokens=outcome.prompt_tokens,
                           computed_tokens=outcome.computed_tokens, pulled_tokens=outcome.pulled_tokens,
                           prefill_ms=outcome.prefill_ms)
        self.turns += 1
        if outcome.decision is Choice.PULL and outcome.pulled_tokens > 0:
            self._pulls_seen[outcome.prefill_worker] = self._pulls_seen.get(outcome.prefill_worker, 0) + 1
        if outcome.decision is Choice.PULL:
            other = self.model.predict_ms(outcome.prefill_worker, prompt_tokens=outcome.prompt_tokens,
                                          computed_tokens=outcome.prompt_tokens, pulled_tokens=0)
        else:
            return  # a recompute's alternative needs the reusable tokens, which the outcome does not carry
        self.regrets += int(other < outcome.prefill_ms)

    @property
    def regret(self) -> float | None:
        """Share of the observed pulls that the model now thinks recomputing would have beaten."""
        return self.regrets / self.turns if self.turns else None


Policy = ThresholdPolicy | CostPolicy
POLICIES: dict[str, type] = {ThresholdPolicy.name: ThresholdPolicy, CostPolicy.name: CostPolicy}
_PRIOR_FIELDS = {f.name: f.type for f in fields(PrefillPrior)}


def parse_params(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` → ``{"a": "1", "b": "2"}`` (the --policy-params syntax)."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise PolicyError(f"policy parameter {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def make_policy(name: str, params: Mapping[str, str] | None = None, *, expiry_guard_s: float = 2.0) -> Policy:
    """The policy called ``name`` with its parameters, validated; unknown names or keys are errors."""
    params = dict(params or {})
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")

    def number(key: str, kind: type):
        raw = params.pop(key)
        try:
            return kind(raw)
        except ValueError:
            raise PolicyError(f"{name}: {key}={raw!r} is not a {kind.__name__}") from None

    if name == ThresholdPolicy.name:
        kwargs = {"expiry_guard_s": expiry_guard_s}
        if "pull_threshold_tokens" in params:
            kwargs["pull_threshold_tokens"] = number("pull_threshold_tokens", int)
        policy: Policy = ThresholdPolicy(**kwargs)
    else:
        kwargs = {"expiry_guard_s": expiry_guard_s}
        for key, kind in (("min_pull_tokens", int), ("forgetting", float), ("explore_every", int),
                          ("explore_ratio", float), ("warmup_pulls", int)):
            if key in params:
                kwargs[key] = number(key, kind)
        prior = {key: number(key, float) for key in list(params) if key in _PRIOR_FIELDS}
        policy = CostPolicy(prior=PrefillPrior(**prior), **kwargs)
    if params:
        raise PolicyError(f"{name}: unknown parameter(s) {', '.join(sorted(params))}")
    return policy
