"""`draft_policy="goodput"`: each step, the k each sampling request proposes is the one
that maximises the step's expected output tokens per second.

Two online estimates, both owned here and both injectable (tests seed them):

- `AcceptanceEstimates`: per draft position i, how often a draft that is reached (all
  drafts before it accepted) is accepted, kept per state the request's last
  verification left (all accepted, some, none, no verification yet: drafts come in
  runs, so that state predicts best), counted with decay so the estimate follows a
  changing workload. Each request's own record scales it (its first-draft acceptances
  over what its states predicted: a request that keeps rejecting stops drafting, one
  that accepts everything drafts the most), and a request with little history gets a
  little optimism, so the estimates keep learning, less as the method's own record
  grows.
- `StepTimeModel`: the seconds of a step as a function of its target rows, how many of
  them give logits, its drafter rows and drafter passes (affine, with hinges where the
  forward turns compute-bound), fitted as a ridge regression toward a prior by drafter
  kind on the step times the runner reports, older steps weighing less; rows never
  tried are priced optimistically, so the policy tries them.

`GoodputPolicy.caps` turns them into a cap on k per running request: in steady state a
request proposing k drafts puts 1 + k rows in the target pass and the method's rows in
each drafter pass, and gains 1 + E[accepted | k] tokens. The j-th draft of a request
gains the chance its first j drafts are all accepted; drafts are added in order of that
gain while tokens / predicted seconds still grows (a greedy marginal allocation over
the whole batch, vectorised). The cap only lowers the rule's k, so every invariant of
the throttle holds as before: the chosen k is what the step charges.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from scheduler.budget import ThrottleRule
from scheduler.request import FRESH, NUM_OUTCOMES

# Where the hinges of the step-time model sit, in rows that give logits: past each, a
# pass is more bound by compute than by reading the weights.
KNOTS = (16, 64, 256)
# Prior step-time parameters (seconds) by drafter kind. The target's: a constant, per
# row that gives no logits (a prefill row), per row that gives logits (a verified
# draft's row, a sampling chunk's last row: the LM head, sampling and attention over
# the whole context; priced apart, or cheap prefill rows would price a verification row
# low) and the change of that slope past each knot. A drafter's: per forward pass (its
# launch, whatever its rows), per row, and past each knot. The target's are rounded
# from a fit to 750 steps of the default model in bfloat16 on this project's 2-core
# CPU, ngram K = 4 at 1, 4, 16 and 64 requests (a verification row ~0.9 ms at every
# batch size: the fit's changes of slope were within its noise); the fit replaces them
# wherever rows vary.
_TARGET_PRIOR = (0.016, 0.0006, 0.0009, 0.0, 0.0, 0.0)
_DRAFTER_PRIOR = {"lookup": (0.0,) * 5,
                  "head": (0.002, 0.00002, 0.00002, 0.00002, 0.0),
                  "lm": (0.016, 0.001, 0.0004, 0.0, 0.0)}  # a pass like the target's
# How much the prior weighs, in steps of 64 rows (pseudo-observations as noisy as a
# real step): little for the constants and base slopes (the data soon decides them),
# more for the changes of slope at the knots, so rows past a knot no step has reached
# are priced by the slope below it (plus the prior's change), not by a fit through
# collinear hinges.
_REFERENCE_ROWS = 64
_PRIOR_STEPS_BASE, _PRIOR_STEPS_KNOT = 0.01, 4.0


def _prior_precision() -> np.ndarray:
    """Diagonal prior precision, in the units of the fit (seconds, rows)."""
    base, knot = _PRIOR_STEPS_BASE, _PRIOR_STEPS_KNOT
    rows = float(_REFERENCE_ROWS) ** 2
    hinges = [knot * rows] * len(KNOTS)
    target = [base, base * rows, base * rows, *hinges]
    drafter = [base, base * rows, *hinges]
    return np.diag(np.array(target + drafter))


@dataclass(frozen=True)
class GoodputSettings:
    """The policy's knobs; the defaults serve, tests pin them."""

    prior_acceptance: float = 0.5  # per reached draft, before any verification
    prior_weight: float = 8.0  # pseudo-observations behind that prior
    request_weight: float = 4.0  # a request's own history counts after this many
    # Of the global counts, per verification recorded (not per step: at one request a
    # step verifies at most once, at 64 sixty-four times; the window is ~1,000 either way).
    decay: float = 0.999
    explore: float = 0.2  # optimism for a request with no history, ~ 1 / (1 + seen)
    forgetting: float = 0.995  # of the step-time fit's data, per observed step
    # Standard deviations by which the time model's price of extra rows is taken low
    # (exploration: an operating point never left teaches no slope; without it, ngram
    # at one request stopped drafting on the prior's price of a row and ran at 0.90x
    # speculation off, against 1.54x with it, measured) ...
    optimism: float = 1.0
    # ... but never below this share of their mean price: the fit forgets, so its
    # spread regrows while nobody drafts, and at 64 running an unbounded discount had
    # dflash draft all 34 requests at a forecast first-draft acceptance of 0.15 every
    # ~10 steps to the end (measured).
    optimism_floor: float = 0.5
    # Drafts behind the forecast check's prior (that forecasts are right).
    forecast_weight: float = 16.0
    # With nothing waiting, one k for every sampling request (each capped by its rule)
    # instead of drafts to the requests rated highest: a batch that nobody joins ends
    # with its slowest request, so a draft shortens it only where every request still
    # running drafts (measured: per-request drafts at 64 running saved 0 of 70 steps,
    # K = 1 for all saved 5-9). Off until measured at every load.
    uniform_when_closed: bool = False


def reaching_by_state(counts: np.ndarray, states: np.ndarray, width: int) -> np.ndarray:
    """[NUM_OUTCOMES, width]: per state, how many of `counts` (those of that state)
    exceed i, for i < width (`stats.reaching`, one histogram for every state)."""
    span = width + 1
    hist = np.bincount(states * span + np.minimum(counts, width),
                       minlength=NUM_OUTCOMES * span).reshape(NUM_OUTCOMES, span)
    return np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]


class AcceptanceEstimates:
    """Acceptance of a reached draft, per position and per state of the request's last
    verification (each state's rates shrunk toward the pooled ones, those toward the
    prior), and per request."""

    def __init__(self, max_k: int, settings: GoodputSettings) -> None:
        self.settings = settings
        self.accepted = np.zeros((NUM_OUTCOMES, max_k))  # decayed counts per position
        self.reached = np.zeros((NUM_OUTCOMES, max_k))

    def record(self, verified: list[int], accepted: list[int],
               states: list[int] | None = None) -> None:
        """One step's verifications (drafts verified, accepted), each verified >= 1, and
        the state each request was in before it (FRESH if not given). Position i was
        reached if i <= accepted (and i < verified)."""
        if not verified:
            return
        fade = self.settings.decay ** len(verified)
        self.accepted *= fade
        self.reached *= fade
        v, a = np.asarray(verified), np.asarray(accepted)
        s = np.asarray(states) if states is not None else np.zeros(len(v), dtype=np.int64)
        width = self.reached.shape[1]
        self.reached += reaching_by_state(np.minimum(a + 1, v), s, width)
        self.accepted += reaching_by_state(a, s, width)

    def pooled_rates(self) -> np.ndarray:
        """[K] acceptance of a reached draft at each position, all states together,
        smoothed by the prior."""
        s = self.settings
        return ((self.accepted.sum(axis=0) + s.prior_weight * s.prior_acceptance)
                / (self.reached.sum(axis=0) + s.prior_weight))

    def position_rates(self, pooled: np.ndarray | None = None) -> np.ndarray:
        """[NUM_OUTCOMES, K] per state of the last verification, shrunk toward the pooled
        rates (a state seen rarely says little; `pooled`: `pooled_rates()` if known)."""
        weight = self.settings.prior_weight
        pooled = self.pooled_rates() if pooled is None else pooled
        return (self.accepted + weight * pooled) / (self.reached + weight)

    def request_rates(self, verifications: np.ndarray, first_accepted: np.ndarray,
                      states: np.ndarray) -> np.ndarray:
        """[N, K] per request: the position rates of the state its last verification
        left, scaled by its first-draft acceptances over what its states predicted
        (`verifications` [N, NUM_OUTCOMES]: its verifications per state it was in; every
        verification reaches the first draft, so the ratio is fair), shrunk toward 1 by
        `request_weight` pseudo-verifications; plus optimism for little history."""
        s = self.settings
        pooled = self.pooled_rates()
        rates = self.position_rates(pooled)
        first = float(pooled[0]) if rates.shape[1] else 0.0
        pseudo = s.request_weight * first
        expected = verifications @ rates[:, 0] if rates.shape[1] else 0.0
        scale = (first_accepted + pseudo) / (expected + pseudo) if first > 0 else 1.0
        # Optimism shrinks with the request's own history and with the method's: once
        # the batch has verified hundreds of drafts, a fresh request is most likely
        # like them, and exploring it costs verification rows (and maybe a drafter
        # pass) that a batch of 64 pays on every request it tries.
        seen = float(self.reached[:, 0].sum())
        method_doubt = np.sqrt(s.prior_weight / (s.prior_weight + seen))
        bonus = s.explore * method_doubt / (1.0 + verifications.sum(axis=1))
        return np.clip(rates[states] * np.reshape(scale, (-1, 1)) + bonus[:, None], 0.0, 0.99)


class ForecastCheck:
    """How many drafts the policy's chosen drafts got accepted, against how many it
    forecast for them. The drafts it chooses are the ones its estimates rate highest,
    so the estimates' errors are not even there: a request rated high on three
    verifications, or on the optimism a fresh one gets, is chosen for exactly that
    (measured: at 64 running, dflash's chosen drafts were forecast 0.5-0.7 and got
    0.19). The ratio, counted with decay, scales the next forecasts.

    Drafts chosen when a step is planned are verified in the next step, so a forecast
    waits one step for its outcome; per draft, since the rule or the budget may cut a
    cap and a request may finish before it verifies."""

    def __init__(self, settings: GoodputSettings) -> None:
        self.decay = settings.decay
        self.forecast = settings.forecast_weight  # decayed, per verified draft
        self.accepted = settings.forecast_weight
        self.pending: deque[float] = deque(maxlen=2)  # forecast per draft, by step

    @property
    def factor(self) -> float:
        return self.accepted / self.forecast

    def expect(self, forecast: float, drafts: int) -> None:
        """A step was planned with `drafts` drafts allowed, forecast to get `forecast`
        accepted."""
        self.pending.append(forecast / drafts if drafts else 0.0)

    def settle(self, accepted: int, verified: int) -> None:
        """The step just run verified the drafts the step before it allowed."""
        if len(self.pending) < 2:
            return
        per_draft = self.pending.popleft()
        if not verified or per_draft <= 0.0:
            return
        fade = self.decay ** verified
        self.forecast = self.forecast * fade + per_draft * verified
        self.accepted = self.accepted * fade + accepted


class StepTimeModel:
    """Seconds of a step from its target rows t, the l of them that give logits, its
    drafter rows d (all drafter passes and one-row steps together) and the p drafter
    forward passes they took: a constant, t - l, l, (l - knot)+, p, d, (d - knot)+.

    Fitted as a ridge regression toward the prior for the method's drafter kind, on the
    observed steps weighted by `forgetting` per step since. Only the data is forgotten,
    never the prior: recursive least squares with forgetting lets the variance of a
    direction no step excites grow without bound (a decode-only stretch never moves the
    rows past a knot), and the next prefill then swings that slope on one noisy step."""

    def __init__(self, drafter_kind: str | None, settings: GoodputSettings) -> None:
        drafter = _DRAFTER_PRIOR.get(drafter_kind or "lookup", _DRAFTER_PRIOR["lm"])
        self.prior = np.array(_TARGET_PRIOR + drafter, dtype=float)
        self.prior_precision = _prior_precision()
        self._prior_moment = self.prior_precision @ self.prior
        self.gram = np.zeros((len(self.prior), len(self.prior)))  # decayed sum of x x'
        self.moment = np.zeros(len(self.prior))  # decayed sum of x * seconds
        self.theta = self.prior.copy()
        self.cov = np.linalg.inv(self.prior_precision)  # of theta, in units of noise_var
        self.noise_var = 1e-6  # of one step's time around the fit (s^2): ~1 ms to start
        self.forgetting = settings.forgetting
        self.optimism = settings.optimism
        self.optimism_floor = settings.optimism_floor
        self.num_observed = 0

    @staticmethod
    def features(target: np.ndarray, logits: np.ndarray, drafter: np.ndarray,
                 passes: np.ndarray) -> np.ndarray:
        t, d = np.asarray(target, dtype=float), np.asarray(drafter, dtype=float)
        lg = np.asarray(logits, dtype=float) + np.zeros_like(t)
        p = np.asarray(passes, dtype=float) + np.zeros_like(t)
        cols = [np.ones_like(t), t - lg, lg, *(np.maximum(lg - knot, 0.0) for knot in KNOTS),
                p, d, *(np.maximum(d - knot, 0.0) for knot in KNOTS)]
        return np.stack(cols, axis=-1)

    @staticmethod
    def features_one(target: int, logits: int, drafter: int, passes: int) -> np.ndarray:
        """`features` of one step, without numpy's per-call cost on eleven tiny columns."""
        return np.array([1.0, target - logits, logits,
                         *(max(logits - knot, 0) for knot in KNOTS), passes, drafter,
                         *(max(drafter - knot, 0) for knot in KNOTS)], dtype=float)

    def predict(self, target: np.ndarray | int, logits: np.ndarray | int,
                drafter: np.ndarray | int, passes: np.ndarray | int) -> np.ndarray:
        """Seconds (>= 1 microsecond) for each (target, logit, drafter rows, drafter
        passes) count."""
        return np.maximum(self.features(np.asarray(target), np.asarray(logits),
                                        np.asarray(drafter), np.asarray(passes))
                          @ self.theta, 1e-6)

    def predict_one(self, target: int, logits: int, drafter: int, passes: int) -> float:
        return max(float(self.features_one(target, logits, drafter, passes) @ self.theta),
                   1e-6)

    def predict_optimistic(self, target: np.ndarray, logits: np.ndarray,
                           drafter: np.ndarray, passes: np.ndarray) -> np.ndarray:
        """Seconds of each step, the first the base: what each adds to the base is
        predicted `optimism` standard deviations low (never below `optimism_floor` of
        its mean). Where no step
        has varied the rows (a batch that never drafts keeps one operating point), the
        slope is unknown and the extra rows look cheap, so the policy tries them and
        measures; once measured, the deviation is small and the mean decides."""
        x = self.features(target, logits, drafter, passes)
        mean = x @ self.theta
        extra = x - x[0]
        spread = np.sqrt(self.noise_var * ((extra @ self.cov) * extra).sum(axis=1))
        extra_mean = np.maximum(mean - mean[0], 0.0)
        added = np.maximum(extra_mean - self.optimism * spread,
                           self.optimism_floor * extra_mean)
        return np.maximum(mean[0] + added, 1e-6)

    def observe(self, target: int, logits: int, drafter: int, passes: int,
                seconds: float) -> None:
        x = self.features_one(target, logits, drafter, passes)
        residual = seconds - float(x @ self.theta)
        # The noise is learnt from the residuals before each update, so a step the fit
        # has seen does not make the noise look smaller than it is.
        self.noise_var += (1.0 - self.forgetting) * (residual * residual - self.noise_var)
        self.gram *= self.forgetting
        self.gram += np.outer(x, x)
        self.moment *= self.forgetting
        self.moment += x * seconds
        self.cov = np.linalg.inv(self.prior_precision + self.gram)
        self.theta = self.cov @ (self._prior_moment + self.moment)
        self.num_observed += 1


@dataclass(frozen=True)
class DraftCosts:
    """Rows the j-th draft of a request adds per step, in steady state (j = 1..K):
    `target[j - 1]` (1: its verification) and `drafter[j - 1]` (all drafter passes and
    one-row steps), and the drafter rows a request puts in with k = 0. Also the drafter
    forward passes a step runs: `passes_base` while its requests draft nothing (dflash:
    the context pass), `passes_drafting` more once any drafts (dflash: the query pass),
    and for a sequential method one more one-row step per draft past the first of the
    deepest request. A pass costs its launch whatever its rows, so one request drafting
    alone can cost a whole pass."""

    target: np.ndarray
    drafter: np.ndarray
    drafter_base: int
    passes_base: int = 0
    passes_drafting: int = 0
    sequential: bool = False

    @classmethod
    def for_rule(cls, rule: ThrottleRule) -> DraftCosts:
        ks = range(rule.max_k + 1)
        # A decoding request proposing k verifies k next step: its chunk is 1 + k.
        rows = np.array([rule.plan(1 + k, k, k).rows for k in ks], dtype=np.int64)
        target, drafter = rows[:, 0], rows[:, 1:].sum(axis=1)
        method = rule.method
        sequential = method is not None and method.sequential
        if sequential:  # k - 1 one-row steps
            drafter = drafter + np.maximum(np.arange(rule.max_k + 1) - 1, 0)
        passes = (rows[:, 1:] > 0).sum(axis=1)
        drafting = int(passes[1] - passes[0]) if rule.max_k else 0
        return cls(np.diff(target), np.diff(drafter), int(drafter[0]), int(passes[0]),
                   drafting, sequential)

    def passes(self, num_sampling: int, draft_index: np.ndarray) -> np.ndarray:
        """Drafter passes of the step after each prefix of drafts (the first entry: no
        draft), `draft_index` the 0-based index in its request of each draft added."""
        base = self.passes_base if num_sampling else 0
        any_draft = np.concatenate([[0], np.ones(len(draft_index), dtype=np.int64)])
        got = base + self.passes_drafting * any_draft
        if self.sequential:
            got = got + np.concatenate([[0], np.maximum.accumulate(draft_index)])
        return got


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
        self.check = ForecastCheck(self.settings)
        kind = rule.method.drafter if rule.method is not None else None
        self.time_model = time_model or StepTimeModel(kind, self.settings)
        self.new_request_cap = rule.max_k  # for requests admitted this step

    def caps(self, verifications: np.ndarray, first_accepted: np.ndarray,
             states: np.ndarray, rule_k: np.ndarray,
             behind: np.ndarray | None = None, closed: bool = False) -> np.ndarray:
        """[N] the k cap of each running request (its verifications so far per state it
        was in [N, NUM_OUTCOMES], how many accepted their first draft, the state its last
        one left; rule_k: the k the rule allows it now; behind: the rows its drafter must
        catch up before its first draft, none if None; closed: nothing waits, see
        `GoodputSettings.uniform_when_closed`). Also sets `new_request_cap`, the cap of
        a request with no history in this batch."""
        num = len(rule_k)
        fresh = np.zeros(1, dtype=np.int64)
        gains = np.cumprod(self.acceptance.request_rates(
            np.concatenate([verifications, np.zeros((1, NUM_OUTCOMES), dtype=np.int64)]),
            np.concatenate([first_accepted, fresh]),
            np.concatenate([states, fresh + FRESH])), axis=1)
        gains = np.minimum(gains * self.check.factor, 0.99)
        limit = np.concatenate([rule_k, [self.max_k]])
        gains[np.arange(self.max_k)[None, :] >= limit[:, None]] = 0.0
        catch_up = np.zeros(num, dtype=np.int64) if behind is None else behind
        if closed and num > 1 and self.settings.uniform_when_closed:
            uniform = self._uniform_k(gains[:num], limit[:num], catch_up)
            chosen = np.arange(self.max_k)[None, :] < np.minimum(limit, uniform)[:, None]
        else:
            chosen = gains >= self._threshold(gains[:num], max(num, 1), catch_up)
        caps = chosen.sum(axis=1)
        self.new_request_cap = int(caps[num])
        self.check.expect(float(gains[:num][chosen[:num]].sum()), int(caps[:num].sum()))
        return caps[:num]

    def _threshold(self, gains: np.ndarray, num_sampling: int, catch_up: np.ndarray) -> float:
        """The smallest gain worth a draft: drafts sorted by gain, the prefix that
        maximises (tokens) / (predicted seconds), within B rows of the target pass. A
        request's first draft also brings the rows its parked drafter catches up."""
        k = self.max_k
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")
        g = flat[order]
        j = order % k  # the draft's index in its request (0: the first draft)
        target = num_sampling + np.cumsum(self.costs.target[j])
        base = num_sampling * self.costs.drafter_base
        added = self.costs.drafter[j] + np.where(j == 0, catch_up[order // k], 0)
        drafter = np.concatenate([[base], base + np.cumsum(added)])
        # Every verification row gives logits, so the target rows here are logit rows.
        rows = np.concatenate([[num_sampling], target])
        seconds = self.time_model.predict_optimistic(rows, rows, drafter,
                                                     self.costs.passes(num_sampling, j))
        # A misfit that predicts less time for more rows must not reward drafting.
        seconds = np.maximum.accumulate(seconds)
        tokens = num_sampling + np.concatenate([[0.0], np.cumsum(g)])
        rate = tokens / seconds
        fits = np.concatenate([[True], (target <= self.budget) & (g > 0)])
        rate[~fits] = -np.inf
        best = int(np.argmax(rate))
        return float(g[best - 1]) if best > 0 else np.inf

    def _uniform_k(self, gains: np.ndarray, limit: np.ndarray, catch_up: np.ndarray) -> int:
        """The k, the same for every sampling request (each cut to its rule's k), whose
        step makes the most tokens per predicted second, within B target rows."""
        num, k = gains.shape
        allowed = np.arange(k)[None, :] < limit[:, None]  # [N, K]
        per_depth = allowed.sum(axis=0)  # requests that may draft a j-th draft
        costs = self.costs
        depth = np.arange(k + 1)
        target = num + np.concatenate([[0], np.cumsum(costs.target * per_depth)])
        catch = int(catch_up[limit > 0].sum())
        drafter = (num * costs.drafter_base + np.concatenate(
            [[0], np.cumsum(costs.drafter * per_depth)]) + np.where(depth > 0, catch, 0))
        passes = (costs.passes_base + costs.passes_drafting * (depth > 0)
                  + (np.maximum(depth - 1, 0) if costs.sequential else 0))
        # At the mean, with no optimism: trying a k on every request at once costs the
        # whole batch's rows for what one request's try would teach (measured: dflash
        # at 64 running, priced optimistically, drafted 3-4 for all in 16 % of its
        # request-steps and ran at 0.73x off).
        seconds = np.maximum.accumulate(self.time_model.predict(target, target, drafter,
                                                                passes))
        tokens = num + np.concatenate([[0.0], np.cumsum(gains.sum(axis=0))])
        rate = tokens / seconds
        rate[target > self.budget] = -np.inf
        return int(np.argmax(rate))

    def observe_step(self, verified: list[int], accepted: list[int], states: list[int],
                     rows: tuple[int, int, int, int], seconds: float | None) -> None:
        """What a step's results teach: its verifications (with the state each request
        was in), and its time if measured, with its rows: target, logit, drafter, and
        the drafter's forward passes."""
        self.acceptance.record(verified, accepted, states)
        self.check.settle(sum(accepted), sum(verified))
        if seconds is not None:
            self.time_model.observe(*rows, seconds)
