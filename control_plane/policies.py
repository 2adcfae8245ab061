"""Pull-vs-recompute policies, chosen by name with validated parameters (pure).

Every policy starts from the plan of :func:`.decision.decide` under its own ``safety`` knobs (prefix
check, expiry guard, live source, unclaimed handle, fewest tokens worth a pull): no policy can pull what is unsafe
to pull. They differ in when a safe pull is worth it. After the policy, one rule holds for all
(:func:`plan_turn`): a pull that the cost model predicts to end within ``expiry_guard_s`` of the handle's expiry
(waiting at P included) is refused.

- ``threshold``: pull when at least ``pull_threshold_tokens`` tokens are reusable (vLLM's own rule; the baseline).
- ``cost``: pull unless the learned prefill-time model (:mod:`.cost_model`, shared by all policies and fed
  by every reported turn) predicts recomputing on the chosen prefill worker faster by more than ``recompute_margin``
  (10%): near a tie the pull wins, because it also frees D's blocks at once (an unused handle holds them until it
  expires) and a near-tie prediction is within the model's noise. While a link has
  few measured pulls, and then on one eligible turn in ``explore_every``, it pulls even when the model disagrees
  (within ``explore_ratio``), so it never stops measuring pulls.

  Then, on a turn that could pull, it may **continue on D** (LOCAL; ``continue_on_decode``): ``auto`` when the
  turn's predicted time to first token on D (its queue, the part its prefix cache lacks computed within its batch)
  plus its price to the others (the extra delay it adds to each stream D is decoding, times those streams: the
  latency all of D's users lose) is within ``local_margin`` of the best option on P (its queue included): a tie goes
  to D, which moves no KV over the network and leaves P free; ``always`` on every turn that could pull; ``never`` not
  at all. Either way, never when the extra delay it would add to each of D's streams (the prefill's work inside D's
  batch) exceeds ``decode_itl_slo_ms``, the decode inter-token SLO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvshuttle.control_plane import reasons as why
from kvshuttle.control_plane.cost_model import LocalPrediction, Prediction, PrefillCostModel, PrefillPrior
from kvshuttle.control_plane.decision import Choice, Plan, PullPolicy


class PolicyError(ValueError):
    """A policy name or parameter that is not valid (the message says which and why)."""


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy knows about the chosen workers, besides the safe plan."""

    prefill_worker: str
    source_worker: str = ""  # the decode worker holding the KV ("" without a handle)
    prediction: Prediction | None = None  # both options on the prefill worker (cost model)
    wait_ms: float = 0.0  # predicted wait at the prefill worker before this turn's prefill starts
    expires_in_s: float = 0.0  # the handle's time left
    # the turn continued on the decode worker holding the KV (None: not possible, e.g. that worker is excluded)
    local: LocalPrediction | None = None


@dataclass(frozen=True)
class Outcome:
    """What one planned turn's prefill cost, as the gateway measured it."""

    prefill_worker: str
    prompt_tokens: int
    pulled_tokens: int
    computed_tokens: int
    prefill_ms: float
    decision: Choice
    source_worker: str = ""  # the decode worker P pulled from
    pullable_tokens: int = 0  # a RECOMPUTE's alternative: tokens a safe pull would have loaded (0: none)
    policy: str = ""  # the policy that planned the turn
    cached_estimate: int = 0  # the prefill worker's prefix-cache hit the plan predicted
    decode_worker: str = ""  # LOCAL: the decode worker that served the turn (prefill_ms: its time to first token)
    streams: int = 0  # LOCAL: the streams that decode worker was decoding meanwhile
    model: str = ""  # the turn's model: its workers are priced apart from other models' (cost_model groups)


def demote(plan: Plan, code: str, reason: str) -> Plan:
    return Plan(Choice.RECOMPUTE, reason, plan.prompt_tokens, matched_tokens=plan.matched_tokens,
                pullable_tokens=plan.reusable_tokens, code=code)


class ThresholdPolicy:
    kind = "threshold"

    def __init__(self, pull_threshold_tokens: int = 16, expiry_guard_s: float = 2.0, name: str = "threshold"):
        if pull_threshold_tokens < 1:
            raise PolicyError(f"{name}: pull_threshold_tokens must be >= 1")
        if expiry_guard_s < 0:
            raise PolicyError(f"{name}: expiry_guard_s must be >= 0")
        self.name = name
        self.safety = PullPolicy(pull_threshold_tokens, expiry_guard_s)

    def choose(self, plan: Plan, ctx: PolicyInputs) -> Plan:
        return plan  # decide() already applied the threshold


class CostPolicy:
    kind = "cost"

    def __init__(self, model: PrefillCostModel, expiry_guard_s: float = 2.0, min_pull_tokens: int = 1,
                 explore_every: int = 20, explore_ratio: float = 2.0, warmup_pulls: int = 3,
                 recompute_margin: float = 0.1, name: str = "cost", continue_on_decode: str = "auto",
                 local_margin: float = 0.1, decode_itl_slo_ms: float = 100.0):
        if expiry_guard_s < 0:
            raise PolicyError(f"{name}: expiry_guard_s must be >= 0")
        if min_pull_tokens < 1:
            raise PolicyError(f"{name}: min_pull_tokens must be >= 1")
        if explore_every < 0 or explore_ratio < 1 or warmup_pulls < 0:
            raise PolicyError(f"{name}: explore_every and warmup_pulls must be >= 0, explore_ratio >= 1")
        if not 0 <= recompute_margin < 1:
            raise PolicyError(f"{name}: recompute_margin must be in [0, 1)")
        if continue_on_decode not in LOCAL_MODES:
            raise PolicyError(f"{name}: continue_on_decode must be one of {', '.join(LOCAL_MODES)}, not "
                              f"{continue_on_decode!r}")
        if not 0 <= local_margin < 1:
            raise PolicyError(f"{name}: local_margin must be in [0, 1)")
        if not decode_itl_slo_ms > 0:
            raise PolicyError(f"{name}: decode_itl_slo_ms must be > 0")
        self.continue_on_decode, self.local_margin, self.decode_itl_slo_ms = (continue_on_decode, local_margin,
                                                                              decode_itl_slo_ms)
        self.recompute_margin = recompute_margin
        self.name = name
        self.safety = PullPolicy(min_pull_tokens, expiry_guard_s)
        self.explore_every, self.explore_ratio, self.warmup_pulls = explore_every, explore_ratio, warmup_pulls
        self.model = model
        self._eligible: dict[tuple[str, str], int] = {}

    def choose(self, plan: Plan, ctx: PolicyInputs) -> Plan:
        local = self._local(plan, ctx)
        if local is not None:
            return local
        predicted = ctx.prediction
        if plan.choice is not Choice.PULL or predicted is None or predicted.pull_ms is None:
            return plan
        figures = f"predicted pull {predicted.pull_ms:.1f} ms vs recompute {predicted.recompute_ms:.1f} ms"
        if predicted.recompute_ms >= predicted.pull_ms * (1 - self.recompute_margin):
            plan.reason = f"{plan.reason}; {figures}"
            return plan
        if self._explore(ctx.prefill_worker, ctx.source_worker, predicted):
            plan.reason = f"{plan.reason}; {figures}; pulling anyway to keep measuring this link"
            plan.code = why.PULL_EXPLORE
            return plan
        return demote(plan, why.COST_MODEL, f"cost model: recompute is faster ({figures})")  # by more than the margin

    def _local(self, plan: Plan, ctx: PolicyInputs) -> Plan | None:
        """The plan continued on D, when this policy takes it (see the module docstring); None otherwise (the
        reason for not taking it is added to ``plan.reason`` when D was an option)."""
        local = ctx.local
        if plan.choice is not Choice.PULL or local is None or self.continue_on_decode == NEVER:
            return None
        on_d = (f"continue on {ctx.source_worker}: predicted {local.ms:.1f} ms, {local.cached_tokens} of "
                f"{plan.prompt_tokens} tokens held there")
        if local.streams and local.itl_delay_ms > self.decode_itl_slo_ms:
            plan.reason = (f"{plan.reason}; not continued on D: {local.itl_delay_ms:.1f} ms more per token for its "
                           f"{local.streams} stream(s) would break the {self.decode_itl_slo_ms:g} ms inter-token SLO")
            return None
        if self.continue_on_decode == ALWAYS:
            return continued(plan, local, why.LOCAL_ALWAYS, f"{on_d} (policy {self.name}: whenever it can)")
        predicted = ctx.prediction
        if predicted is None:
            return None
        on_p = ctx.wait_ms + (predicted.best_ms if predicted.pull_ms is not None else predicted.recompute_ms)
        others = local.itl_delay_ms * local.streams  # what D's streams lose, together
        price = f" + {others:.1f} ms to its {local.streams} stream(s)" if local.streams else ""
        if local.ms + others <= on_p * (1 + self.local_margin):
            return continued(plan, local, why.LOCAL_FASTEST, f"{on_d}{price}, vs {on_p:.1f} ms on "
                                                             f"{ctx.prefill_worker}")
        plan.reason = f"{plan.reason}; not continued on D ({local.ms:.1f} ms predicted there{price})"
        return None

    def _explore(self, worker: str, source: str, predicted: Prediction) -> bool:
        if predicted.pull_ms is None or predicted.pull_ms > self.explore_ratio * predicted.recompute_ms:
            return False
        if self.model.pulls_on_link(worker, source) < self.warmup_pulls:
            return True
        key = (worker, source)
        self._eligible[key] = self._eligible.get(key, 0) + 1
        return bool(self.explore_every) and self._eligible[key] % self.explore_every == 0


Policy = ThresholdPolicy | CostPolicy


AUTO, ALWAYS, NEVER = "auto", "always", "never"
LOCAL_MODES = (AUTO, ALWAYS, NEVER)


def continued(plan: Plan, local: LocalPrediction, code: str, reason: str) -> Plan:
    """``plan`` (a safe pull) continued on the decode worker holding the KV: it computes what it does not hold."""
    return Plan(Choice.LOCAL, reason, plan.prompt_tokens, matched_tokens=plan.matched_tokens,
                reusable_tokens=local.cached_tokens, pullable_tokens=plan.reusable_tokens, code=code)


def plan_turn(policy: Policy, plan: Plan, ctx: PolicyInputs) -> Plan:
    """The policy's choice, then the rule for every policy: a pull must end before the handle's expiry guard."""
    plan = policy.choose(plan, ctx)
    if plan.choice is Choice.PULL and ctx.prediction is not None and ctx.prediction.pull_ms is not None:
        ends_in_s = (ctx.wait_ms + ctx.prediction.pull_ms) / 1000
        if ctx.expires_in_s - ends_in_s <= policy.safety.expiry_guard_s:
            return demote(plan, why.WOULD_EXPIRE, f"the pull would end {ends_in_s:.1f}s from now, within "
                                                  f"{policy.safety.expiry_guard_s:g}s of the handle's expiry "
                                                  f"({ctx.expires_in_s:.1f}s left): recompute")
    return plan


class RegretMeter:
    """Per policy: of the turns that had an alternative, how many the alternative would have served faster.

    The alternative's time is the cost model's prediction (it was not run); the taken option's is the measured one.
    """

    def __init__(self) -> None:
        self.turns: dict[str, int] = {}
        self.regrets: dict[str, int] = {}

    def record(self, outcome: Outcome, model: PrefillCostModel) -> bool | None:
        """Count ``outcome`` (judged by ``model`` before it learns from it); None when it had no alternative."""
        if outcome.decision is Choice.LOCAL:  # the pull the turn could have made instead, on the plan's P
            alternative = model.predict(outcome.prefill_worker, prompt_tokens=outcome.prompt_tokens,
                                        reusable_tokens=outcome.pullable_tokens,
                                        source=outcome.decode_worker).best_ms
        elif outcome.decision is Choice.PULL:
            alternative = model.compute_ms(outcome.prefill_worker, outcome.prompt_tokens, outcome.prompt_tokens)
        elif outcome.pullable_tokens > 0:
            alternative = model.predict(outcome.prefill_worker, prompt_tokens=outcome.prompt_tokens,
                                        reusable_tokens=outcome.pullable_tokens,
                                        source=outcome.source_worker).pull_ms
        else:
            return None
        regret = alternative is not None and alternative < outcome.prefill_ms
        name = outcome.policy or "?"
        self.turns[name] = self.turns.get(name, 0) + 1
        self.regrets[name] = self.regrets.get(name, 0) + int(regret)
        return regret

    def regret(self, policy: str) -> float | None:
        turns = self.turns.get(policy, 0)
        return self.regrets.get(policy, 0) / turns if turns else None


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


def _number(name: str, params: dict[str, str], key: str, kind: type):
    raw = params.pop(key)
    try:
        return kind(raw)
    except ValueError:
        raise PolicyError(f"{name}: {key}={raw!r} is not a{'n' if kind is int else ''} {kind.__name__}") from None


def make_prior(params: Mapping[str, str] | None) -> PrefillPrior:
    """The cost model's priors and fitting settings from ``key=value`` text (--cost-model-params)."""
    params = dict(params or {})
    values = {key: _number("cost model", params, key, int if _PRIOR_FIELDS[key] == "int" else float)
              for key in list(params) if key in _PRIOR_FIELDS}
    if params:
        raise PolicyError(f"cost model: unknown parameter(s) {', '.join(sorted(params))}; "
                          f"known: {', '.join(_PRIOR_FIELDS)}")
    try:
        return PrefillPrior(**values)
    except ValueError as exc:
        raise PolicyError(f"cost model: {exc}") from None


KINDS = {ThresholdPolicy.kind: ("pull_threshold_tokens",),
         CostPolicy.kind: ("min_pull_tokens", "explore_every", "explore_ratio", "warmup_pulls", "recompute_margin",
                           "continue_on_decode", "local_margin", "decode_itl_slo_ms")}
_FLOAT_PARAMS = ("explore_ratio", "recompute_margin", "local_margin", "decode_itl_slo_ms")
_TEXT_PARAMS = ("continue_on_decode",)


def make_policy(kind: str, params: Mapping[str, str] | None = None, *, model: PrefillCostModel,
                expiry_guard_s: float = 2.0, name: str = "", decode_itl_slo_ms: float | None = None) -> Policy:
    """The policy of ``kind`` with its parameters, validated; unknown kinds or keys are errors.
    ``decode_itl_slo_ms``: the scheduler's decode inter-token SLO (a cost policy's default for it)."""
    params = dict(params or {})
    name = name or kind
    if kind not in KINDS:
        raise PolicyError(f"unknown policy {kind!r}; choose one of {', '.join(KINDS)}")
    kwargs: dict = {"expiry_guard_s": expiry_guard_s, "name": name}
    if kind == CostPolicy.kind and decode_itl_slo_ms is not None:
        kwargs["decode_itl_slo_ms"] = decode_itl_slo_ms
    for key in KINDS[kind]:
        if key in params and key in _TEXT_PARAMS:
            kwargs[key] = params.pop(key)
        elif key in params:
            kwargs[key] = _number(name, params, key, float if key in _FLOAT_PARAMS else int)
    if "expiry_guard_s" in params:
        kwargs["expiry_guard_s"] = _number(name, params, "expiry_guard_s", float)
    if params:
        raise PolicyError(f"{name}: unknown parameter(s) {', '.join(sorted(params))}; "
                          f"known: {', '.join(KINDS[kind] + ('expiry_guard_s',))}")
    if kind == ThresholdPolicy.kind:
        return ThresholdPolicy(**kwargs)
    return CostPolicy(model, **kwargs)


def parse_policy_specs(text: str) -> list[tuple[str, str, dict[str, str]]]:
    """``"t64=threshold:pull_threshold_tokens=64; cost=cost"`` → ``[(name, kind, params), ...]``."""
    out = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, rest = spec.partition("=")
        kind, _, params = rest.partition(":")
        name, kind = name.strip(), kind.strip()
        if not sep or not name or not kind:
            raise PolicyError(f"policy spec {spec!r} is not name=kind[:key=value,...]")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise PolicyError(f"policy name {name!r}: use letters, digits, - and _")
        out.append((name, kind, parse_params(params)))
    return out
