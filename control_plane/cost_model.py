"""Predicted prefill time of a turn's options, learned online from measured turns (pure; issue #4, first part).

A prefill worker's time for a turn is modelled as linear in four features::

    prefill_ms ≈ fixed + a·computed + b·computed·context + c·pulled + d·[pulled > 0]

``computed`` tokens P computes itself (attention over ``context`` tokens makes it super-linear), ``pulled`` tokens
it loads over NIXL (bandwidth), and a fixed cost per transfer (connection, D's side). The weights start from priors
(configurable) and are fitted per worker by recursive least squares with exponential forgetting; a turn the model
mispredicts badly (a slower link, a loaded node) resets its confidence, so the change shows within a few turns. Features that a worker never exercised (e.g. it never pulled)
keep their priors: their uncertainty is capped, not left to grow without bound.

Predicting both options of a turn from the same model is what lets the scheduler choose PULL or RECOMPUTE by
predicted time instead of a fixed token threshold. Not yet used by the scheduler (next increment of #4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FEATURES = ("fixed_ms", "ms_per_ktoken", "ms_per_ktoken_per_kcontext", "ms_per_kpulled", "ms_per_transfer")


def features(computed: int, context: int, pulled: int) -> list[float]:
    """The model's inputs, scaled to similar magnitudes (thousands of tokens)."""
    k = computed / 1000
    return [1.0, k, k * context / 1000, pulled / 1000, 1.0 if pulled > 0 else 0.0]


@dataclass(frozen=True)
class PrefillPrior:
    """Weights before any measurement (one per feature, in FEATURES order), and how sure we are of them."""

    fixed_ms: float = 10.0
    ms_per_ktoken: float = 100.0
    ms_per_ktoken_per_kcontext: float = 10.0
    ms_per_kpulled: float = 2.0
    ms_per_transfer: float = 5.0
    variance: float = 1e4  # prior variance of each weight; also the cap on its uncertainty

    def weights(self) -> list[float]:
        return [self.fixed_ms, self.ms_per_ktoken, self.ms_per_ktoken_per_kcontext, self.ms_per_kpulled,
                self.ms_per_transfer]


class RecursiveLeastSquares:
    """y ≈ θ·x fitted online; ``forgetting`` < 1 weighs recent observations more (memory ≈ 1/(1-forgetting))."""

    def __init__(self, prior: Sequence[float], variance: float, forgetting: float = 0.95,
                 surprise: float = 0.3):
        if not 0 < forgetting <= 1:
            raise ValueError("forgetting must be in (0, 1]")
        self.surprise = surprise  # a relative error above this means the world changed: forget what we knew
        self.theta = [float(w) for w in prior]
        n = len(self.theta)
        self.cov = [[variance if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.cap = variance
        self.forgetting = forgetting
        self.observations = 0

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def update(self, x: Sequence[float], y: float) -> None:
        n = len(self.theta)
        if self.observations and abs(y - self.predict(x)) > self.surprise * max(abs(y), 1.0):
            self.cov = [[self.cap if i == j else 0.0 for j in range(n)] for i in range(n)]  # keep θ, doubt it
        px = [sum(self.cov[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self.forgetting + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        error = y - self.predict(x)
        self.theta = [t + g * error for t, g in zip(self.theta, gain, strict=True)]
        for i in range(n):
            for j in range(n):
                self.cov[i][j] = (self.cov[i][j] - gain[i] * px[j]) / self.forgetting
        for i in range(n):  # bounded uncertainty: directions that are never excited must not blow up
            if self.cov[i][i] > self.cap:
                scale = (self.cap / self.cov[i][i]) ** 0.5
                for j in range(n):
                    self.cov[i][j] *= scale
                    self.cov[j][i] *= scale
        self.observations += 1


@dataclass(frozen=True)
class Prediction:
    pull_ms: float | None  # None: no pull possible
    recompute_ms: float

    @property
    def pull_is_faster(self) -> bool:
        return self.pull_ms is not None and self.pull_ms < self.recompute_ms


class PrefillCostModel:
    """One fitted model per prefill worker; a worker not seen yet predicts from the priors."""

    def __init__(self, prior: PrefillPrior | None = None, forgetting: float = 0.95):
        self.prior = prior or PrefillPrior()
        self.forgetting = forgetting
        self._models: dict[str, RecursiveLeastSquares] = {}

    def _model(self, worker: str) -> RecursiveLeastSquares:
        model = self._models.get(worker)
        if model is None:
            model = self._models[worker] = RecursiveLeastSquares(self.prior.weights(), self.prior.variance,
                                                                 self.forgetting)
        return model

    def observe(self, worker: str, *, prompt_tokens: int, computed_tokens: int, pulled_tokens: int,
                prefill_ms: float) -> None:
        """A measured turn on ``worker``: how many prompt tokens it computed and pulled, and how long it took."""
        if prompt_tokens <= 0 or computed_tokens < 0 or pulled_tokens < 0 or prefill_ms < 0:
            raise ValueError("token counts and time must be non-negative, and the prompt non-empty")
        self._model(worker).update(features(computed_tokens, prompt_tokens, pulled_tokens), prefill_ms)

    def predict_ms(self, worker: str, *, prompt_tokens: int, computed_tokens: int, pulled_tokens: int) -> float:
        model = self._models.get(worker) or RecursiveLeastSquares(self.prior.weights(), self.prior.variance)
        return max(0.0, model.predict(features(computed_tokens, prompt_tokens, pulled_tokens)))

    def predict(self, worker: str, *, prompt_tokens: int, reusable_tokens: int, cached_tokens: int = 0,
                ) -> Prediction:
        """Both options of a turn on ``worker``: PULL (load ``reusable_tokens``, compute the rest) or RECOMPUTE
        (compute all but the ``cached_tokens`` P already holds in its own prefix cache)."""
        recompute = self.predict_ms(worker, prompt_tokens=prompt_tokens,
                                    computed_tokens=prompt_tokens - cached_tokens, pulled_tokens=0)
        if reusable_tokens <= 0:
            return Prediction(None, recompute)
        pulled = max(0, reusable_tokens - cached_tokens)  # P loads only what it does not hold
        computed = prompt_tokens - max(reusable_tokens, cached_tokens)
        pull = self.predict_ms(worker, prompt_tokens=prompt_tokens, computed_tokens=computed, pulled_tokens=pulled)
        return Prediction(pull, recompute)

    def observations(self, worker: str) -> int:
        model = self._models.get(worker)
        return model.observations if model else 0
