"""Predicted prefill time of a turn's options, learned online from measured turns (pure).

A prefill worker P's time for a turn is modelled in two parts, each fitted separately::

    compute_ms(P)      ≈ fixed + a·computed + b·computed·context        (per prefill worker)
    transfer_ms(P, D)  ≈ latency + c·pulled                             (per link: P pulling from decode worker D)

    RECOMPUTE ≈ compute_ms(prompt − P's own prefix-cache hit)
    PULL      ≈ compute_ms(the new tokens) + transfer_ms(the reusable tokens)

A turn continued on the decode worker D that holds the session's KV (LOCAL) is modelled per decode worker::

    local_ms(D)        ≈ fixed + a·computed + b·computed·context + s·streams          (per decode worker)
    itl_delay_ms(D)    ≈ a·computed + b·computed·context

``computed`` is what D's prefix cache does not hold; ``streams`` the requests D is decoding meanwhile (its batch: each
step of the prefill also decodes them). ``itl_delay_ms`` is the prefill's own work, inserted into D's batch: the extra
wait every one of D's streams sees for its next token (an upper bound when vLLM splits the prefill into chunks).
Until D has served local turns, it is priced with the fleet's compute fit (decode and prefill workers run the same
model on the same hardware) plus the ``ms_per_decode_stream`` prior.

``computed`` tokens P computes itself (attention over ``context`` tokens makes it super-linear); ``pulled`` tokens it
loads over NIXL. The compute part is fitted from turns that pulled nothing (every conversation's first turn is one);
the transfer part from pulls, as what the compute part does not explain. Fitting them apart keeps each fit small and
well-conditioned: a joint fit of correlated features (pull turns compute few tokens of a long context) extrapolated
badly in practice.

Each fit is a non-negative least-squares fit by relative error over recent observations, kept per size class (powers
of two of the tokens computed or pulled: the last ``window`` of each), so what a worker did an hour ago at another
size still pins down the fixed part while recent turns of today's sizes dominate their own class (weights halve every
``half_life`` observations within a class and every ``memory`` observations overall). It is pulled gently toward the
configured priors, so a worker
predicts from the priors until data arrives and never learns a negative cost. When the last few observations are all
far off in the same direction, the world changed (a slower link, a loaded node): older observations are dropped, so
the change shows within a few turns.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

R = TypeVar("R")


def compute_features(computed: int, context: int) -> list[float]:
    """Inputs of the compute fit, scaled to thousands of tokens."""
    k = computed / 1000
    return [1.0, k, k * context / 1000]


def transfer_features(pulled: int) -> list[float]:
    return [1.0, pulled / 1000]


def local_features(computed: int, context: int, streams: int) -> list[float]:
    """Inputs of a decode worker's local fit: the compute fit's, and the streams it decodes meanwhile."""
    return [*compute_features(computed, context), float(streams)]


@dataclass(frozen=True)
class PrefillPrior:
    """What the model assumes before measuring, and how it weighs and forgets measurements."""

    fixed_ms: float = 10.0  # per prefill call
    ms_per_ktoken: float = 100.0  # per thousand computed tokens
    ms_per_ktoken_per_kcontext: float = 10.0  # attention: per thousand computed tokens per thousand of context
    ms_per_transfer: float = 5.0  # per pull (connection, D's side, notification)
    ms_per_kpulled: float = 2.0  # per thousand pulled tokens
    ms_per_decode_stream: float = 1.0  # a turn continued on D: per stream D decodes meanwhile (its batch's step)
    prior_weight: float = 0.05  # the priors' weight, in observations (small: measurements take over fast)
    window: int = 8  # observations kept per size class (tokens computed, or pulled, by powers of two)
    half_life: float = 4.0  # newer observations of a size class after which an observation's weight has halved
    memory: float = 100.0  # observations of any size after which an observation's weight has halved
    surprise: float = 0.3  # relative error that counts as "far off"
    change_after: int = 3  # this many far-off observations in a row, same direction: forget older ones

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "ms_per_ktoken", "ms_per_ktoken_per_kcontext", "ms_per_transfer", "ms_per_kpulled",
                     "ms_per_decode_stream"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if (self.prior_weight <= 0 or self.window < 2 or self.half_life <= 0 or self.memory <= 0
                or self.surprise <= 0):
            raise ValueError("prior_weight, half_life, memory and surprise must be > 0, window >= 2")
        if self.change_after < 1:
            raise ValueError("change_after must be >= 1")

    def compute(self) -> list[float]:
        return [self.fixed_ms, self.ms_per_ktoken, self.ms_per_ktoken_per_kcontext]

    def transfer(self) -> list[float]:
        return [self.ms_per_transfer, self.ms_per_kpulled]

    def local(self) -> list[float]:
        return [*self.compute(), self.ms_per_decode_stream]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for the tiny systems here; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nonnegative_least_squares(a: list[list[float]], b: list[float]) -> list[float]:
    """argmin θᵀAθ − 2bᵀθ subject to θ ≥ 0, for a positive-definite ``a`` of a few dimensions.

    The minimum is unique (a strictly convex objective), and a θ is it exactly when it meets the KKT conditions: on
    its free weights the unconstrained minimum of that sub-problem, ≥ 0, and on the weights held at 0 a gradient
    ``(Aθ − b)_i ≥ 0`` (lowering the objective would need θ_i < 0). So the free sets are tried from the largest down
    and the first that meets them is the answer (usually among the first few of the 2ⁿ − 1 sets)."""
    n = len(b)
    whole = _solve(a, b)
    if whole is not None and min(whole) >= 0:
        return whole  # the unconstrained minimum is feasible, hence the constrained one (the usual case)
    for size in range(n - 1, 0, -1):
        for free in itertools.combinations(range(n), size):
            theta = _free_minimum(a, b, free)
            if theta is not None and all(_gradient_ok(sum(a[i][j] * theta[j] for j in free), b[i])
                                         for i in range(n) if i not in free):
                return theta
    if all(v <= 0 for v in b):
        return [0.0] * n  # every weight held at 0: the gradient there (−b) points nowhere lower
    return _least_of_every_set(a, b)  # rounding hid the KKT point: the exhaustive search


def _free_minimum(a: list[list[float]], b: list[float], free: Sequence[int]) -> list[float] | None:
    """The minimum with only the ``free`` weights free (the others 0); None when it is not ≥ 0 or the sub-problem is
    singular."""
    sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
    if sub is None or min(sub) < 0:
        return None
    theta = [0.0] * len(b)
    for i, v in zip(free, sub, strict=True):
        theta[i] = v
    return theta


def _gradient_ok(a_theta: float, b: float) -> bool:
    """``(Aθ)_i − b_i ≥ 0`` up to rounding (a weight at the bound's gradient is 0 there, give or take an ulp)."""
    return a_theta - b >= -1e-9 * (abs(a_theta) + abs(b))


def _least_of_every_set(a: list[list[float]], b: list[float]) -> list[float]:
    n = len(b)
    best, best_value = [0.0] * n, 0.0
    for size in range(1, n + 1):
        for free in itertools.combinations(range(n), size):
            theta = _free_minimum(a, b, free)
            if theta is None:
                continue
            value = sum(theta[i] * a[i][j] * theta[j] for i in range(n) for j in range(n)) - 2 * sum(
                t * v for t, v in zip(theta, b, strict=True))
            if value < best_value:
                best, best_value = theta, value
    return best


class RecentFit(Generic[R]):
    """y ≈ θ·x, θ ≥ 0, fitted to recent observations of every size class, with the priors as a weak extra
    observation per weight.

    Observations are kept as records with their ``(x, y, measured ms)`` from ``to_xy``; a fit whose target depends on
    another fit (a link's transfer time is what the compute fit leaves unexplained) is refitted with ``fresh=True``
    when that fit changed, which recomputes them, so it stays consistent. ``size_of(record)`` gives the tokens that
    decide its size class.
    """

    def __init__(self, prior: Sequence[float], settings: PrefillPrior,
                 to_xy: Callable[[R], tuple[Sequence[float], float, float]], size_of: Callable[[R], int]):
        self.prior = [float(w) for w in prior]
        self.settings = settings
        self.to_xy = to_xy
        self.size_of = size_of
        # size class -> (observation index, record, its (x, y, measured)), oldest first
        self._classes: dict[int, deque[tuple[int, R, tuple]]] = {}
        self._recent: deque[tuple[int, int, R, tuple]] = deque(maxlen=settings.change_after)  # (class, index, ...)
        self.theta = list(self.prior)
        self.observations = 0
        self.changes = 0  # times a change was detected and older observations dropped
        self._streak = 0  # far-off observations in a row, signed by direction

    @property
    def records(self) -> list[R]:
        return [r for kept in self._classes.values() for _, r, _ in kept]

    def state(self) -> dict:
        """What the fit learned, JSON-friendly: θ, its counters, and the kept observations (records are
        :class:`Turn`) in order, each with the ``(x, y, measured)`` it was last fitted with, as cached (a link fit's
        depend on the compute fit of when they were computed, so they are kept, not recomputed). Not the priors,
        the settings, ``to_xy`` or ``size_of``: whoever makes the fit supplies those."""
        return {
            "theta": list(self.theta),
            "observations": self.observations,
            "changes": self.changes,
            "streak": self._streak,
            "classes": [[size_class, [[index, _turn_out(r), _xy_out(xy)] for index, r, xy in kept]]
                        for size_class, kept in self._classes.items()],
            "recent": [[size_class, index, _turn_out(r), _xy_out(xy)] for size_class, index, r, xy in self._recent],
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace what the fit learned with ``state`` (from :meth:`state`, JSON round-trip included), exactly.

        ValueError when it is malformed, or keeps more observations than these settings do (``window`` per size
        class, ``change_after`` recent ones); nothing changes then."""
        n, window, recent_len = len(self.prior), self.settings.window, self.settings.change_after
        with _malformed("cost fit"):
            state = _mapping(state, "fit")
            theta = [_number(v, "theta") for v in _list(state["theta"], "theta", length=n)]
            observations = _int(state["observations"], "observations", low=0)
            changes = _int(state["changes"], "changes", low=0)
            streak = _int(state["streak"], "streak")
            classes: dict[int, deque[tuple[int, Turn, tuple]]] = {}
            for item in _list(state["classes"], "classes"):
                size_class, entries = _list(item, "size class", length=2)
                size_class = _int(size_class, "size class", low=0)
                if size_class in classes:
                    raise ValueError(f"size class {size_class} appears twice")
                entries = _list(entries, "size class entries", longest=window)
                classes[size_class] = deque(
                    ((_index(i, observations), _turn_in(r), _xy_in(xy, n))
                     for i, r, xy in (_list(e, "kept observation", length=3) for e in entries)), maxlen=window)
            recent: deque[tuple[int, int, Turn, tuple]] = deque(maxlen=recent_len)
            for entry in _list(state["recent"], "recent", longest=recent_len):
                size_class, i, r, xy = _list(entry, "recent observation", length=4)
                recent.append((_int(size_class, "size class", low=0), _index(i, observations), _turn_in(r),
                               _xy_in(xy, n)))
        self.theta, self.observations, self.changes, self._streak = theta, observations, changes, streak
        self._classes, self._recent = classes, recent

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def add(self, record: R) -> None:
        xy = self.to_xy(record)
        x, y, measured = xy
        error = (y - self.predict(x)) / max(measured, 1.0)
        if self.observations and abs(error) > self.settings.surprise:
            sign = 1 if error > 0 else -1
            self._streak = self._streak + sign if self._streak * sign > 0 else sign
        else:
            self._streak = 0
        size_class = max(0, self.size_of(record)).bit_length()
        kept = self._classes.setdefault(size_class, deque(maxlen=self.settings.window))
        kept.append((self.observations, record, xy))
        self._recent.append((size_class, self.observations, record, xy))
        self.observations += 1
        streak = abs(self._streak)
        if streak >= self.settings.change_after and sum(map(len, self._classes.values())) > streak:
            self._classes.clear()  # the world changed: keep only the observations that showed it
            for cls, index, rec, rec_xy in list(self._recent)[-streak:]:
                self._classes.setdefault(cls, deque(maxlen=self.settings.window)).append((index, rec, rec_xy))
            self.changes += 1
            self._streak = 0
        self.refit()

    def refit(self, fresh: bool = False) -> None:
        """Fit θ to the kept observations by relative error (a 10 ms turn counts as much as a 1 s one), newest
        weighted most. The priors act as ``prior_weight`` of one extra observation of typical size, so they decide
        only what the data cannot (e.g. a feature that never varied). ``fresh``: recompute every observation's
        ``(x, y)`` first (the fit it depends on changed)."""
        if fresh:
            for size_class, kept in self._classes.items():
                self._classes[size_class] = deque(((i, r, self.to_xy(r)) for i, r, _ in kept), maxlen=kept.maxlen)
        n = len(self.prior)
        in_class = 0.5 ** (1 / self.settings.half_life)
        overall = 0.5 ** (1 / self.settings.memory)
        last = self.observations - 1
        rows = [(xy, in_class**rank * overall ** (last - index))
                for kept in self._classes.values()
                for rank, (index, _, xy) in enumerate(reversed(kept))]
        if not rows:
            self.theta = list(self.prior)
            return
        total = sum(w for _, w in rows)
        typical_ms = max(sum(w * m for (_, _, m), w in rows) / total, 1.0)
        typical_x = [max(sum(w * abs(x[j]) for (x, _, _), w in rows) / total, 1e-3) for j in range(n)]
        lam = self.settings.prior_weight
        a = [[0.0] * n for _ in range(n)]
        b = [0.0] * n
        for j in range(n):
            weight = lam * (typical_x[j] / typical_ms) ** 2
            a[j][j] += weight
            b[j] += weight * self.prior[j]
        for (x, y, measured), w in rows:
            w /= max(measured, 1.0) ** 2
            for i in range(n):
                b[i] += w * x[i] * y
                for j in range(n):
                    a[i][j] += w * x[i] * x[j]
        self.theta = nonnegative_least_squares(a, b)


@dataclass(frozen=True)
class Prediction:
    pull_ms: float | None  # None: no pull possible
    recompute_ms: float

    @property
    def pull_is_faster(self) -> bool:
        return self.pull_ms is not None and self.pull_ms < self.recompute_ms

    @property
    def best_ms(self) -> float:
        return min(self.recompute_ms, self.pull_ms) if self.pull_ms is not None else self.recompute_ms


@dataclass(frozen=True)
class LocalPrediction:
    """A turn continued on the decode worker holding its KV."""

    ms: float  # its time to the first token: D's queue, then the uncached part computed within D's batch
    itl_delay_ms: float  # the extra wait for the next token of each stream D is decoding meanwhile
    streams: int  # the streams D is decoding (running and assigned)
    cached_tokens: int  # prompt tokens D's prefix cache is predicted to hold (the session's held KV)


@dataclass(frozen=True)
class Turn:
    computed: int
    context: int
    pulled: int
    ms: float
    streams: int = 0  # a local turn: the streams its decode worker decoded meanwhile


class PrefillCostModel:
    """Compute fits per prefill worker and transfer fits per (prefill, decode) link; unseen ones use the priors.

    Workers come in groups (``group``: the model they serve; "" when none is named): a worker or link not measured yet
    predicts from the most-measured one of its own group, never another model's (a 135M model's workers and a 7B
    model's cost differently)."""

    def __init__(self, prior: PrefillPrior | None = None):
        self.prior = prior or PrefillPrior()
        self._compute: dict[str, RecentFit[Turn]] = {}
        self._links: dict[tuple[str, str], RecentFit[Turn]] = {}
        self._stale: set[tuple[str, str]] = set()  # links to refit: their worker's compute fit changed
        self._group_of: dict[str, str] = {}  # worker -> its group, as its observations named it ("" left out)
        # The most-measured fits of each group (what a worker or link not measured yet predicts from), kept as they
        # change so a prediction costs the same with 2 workers or 1,000 (observation counts only grow).
        self._most_measured: dict[str, str] = {}
        self._most_link: dict[str, tuple[str, str]] = {}
        self._most_link_of: dict[str, tuple[str, str]] = {}
        self._links_of: dict[str, set[tuple[str, str]]] = {}  # worker -> its links (for the stale marks)
        self._local: dict[str, RecentFit[Turn]] = {}  # decode worker -> its fit of turns continued on it
        self._most_local: dict[str, str] = {}

    def _compute_fit(self, worker: str, group: str = "") -> RecentFit[Turn] | None:
        """The worker's fit; for a worker not measured yet, the most-measured one's of its group (workers of a
        fleet's model are alike, and comparing one worker's measurements with another's priors would pick
        whichever guess is lower)."""
        fit = self._compute.get(worker)
        if fit is None:
            most = self._most_measured.get(group)
            if most is not None:
                fit = self._compute[most]
        return fit

    def compute_ms(self, worker: str, computed: int, context: int, group: str = "") -> float:
        fit = self._compute_fit(worker, group)
        fixed, per_k, per_k_kctx = fit.theta if fit else self.prior.compute()
        k = computed / 1000  # compute_features, inlined: the planner prices every candidate worker with it
        return fixed + per_k * k + per_k_kctx * k * context / 1000

    def transfer_ms(self, worker: str, source: str, pulled: int, group: str = "") -> float:
        fit = self._link_fit(worker, source, group)
        fixed, per_k = fit.theta if fit else self.prior.transfer()
        return fixed + per_k * pulled / 1000  # transfer_features, inlined

    def _link_fit(self, worker: str, source: str, group: str = "") -> RecentFit[Turn] | None:
        """The link's fit; for a link never used, the most-measured link of the same P, else of any P of the
        group."""
        key = (worker, source)
        if key not in self._links:
            key = self._most_link_of.get(worker) or self._most_link.get(group)
            if key is None:
                return None
        if key in self._stale:
            self._links[key].refit(fresh=True)
            self._stale.discard(key)
        return self._links[key]

    def observe(self, worker: str, *, prompt_tokens: int, computed_tokens: int, pulled_tokens: int,
                prefill_ms: float, source: str = "", group: str = "") -> None:
        """A measured turn on ``worker`` (of ``group``): tokens it computed and pulled (from ``source``), and how long
        it took."""
        if prompt_tokens <= 0 or computed_tokens < 0 or pulled_tokens < 0 or prefill_ms < 0:
            raise ValueError("token counts and time must be non-negative, and the prompt non-empty")
        self._note_group(worker, group)
        turn = Turn(computed_tokens, prompt_tokens, pulled_tokens, prefill_ms)
        if pulled_tokens == 0:
            fit = self._compute.get(worker)
            if fit is None:
                fit = self._compute[worker] = self._new_compute_fit()
            fit.add(turn)
            most = self._compute.get(self._most_measured.get(group, ""))
            if most is None or fit.observations > most.observations:
                self._most_measured[group] = worker
            self._stale.update(self._links_of.get(worker, ()))
            return
        key = (worker, source)
        fit = self._links.get(key)
        if fit is None:
            fit = self._links[key] = self._new_link_fit(worker)
            self._links_of.setdefault(worker, set()).add(key)
        if key in self._stale:
            fit.refit(fresh=True)
            self._stale.discard(key)
        fit.add(turn)
        if self._more_measured(key, self._most_link_of.get(worker)):
            self._most_link_of[worker] = key
        if self._more_measured(key, self._most_link.get(group)):
            self._most_link[group] = key

    def _note_group(self, worker: str, group: str) -> None:
        if group:
            self._group_of[worker] = group
        else:
            self._group_of.pop(worker, None)

    def _new_compute_fit(self) -> RecentFit[Turn]:
        return RecentFit(self.prior.compute(), self.prior, _compute_xy, _computed_of)

    def _new_link_fit(self, worker: str) -> RecentFit[Turn]:
        """A link fit of ``worker``: it fits what ``worker``'s compute fit (as it is when asked) leaves unexplained."""
        return RecentFit(
            self.prior.transfer(), self.prior,
            lambda t: (transfer_features(t.pulled),
                       t.ms - self.compute_ms(worker, t.computed, t.context, self._group_of.get(worker, "")), t.ms),
            _pulled_of)

    def _more_measured(self, key: tuple[str, str], than: tuple[str, str] | None) -> bool:
        return than is None or self._links[key].observations > self._links[than].observations

    def observe_local(self, worker: str, *, prompt_tokens: int, computed_tokens: int, streams: int,
                      ms: float, group: str = "") -> None:
        """A turn continued on decode worker ``worker`` (of ``group``): the prompt tokens it computed (its prefix
        cache held the rest), the streams it decoded meanwhile, and its time to the first token."""
        if prompt_tokens <= 0 or computed_tokens < 0 or streams < 0 or ms < 0:
            raise ValueError("token counts, streams and time must be non-negative, and the prompt non-empty")
        self._note_group(worker, group)
        fit = self._local.get(worker)
        if fit is None:
            fit = self._local[worker] = RecentFit(self.prior.local(), self.prior, _local_xy, _computed_of)
        fit.add(Turn(computed_tokens, prompt_tokens, 0, ms, streams))
        most = self._local.get(self._most_local.get(group, ""))
        if most is None or fit.observations > most.observations:
            self._most_local[group] = worker

    def local_theta(self, worker: str, group: str = "") -> list[float]:
        """``worker``'s local fit; a decode worker not measured yet: the most-measured one's of its group, else
        the group's compute fit with the per-stream prior."""
        fit = self._local.get(worker)
        if fit is None and group in self._most_local:
            fit = self._local[self._most_local[group]]
        if fit is not None:
            return fit.theta
        reference = self._compute_fit(self._most_measured.get(group, ""), group)
        compute = reference.theta if reference else self.prior.compute()
        return [*compute, self.prior.ms_per_decode_stream]

    def predict_local(self, worker: str, *, prompt_tokens: int, cached_tokens: int, streams: int,
                      waiting: int = 0, group: str = "") -> LocalPrediction:
        """The turn continued on decode worker ``worker`` (of ``group``), whose prefix cache holds ``cached_tokens``
        of the prompt (D computes at least the last prompt token) while it decodes ``streams`` streams; ``waiting``
        requests queued on D before it."""
        fixed, per_k, per_k_kctx, per_stream = self.local_theta(worker, group)
        computed = max(1, prompt_tokens - cached_tokens)
        k = computed / 1000
        work = per_k * k + per_k_kctx * k * prompt_tokens / 1000
        ms = fixed + work + per_stream * streams
        return LocalPrediction(ms * (1 + waiting), work, streams, prompt_tokens - computed)

    def local_fits(self) -> dict[str, RecentFit[Turn]]:
        return dict(self._local)

    @property
    def reference_worker(self) -> str | None:
        """The most-measured prefill worker of the "" group (None before any measurement): its compute fit."""
        return self.reference_worker_of("")

    def reference_worker_of(self, group: str) -> str | None:
        """The group's most-measured prefill worker (None before any measurement): the group's compute fit."""
        return self._most_measured.get(group)

    def predict(self, worker: str, *, prompt_tokens: int, reusable_tokens: int, cached_tokens: int = 0,
                source: str = "", compute_as: str | None = None, group: str = "") -> Prediction:
        """Both options of a turn on ``worker`` (of ``group``): PULL (load ``reusable_tokens`` from ``source``,
        compute the rest) or RECOMPUTE (compute all but the ``cached_tokens`` P already holds in its own prefix
        cache). ``compute_as``: price the compute with that worker's fit instead (e.g. :meth:`reference_worker_of`,
        to compare workers of one model by their work alone); the transfer stays ``worker``'s link's."""
        compute_of = compute_as or worker
        recompute = self.compute_ms(compute_of, prompt_tokens - cached_tokens, prompt_tokens, group)
        if reusable_tokens <= 0:
            return Prediction(None, recompute)
        pulled = max(0, reusable_tokens - cached_tokens)  # P loads only what it does not hold
        computed = prompt_tokens - max(reusable_tokens, cached_tokens)
        pull = self.compute_ms(compute_of, computed, prompt_tokens, group)
        if pulled:
            pull += self.transfer_ms(worker, source, pulled, group)
        return Prediction(pull, recompute)

    def observations(self, worker: str) -> tuple[int, int]:
        """(turns without a pull, pulls) measured on ``worker``."""
        fit = self._compute.get(worker)
        return (fit.observations if fit else 0,
                sum(f.observations for k, f in self._links.items() if k[0] == worker))

    def pulls_on_link(self, worker: str, source: str) -> int:
        fit = self._links.get((worker, source))
        return fit.observations if fit else 0

    def compute_fits(self) -> dict[str, RecentFit[Turn]]:
        return dict(self._compute)

    def link_fits(self) -> dict[tuple[str, str], RecentFit[Turn]]:
        """Every measured link's fit, refitted first where its worker's compute fit changed."""
        return {key: self._link_fit(*key) for key in list(self._links)}

    def state(self) -> dict:
        """What the model learned, JSON-friendly (lists for tuple keys): every fit (:meth:`RecentFit.state`), in
        order, the links whose refit is pending, and the most-measured fits unseen workers and links predict from.
        Not the priors and fitting settings: a model loading it is given its own, and behaves identically only when
        they are the same. Pure: taking it does not refit anything."""
        return {
            "compute": {worker: fit.state() for worker, fit in self._compute.items()},
            "links": [[worker, source, fit.state()] for (worker, source), fit in self._links.items()],
            "stale": sorted([worker, source] for worker, source in self._stale),
            "most_measured": self._most_measured.get(""),
            "most_link": list(self._most_link[""]) if "" in self._most_link else None,
            "most_link_of": {worker: key[1] for worker, key in self._most_link_of.items()},
            "local": {worker: fit.state() for worker, fit in self._local.items()},
            "most_local": self._most_local.get(""),
            # the named groups (models): each worker's, and each group's most-measured fits
            "groups": dict(self._group_of),
            "most_measured_of": {g: w for g, w in self._most_measured.items() if g},
            "most_link_in": {g: list(key) for g, key in self._most_link.items() if g},
            "most_local_of": {g: w for g, w in self._most_local.items() if g},
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace what the model learned with ``state`` (from :meth:`state`, JSON round-trip included), in place
        (whoever holds this model sees it): it then predicts, and learns from further observations, exactly as the
        model that took it. ValueError when it is malformed; nothing changes then."""
        with _malformed("cost model"):
            state = _mapping(state, "cost model")
            compute: dict[str, RecentFit[Turn]] = {}
            for worker, fit_state in _mapping(state["compute"], "compute").items():
                fit = compute[_str(worker, "worker")] = self._new_compute_fit()
                fit.load_state(fit_state)
            links: dict[tuple[str, str], RecentFit[Turn]] = {}
            links_of: dict[str, set[tuple[str, str]]] = {}
            for item in _list(state["links"], "links"):
                worker, source, fit_state = _list(item, "link", length=3)
                key = (_str(worker, "worker"), _str(source, "source"))
                if key in links:
                    raise ValueError(f"link {key} appears twice")
                fit = links[key] = self._new_link_fit(key[0])
                fit.load_state(fit_state)
                links_of.setdefault(key[0], set()).add(key)
            stale = {_link_in(item, links) for item in _list(state["stale"], "stale")}
            most_measured = {group: _str(worker, "worker") for group, worker in
                             [("", state["most_measured"]),
                              *_mapping(state.get("most_measured_of", {}), "most_measured_of").items()]
                             if worker is not None}
            for group, worker in most_measured.items():
                if worker not in compute:
                    raise ValueError(f"most_measured {worker!r} (group {group!r}) has no compute fit")
            most_link = {group: _link_in(key, links) for group, key in
                         [("", state["most_link"]), *_mapping(state.get("most_link_in", {}), "most_link_in").items()]
                         if key is not None}
            most_link_of = {_str(worker, "worker"): _link_in([worker, source], links)
                            for worker, source in _mapping(state["most_link_of"], "most_link_of").items()}
            local: dict[str, RecentFit[Turn]] = {}
            for worker, fit_state in _mapping(state.get("local", {}), "local").items():
                fit = local[_str(worker, "worker")] = RecentFit(self.prior.local(), self.prior, _local_xy,
                                                                _computed_of)
                fit.load_state(fit_state)
            most_local = {group: _str(worker, "worker") for group, worker in
                          [("", state.get("most_local")),
                           *_mapping(state.get("most_local_of", {}), "most_local_of").items()]
                          if worker is not None}
            for group, worker in most_local.items():
                if worker not in local:
                    raise ValueError(f"most_local {worker!r} (group {group!r}) has no local fit")
            group_of = {_str(w, "worker"): _str(g, "group")
                        for w, g in _mapping(state.get("groups", {}), "groups").items()}
        self._compute, self._links, self._links_of, self._stale = compute, links, links_of, stale
        self._most_measured, self._most_link, self._most_link_of = most_measured, most_link, most_link_of
        self._local, self._most_local, self._group_of = local, most_local, group_of

    @classmethod
    def from_state(cls, state: Mapping[str, Any], prior: PrefillPrior | None = None) -> PrefillCostModel:
        """A model with ``prior`` that learned ``state`` (:meth:`load_state`)."""
        model = cls(prior)
        model.load_state(state)
        return model


def _compute_xy(t: Turn) -> tuple[list[float], float, float]:
    return compute_features(t.computed, t.context), t.ms, t.ms


def _local_xy(t: Turn) -> tuple[list[float], float, float]:
    return local_features(t.computed, t.context, t.streams), t.ms, t.ms


def _computed_of(t: Turn) -> int:
    return t.computed


def _pulled_of(t: Turn) -> int:
    return t.pulled


# Snapshots (state / load_state): JSON-friendly encodings, and checks that turn a malformed one into a ValueError.

def _turn_out(t: Turn) -> list:
    return [t.computed, t.context, t.pulled, t.ms, *((t.streams,) if t.streams else ())]


def _xy_out(xy: tuple) -> list:
    x, y, measured = xy
    return [list(x), y, measured]


@contextmanager
def _malformed(what: str) -> Iterator[None]:
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"malformed {what} state: {exc}") from None
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"malformed {what} state: {type(exc).__name__}: {exc}") from None


def _mapping(value: Any, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} is not a mapping")
    return value


def _list(value: Any, what: str, *, length: int | None = None, longest: int | None = None) -> list | tuple:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{what} is not a list")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} has {len(value)} items, not {length}")
    if longest is not None and len(value) > longest:
        raise ValueError(f"{what} has {len(value)} items, more than these settings keep ({longest})")
    return value


def _int(value: Any, what: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is not an integer: {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{what} is below {low}: {value}")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} is not a number: {value!r}")
    return value  # as it is: JSON keeps ints and floats apart, and floats exactly


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string: {value!r}")
    return value


def _index(value: Any, observations: int) -> int:
    index = _int(value, "observation index", low=0)
    if index >= observations:
        raise ValueError(f"observation index {index} is not below the observation count {observations}")
    return index


def _turn_in(value: Any) -> Turn:
    items = _list(value, "turn")
    if len(items) not in (4, 5):
        raise ValueError(f"turn has {len(items)} items, not 4 or 5")
    computed, context, pulled, ms, *streams = items
    return Turn(_int(computed, "computed", low=0), _int(context, "context", low=0), _int(pulled, "pulled", low=0),
                _number(ms, "ms"), _int(streams[0], "streams", low=0) if streams else 0)


def _xy_in(value: Any, n: int) -> tuple[list[float], float, float]:
    x, y, measured = _list(value, "(x, y, measured)", length=3)
    return [_number(v, "x") for v in _list(x, "x", length=n)], _number(y, "y"), _number(measured, "measured")


def _link_in(value: Any, links: Mapping[tuple[str, str], Any]) -> tuple[str, str]:
    worker, source = _list(value, "link", length=2)
    key = (_str(worker, "worker"), _str(source, "source"))
    if key not in links:
        raise ValueError(f"link {key} has no fit")
    return key
