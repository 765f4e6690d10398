"""`draft_policy="goodput"`: each step, the k each sampling request proposes is the one
that maximises the step's expected output tokens per second.

Two online estimates, both owned here and both injectable (tests seed them):

- `AcceptanceEstimates`: per draft position i, how often a draft that is reached (all
  drafts before it accepted) is accepted, counted with decay so the estimate follows a
  changing workload; each request's own history shifts it (a request that keeps
  rejecting stops drafting, one that accepts everything drafts the most), and a request
  with little history gets a little optimism, so the estimates keep learning.
- `StepTimeModel`: the seconds of a step as a function of its target rows and drafter
  rows (affine, with hinges where the forward turns compute-bound), fitted by
  recursive least squares from the step times the runner reports, starting from a
  prior by drafter kind.

`GoodputPolicy.caps` turns them into a cap on k per running request: in steady state a
request proposing k drafts puts 1 + k rows in the target pass and the method's rows in
each drafter pass, and gains 1 + E[accepted | k] tokens. The j-th draft of a request
gains the chance its first j drafts are all accepted; drafts are added in order of that
gain while tokens / predicted seconds still grows (a greedy marginal allocation over
the whole batch, vectorised). The cap only lowers the rule's k, so every invariant of
the throttle holds as before: the chosen k is what the step charges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.budget import ThrottleRule
from scheduler.stats import add_reaching

# Where the hinges of the step-time model sit (rows of one pass).
KNOTS = (64, 256)
STEP_NOISE = 1e-3  # seconds: the scatter of one step's measured time, roughly
# Prior step-time parameters (seconds) by drafter kind: constant, per target row and per
# row past each knot, then a drafter's constant (paid when it runs), per row and past
# each knot. Rough CPU figures for the default model; the fit replaces them within a
# few dozen steps wherever the rows vary.
_TARGET_PRIOR = (0.02, 0.0003, 0.0005, 0.0005)
_DRAFTER_PRIOR = {"lookup": (0.0, 0.0, 0.0, 0.0),
                  "head": (0.002, 0.00002, 0.00003, 0.00003),
                  "lm": (0.02, 0.0003, 0.0005, 0.0005)}


@dataclass(frozen=True)
class GoodputSettings:
    """The policy's knobs; the defaults serve, tests pin them."""

    prior_acceptance: float = 0.5  # per reached draft, before any verification
    prior_weight: float = 8.0  # pseudo-observations behind that prior
    request_weight: float = 4.0  # a request's own history counts after this many
    decay: float = 0.99  # per step, of the global counts
    explore: float = 0.2  # optimism for a request with no history, ~ 1 / (1 + seen)
    forgetting: float = 0.98  # of the step-time fit, per observed step


class AcceptanceEstimates:
    """Acceptance of a reached draft, per position (global) and per request."""

    def __init__(self, max_k: int, settings: GoodputSettings) -> None:
        self.settings = settings
        self.accepted = np.zeros(max_k)  # decayed counts per position
        self.reached = np.zeros(max_k)

    def record(self, verified: list[int], accepted: list[int]) -> None:
        """One step's verifications (drafts verified, accepted), each verified >= 1.
        Position i was reached if i <= accepted (and i < verified)."""
        self.accepted *= self.settings.decay
        self.reached *= self.settings.decay
        if not verified:
            return
        v, a = np.asarray(verified), np.asarray(accepted)
        width = len(self.reached)
        self.reached += add_reaching([0] * width, np.minimum(a + 1, v), width)
        self.accepted += add_reaching([0] * width, a, width)

    def position_rates(self) -> np.ndarray:
        """[K] acceptance of a reached draft at each position, smoothed by the prior."""
        s = self.settings
        return ((self.accepted + s.prior_weight * s.prior_acceptance)
                / (self.reached + s.prior_weight))

    def request_rates(self, verifications: np.ndarray, first_accepted: np.ndarray
                      ) -> np.ndarray:
        """[N, K] per request: the position rates scaled by how often the request's
        first draft was accepted against the global first-draft rate (every
        verification reaches the first draft, so a typical request scales by ~1),
        plus optimism for little history."""
        s = self.settings
        rates = self.position_rates()
        first = float(rates[0]) if len(rates) else 0.0
        own = ((first_accepted + s.request_weight * first)
               / (verifications + s.request_weight))
        scale = own / first if first > 0 else np.ones_like(own, dtype=float)
        bonus = s.explore / (1.0 + verifications)
        return np.clip(rates[None, :] * scale[:, None] + bonus[:, None], 0.0, 0.99)


class StepTimeModel:
    """Seconds of a step from its target rows t and drafter rows d (all drafter passes
    and one-row steps together): a constant, t, (t - knot)+, and for a step that drafts
    a constant, d, (d - knot)+; fitted online by recursive least squares with
    forgetting, from the prior for the method's drafter kind."""

    def __init__(self, drafter_kind: str | None, settings: GoodputSettings) -> None:
        drafter = _DRAFTER_PRIOR.get(drafter_kind or "lookup", _DRAFTER_PRIOR["lm"])
        self.theta = np.array(_TARGET_PRIOR + drafter, dtype=float)
        # Prior variance: each parameter may be off by about its own size (a floor keeps
        # a zero prior learnable), in units of the noise on one step's time (about a
        # millisecond here), which is what recursive least squares weighs it against.
        self.cov = np.diag(np.maximum(self.theta, 1e-4) ** 2 * 4.0) / STEP_NOISE ** 2
        self.forgetting = settings.forgetting
        self.num_observed = 0

    @staticmethod
    def features(target: np.ndarray, drafter: np.ndarray) -> np.ndarray:
        t, d = np.asarray(target, dtype=float), np.asarray(drafter, dtype=float)
        cols = [np.ones_like(t), t, *(np.maximum(t - knot, 0.0) for knot in KNOTS),
                (d > 0).astype(float), d, *(np.maximum(d - knot, 0.0) for knot in KNOTS)]
        return np.stack(cols, axis=-1)

    def predict(self, target: np.ndarray | int, drafter: np.ndarray | int) -> np.ndarray:
        """Seconds (>= 1 microsecond) for each (target, drafter) row count."""
        return np.maximum(self.features(np.asarray(target), np.asarray(drafter)) @ self.theta,
                          1e-6)

    def observe(self, target: int, drafter: int, seconds: float) -> None:
        x = self.features(np.asarray(target), np.asarray(drafter))
        px = self.cov @ x
        gain = px / (self.forgetting + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.cov = (self.cov - np.outer(gain, px)) / self.forgetting
        self.num_observed += 1


@dataclass(frozen=True)
class DraftCosts:
    """Rows the j-th draft of a request adds per step, in steady state (j = 1..K):
    `target[j - 1]` (1: its verification) and `drafter[j - 1]` (all drafter passes and
    one-row steps), and the drafter rows a request puts in with k = 0."""

    target: np.ndarray
    drafter: np.ndarray
    drafter_base: int

    @classmethod
    def for_rule(cls, rule: ThrottleRule) -> DraftCosts:
        ks = range(rule.max_k + 1)
        # A decoding request proposing k verifies k next step: its chunk is 1 + k.
        rows = np.array([rule.plan(1 + k, k, k).rows for k in ks], dtype=np.int64)
        target, drafter = rows[:, 0], rows[:, 1:].sum(axis=1)
        method = rule.method
        if method is not None and method.sequential:  # k - 1 one-row steps
            drafter = drafter + np.maximum(np.arange(rule.max_k + 1) - 1, 0)
        return cls(np.diff(target), np.diff(drafter), int(drafter[0]))


class GoodputPolicy:
    """Chooses each sampling request's k cap per step; see the module docstring."""

    def __init__(self, rule: ThrottleRule, max_num_batched_tokens: int,
                 settings: GoodputSettings | None = None,
                 time_model: StepTimeModel | None = None) -> None:
        self.settings = settings or GoodputSettings()
        self.max_k = rule.max_k
        self.budget = max_num_batched_tokens
        self.costs = DraftCosts.for_rule(rule)
        self.acceptance = AcceptanceEstimates(rule.max_k, self.settings)
        kind = rule.method.drafter if rule.method is not None else None
        self.time_model = time_model or StepTimeModel(kind, self.settings)
        self.new_request_cap = rule.max_k  # for requests admitted this step

    def caps(self, verifications: np.ndarray, first_accepted: np.ndarray,
             rule_k: np.ndarray) -> np.ndarray:
        """[N] the k cap of each running request (its verifications so far and how many
        accepted their first draft; rule_k: the k the rule allows it now). Also sets
        `new_request_cap`, the cap of a request with no history in this batch."""
        num = len(rule_k)
        fresh = np.zeros(1)
        gains = np.cumprod(self.acceptance.request_rates(
            np.concatenate([verifications, fresh]),
            np.concatenate([first_accepted, fresh])), axis=1)
        limit = np.concatenate([rule_k, [self.max_k]])
        gains[np.arange(self.max_k)[None, :] >= limit[:, None]] = 0.0
        threshold = self._threshold(gains[:num], max(num, 1))
        caps = (gains >= threshold).sum(axis=1)
        self.new_request_cap = int(caps[num])
        return caps[:num]

    def _threshold(self, gains: np.ndarray, num_sampling: int) -> float:
        """The smallest gain worth a draft: drafts sorted by gain, the prefix that
        maximises (tokens) / (predicted seconds), within B rows of the target pass."""
        k = self.max_k
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")
        g = flat[order]
        j = order % k  # the draft's index in its request (0: the first draft)
        target = num_sampling + np.cumsum(self.costs.target[j])
        drafter = num_sampling * self.costs.drafter_base + np.cumsum(self.costs.drafter[j])
        seconds = self.time_model.predict(np.concatenate([[num_sampling], target]),
                                          np.concatenate([[num_sampling
                                                           * self.costs.drafter_base],
                                                          drafter]))
        # A misfit that predicts less time for more rows must not reward drafting.
        seconds = np.maximum.accumulate(seconds)
        tokens = num_sampling + np.concatenate([[0.0], np.cumsum(g)])
        rate = tokens / seconds
        fits = np.concatenate([[True], (target <= self.budget) & (g > 0)])
        rate[~fits] = -np.inf
        best = int(np.argmax(rate))
        return float(g[best - 1]) if best > 0 else np.inf

    def observe_step(self, verified: list[int], accepted: list[int], target_rows: int,
                     drafter_rows: int, seconds: float | None) -> None:
        """What a step's results teach: its verifications, and its time if measured."""
        self.acceptance.record(verified, accepted)
        if seconds is not None:
            self.time_model.observe(target_rows, drafter_rows, seconds)
