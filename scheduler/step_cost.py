"""What a step costs: the goodput policy's step-time model and the rows each draft adds.

`StepTimeModel`: the seconds of a step as a function of its target rows, how many of
them give logits, its drafter rows and drafter passes (affine, with hinges where the
forward turns compute-bound), fitted as a ridge regression toward a prior by drafter
kind on the step times the runner reports, older steps weighing less, no cost below
zero; rows never tried are priced optimistically, so the policy tries them.
`DraftCosts`: the rows the j-th draft of a request adds to each pass, from the rule's
cost table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from scheduler.budget import ThrottleRule
from scheduler.config import GoodputSettings
from spec_decode.price import DraftPrice

# Where the hinges of the step-time model sit, in rows that give logits: past each, a
# pass is more bound by compute than by reading the weights. The first is where this
# project's CPU stops passing rows for free: the default model's bfloat16 forward (oneDNN,
# AVX512-BF16) costs the same from 1 to 6 or 7 rows, then ~1 ms a row (measured: one
# request, 1-7 rows 26-33 ms, 8-14 rows 33-36, 24 rows 45, 64 rows 91; steps of 4
# running ngram K = 4, 3-6 logit rows 28.5 ms, 7-11 rows 32.5). Without it the fit
# drew one slope through the free rows and the dear ones, 0.3-0.4 ms a row at 1 and 4
# running, and drafted too little there.
KNOTS = (6, 16, 64, 256)
_KNOTS = np.array(KNOTS, dtype=float)
_NUM_FEATURES = 5 + 2 * len(KNOTS)  # constant, t - l, l, p, d and the hinges of l and d
_DRAFTER_COLUMN = 3 + len(KNOTS)  # where the drafter's features start: p, d, its hinges
# Prior step-time parameters (seconds) by drafter kind. The target's: a constant, per
# row that gives no logits (a prefill row), per row that gives logits (a verified
# draft's row, a sampling chunk's last row: the LM head, sampling and attention over
# the whole context; priced apart, or cheap prefill rows would price a verification row
# low) and the change of that slope past each knot. A drafter's: per forward pass (its
# launch, whatever its rows), per row, and past each knot. The target's are rounded
# from a fit to 750 steps of the default model in bfloat16 on this project's 2-core
# CPU, ngram K = 4 at 1, 4, 16 and 64 requests (a verification row ~0.9 ms at every
# batch size: the fit's changes of slope were within its noise), but for the first
# knot: below it a row costs little (above). The fit replaces them wherever rows vary.
# A head's are measured the same way (eagle's trained head, bfloat16, its passes timed
# in the runner at 1-64 running, K = 4): 1.5 ms for one row, 2.2 for 4, 3.0 for 12, 5.5
# for 30, 12.7 for 152 (a catch-up), so ~0.1 ms a row to 64, 0.06 past it. A prior of
# 0.02 ms a row priced a fresh engine's catch-ups (200+ rows) at a third of their time,
# and it drafted where that lost (measured at 16 running).
# On a GPU ("gpu", `GoodputSettings.step_prior`), from `benchmarks/runner_step.py
# --device cuda` on an H200 (README): a step ~13 ms whether it runs 1 row or 512 (its
# kernels launched one by one), ~6 us a prefill row, ~20 us a logit row, and an
# EAGLE-3 head's K = 4 (a context pass and three one-row steps) 5.3-5.9 ms, so ~1.4 ms
# a pass. Where a prior prices rows too high, the policy never drafts to learn
# otherwise; one that prices them too low drafts, and its steps correct it.
_PRIORS: dict[str, tuple[tuple[float, ...], dict[str, tuple[float, ...]]]] = {
    "cpu": ((0.016, 0.0006, 0.0001, 0.0008, 0.0, 0.0, 0.0),
            {"lookup": (0.0,) * 6,
             "head": (0.0016, 0.0001, 0.0, 0.0, -0.00004, 0.0),
             "lm": (0.016, 0.001, 0.0, 0.0004, 0.0, 0.0)}),  # a pass like the target's
    "gpu": ((0.013, 0.000006, 0.00002, 0.0, 0.0, 0.0, 0.0),
            {"lookup": (0.0,) * 6,
             "head": (0.0014, 0.00001, 0.0, 0.0, 0.0, 0.0),
             "lm": (0.013, 0.00002, 0.0, 0.0, 0.0, 0.0)}),
}
# How much the prior weighs, in steps of 64 rows (pseudo-observations as noisy as a
# real step): little for the constants and base slopes (the data soon decides them),
# more for the changes of slope at the knots, so rows past a knot no step has reached
# are priced by the slope below it (plus the prior's change), not by a fit through
# collinear hinges.
_REFERENCE_ROWS = 64
# Coefficients that are costs, never negative: the constant, the target's slopes per
# row, the drafter's per pass and per row (the changes of slope past a knot may be).
_NONNEGATIVE = (0, 1, 2, 3 + len(KNOTS), 4 + len(KNOTS))
_PRIOR_STEPS_BASE, _PRIOR_STEPS_KNOT = 0.01, 4.0
# ... but a few steps behind a head's price per pass, and one behind its price per
# row (and the change of that price at the first knot). Steps that run a drafter pass
# also have its rows, so the data alone tell the two apart only slowly, and drafting
# the whole batch is decided on them (measured: parallel at 16 running, from two
# drafting steps the fit priced its pass at 0 and drafting for all looked free). And a
# young fit's row swung on one step: a fresh engine's first drafter pass (a prompt
# chunk's 38 rows in 4-7 ms) moved a row from 0.10 ms to 0.07 and bent it down past
# the first knot, and with a young fit's spread taken off (`optimism`), catching up
# 200-600 parked rows looked nearly free: eagle at 16 running drafted for the whole
# batch in its first steps and ran 0.974x speculation off (README). A row's weight is
# one step, not two: a clock 5x the prior's price must still be learnt within 5 % at
# one row (tests/scheduler/test_goodput.py). A head is a layer or two, priced from
# measurement; a draft LM's pass is whatever model the user drafts with, so its prior
# yields to the data at once.
_PRIOR_STEPS_HEAD_PASS, _PRIOR_STEPS_HEAD_ROW = 2.0, 1.0
# Unfitted steps kept before they are added to the sums anyway (a bound: a decision
# reads the fit at least every `GoodputSettings.max_idle_steps` steps).
_MAX_PENDING = 64
# Steps in a row within `GoodputSettings.outlier_ratio` of their price before one over
# it is taken for a stall (`_clip_stalls`).
_CALM_STEPS = 8
# Steps over which the fit is refitted on every step, before only every
# `GoodputSettings.refit_every` steps that teach it: a young fit moves most per step.
_WARM_STEPS = 32


def _prior_precision(drafter_kind: str) -> np.ndarray:
    """Diagonal prior precision, in the units of the fit (seconds, rows)."""
    base, knot = _PRIOR_STEPS_BASE, _PRIOR_STEPS_KNOT
    head = drafter_kind == "head"
    drafting = _PRIOR_STEPS_HEAD_PASS if head else base
    row = _PRIOR_STEPS_HEAD_ROW if head else base
    rows = float(_REFERENCE_ROWS) ** 2
    # The first knot's change weighs as little as a base slope: steps on both sides of
    # it are common (4 running drafting 0-2 each), and rows from 1 to 6 differ too
    # little for a few steps to overrule a heavier prior; but a head's (above).
    hinges = [base * rows] + [knot * rows] * (len(KNOTS) - 1)
    target = [base, base * rows, base * rows, *hinges]
    drafter = [drafting, row * rows, row * rows, *hinges[1:]]
    return np.diag(np.array(target + drafter))


def _by_pass(x: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The regression's rows for observed `steps` (their features `x`), their seconds and
    their ages in steps. A step whose drafter passes were timed apart gives two rows: its
    target's features against its time without the drafter's, and its drafter's features
    against the drafter's time. Steps that draft have both verification rows and drafter
    passes, so from whole steps the fit tells the two apart only where the batch drafts
    unevenly (measured at 4 running: whole steps priced dflash's drafter pass at 7.0 ms,
    its passes timed apart at 3.2 ms, and the runner's draft phase took 3.3 ms a pass)."""
    age = np.arange(len(steps) - 1, -1, -1)
    split = ~np.isnan(steps[:, 6]) & (steps[:, 3] > 0)
    if not split.any():
        return x, steps[:, 4], age
    drafter = np.zeros((int(split.sum()), x.shape[1]))
    drafter[:, _DRAFTER_COLUMN:] = x[split, _DRAFTER_COLUMN:]
    target = x.copy()
    target[split, _DRAFTER_COLUMN:] = 0.0
    seconds = steps[:, 4] - np.where(split, steps[:, 6], 0.0)
    return (np.concatenate([target, drafter]), np.concatenate([seconds, steps[split, 6]]),
            np.concatenate([age, age[split]]))


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
        target, drafters = _PRIORS[settings.step_prior]
        drafter = drafters.get(drafter_kind or "lookup", drafters["lm"])
        self.prior = np.array(target + drafter, dtype=float)
        self.prior_precision = _prior_precision(drafter_kind or "lookup")
        self._prior_moment = self.prior_precision @ self.prior
        self.gram = np.zeros((len(self.prior), len(self.prior)))  # decayed sum of x x'
        self.moment = np.zeros(len(self.prior))  # decayed sum of x * seconds
        self._theta = self.prior.copy()  # as last fitted (`theta` refits first)
        self._cov: np.ndarray | None = None  # of the sums, in units of noise_var (`cov`)
        self._fit_cov = np.linalg.inv(self.prior_precision)  # ... as last fitted
        # predict_one's last (rows, fit, price): a fit is replaced, never edited in place.
        self._last_price: tuple[tuple[int, int, int, float], np.ndarray, float] | None = None
        self.noise_var = 1e-6  # of one step's time around the fit (s^2): ~1 ms to start
        self.forgetting = settings.forgetting
        # Observed steps wait here (target, logits, drafter, passes, seconds, whether
        # the step teaches the noise, the drafter's seconds or NaN) and join the sums
        # in one product (`_fold`) when a decision next refits: a refit per step cost
        # ~0.1 ms of a decision in place at 4 running (the inverse, the solve, four
        # numpy calls a step).
        self._pending: list[tuple[int, int, int, int, float, bool, float]] = []
        self.refit_every = settings.refit_every
        self._teaching = 0  # steps waiting that teach the noise
        self._unfitted = False  # whether the sums hold steps the fit has not seen
        self.outlier_ratio = settings.outlier_ratio
        self.num_stalls = 0  # steps fitted as `outlier_ratio` x their price, not their time
        self._calm = 0  # steps in a row, up to _CALM_STEPS, within that of their price
        self.optimism = settings.optimism
        self.optimism_floor = settings.optimism_floor
        self.num_observed = 0
        self.refits = 0  # fits made so far: a decision kept is priced by the current one

    @staticmethod
    def features(target: np.ndarray, logits: np.ndarray, drafter: np.ndarray,
                 passes: np.ndarray) -> np.ndarray:
        t, d = np.asarray(target, dtype=float), np.asarray(drafter, dtype=float)
        lg, p = np.asarray(logits, dtype=float), np.asarray(passes, dtype=float)
        shape = np.broadcast_shapes(t.shape, lg.shape, d.shape, p.shape)
        x = np.empty((*shape, _NUM_FEATURES))
        first = _DRAFTER_COLUMN  # the drafter's columns start here
        x[..., 0] = 1.0
        x[..., 1] = t - lg
        x[..., 2] = lg
        x[..., 3:first] = np.maximum(lg[..., None] - _KNOTS, 0.0)
        x[..., first] = p
        x[..., first + 1] = d
        x[..., first + 2:] = np.maximum(d[..., None] - _KNOTS, 0.0)
        return x

    @staticmethod
    def features_one(target: int, logits: int, drafter: int, passes: float) -> np.ndarray:
        """`features` of one step, without numpy's per-call cost on eleven tiny columns."""
        return np.array([1.0, target - logits, logits,
                         *(max(logits - knot, 0) for knot in KNOTS), passes, drafter,
                         *(max(drafter - knot, 0) for knot in KNOTS)], dtype=float)

    def predict(self, target: np.ndarray | int, logits: np.ndarray | int,
                drafter: np.ndarray | int, passes: np.ndarray | float) -> np.ndarray:
        """Seconds (>= 1 microsecond) for each (target, logit, drafter rows, drafter
        passes) count."""
        return np.maximum(self.features(np.asarray(target), np.asarray(logits),
                                        np.asarray(drafter), np.asarray(passes))
                          @ self.theta, 1e-6)

    def predict_one(self, target: int, logits: int, drafter: int, passes: float) -> float:
        """`predict` for one step, by the fit as it stood when the policy last planned
        with it (no refit: this prices every step for the metrics, planned or held)."""
        key = (target, logits, drafter, passes)
        memo = self._last_price
        if memo is not None and memo[0] == key and memo[1] is self._theta:
            return memo[2]  # the same rows under the same fit (held steps: most under load)
        price = max(float(self.features_one(target, logits, drafter, passes) @ self._theta),
                    1e-6)
        self._last_price = (key, self._theta, price)
        return price

    def draft_price(self, target: int, logits: int, drafter: int, passes: float,
                    tokens: float) -> DraftPrice:
        """What a chain's next draft must gain in a step of these rows, forecast to make
        `tokens`: the seconds its rows add (a logit row of the target pass and a row of
        a drafter pass), and a drafter pass's own, at the step's tokens per second, by
        the fit `predict_one` prices with. A draft that gains less slows the step's
        rate; the rows' prices past a knot are the dearer slope's."""
        base = self.features_one(target, logits, drafter, passes)
        row = self.features_one(target + 1, logits + 1, drafter + 1, passes) - base
        extra_pass = self.features_one(target, logits, drafter, passes + 1) - base
        rate = tokens / max(float(base @ self._theta), 1e-6)
        return DraftPrice(rate * max(float(row @ self._theta), 0.0),
                          rate * max(float(extra_pass @ self._theta), 0.0))

    @property
    def theta(self) -> np.ndarray:
        """The fit's coefficients over every step observed (refitted first if any
        waits). A decision prices with `fit_for_decision` instead, which refits only
        every `refit_every` steps."""
        if self._pending or self._unfitted:
            self._refresh()
        return self._theta

    @property
    def settled(self) -> bool:
        """Past the first steps, over which the fit is refitted on every step."""
        return self.num_observed > _WARM_STEPS

    def fit_for_decision(self) -> tuple[np.ndarray, np.ndarray]:
        """(theta, its covariance in units of noise_var) for a decision: refitted first
        if `refit_every` steps wait (held steps, which `observe` does not refit for) or
        the sums hold steps the fit has not seen."""
        if len(self._pending) >= self.refit_every or self._unfitted:
            self._refresh()
        return self._theta, self._fit_cov

    def _refresh(self) -> None:
        self._fold()
        self._teaching, self._unfitted = 0, False
        self._fit_cov = self.cov
        self._theta = self._fit(self._fit_cov, self.prior_precision + self.gram,
                                self._prior_moment + self.moment)
        self.refits += 1

    def predict_optimistic(self, target: np.ndarray, logits: np.ndarray,
                           drafter: np.ndarray, passes: np.ndarray) -> np.ndarray:
        """Seconds of each step, the first the base: what each adds to the base is
        predicted `optimism` standard deviations low (never below `optimism_floor` of
        its mean). Where no step
        has varied the rows (a batch that never drafts keeps one operating point), the
        slope is unknown and the extra rows look cheap, so the policy tries them and
        measures; once measured, the deviation is small and the mean decides."""
        theta, cov = self.fit_for_decision()
        x = self.features(target, logits, drafter, passes)
        # Each step's sums in one order whatever else is priced with it: BLAS's `@`
        # gives a row other bits in a call of another height (an AVX2 EPYC's OpenBLAS
        # did, an AVX-512 Zen 5's did not), and a search that prices every depth's
        # prefixes in one call must find what each depth's own call finds. einsum
        # (not optimized: its own loops, no BLAS) sums each row alike, at 1.5-2x `@`'s
        # cost here (27 against 14 us for 64 prefixes).
        mean = np.einsum("ij,j->i", x, theta)
        extra = x - x[0]
        spread = np.sqrt(self.noise_var * (np.einsum("ij,jk->ik", extra, cov)
                                           * extra).sum(axis=1))
        extra_mean = np.maximum(mean - mean[0], 0.0)
        added = np.maximum(extra_mean - self.optimism * spread,
                           self.optimism_floor * extra_mean)
        return np.maximum(mean[0] + added, 1e-6)

    @property
    def cov(self) -> np.ndarray:
        """The inverse of the prior's precision plus the sums, every step folded in."""
        self._fold()
        if self._cov is None:
            self._cov = np.linalg.inv(self.prior_precision + self.gram)
        return self._cov

    def observe(self, target: int, logits: int, drafter: int, passes: int,
                seconds: float, refit: bool = True,
                drafter_seconds: float | None = None) -> None:
        """Add a step to the fit: it waits to join the sums (`_fold`) until the next
        refit. `drafter_seconds`: the share of `seconds` its drafter passes took, if
        the runner timed them apart (`_by_pass`). With `refit` False (a step the
        policy planned nothing for: it held a choice) the noise is left as it is;
        otherwise the step's residual against the fit it was priced by teaches the
        noise, a residual against a fit that has not seen it, so a step the fit has
        seen does not make the noise look smaller than it is."""
        self.num_observed += 1
        self._pending.append((target, logits, drafter, passes, seconds, refit,
                              np.nan if drafter_seconds is None else drafter_seconds))
        self._teaching += refit
        # Refitted every `refit_every` such steps (each step while the model is young:
        # its first steps move it most), so a residual is against a fit a few steps
        # old at most; a fit that old prices as well, as the fit forgets by
        # `forgetting` per step (0.995: a window of ~200 steps).
        if self._teaching >= (self.refit_every if self.settled else 1):
            self._refresh()
        elif len(self._pending) >= _MAX_PENDING:
            self._fold()

    def _fold(self) -> None:
        """Add the steps waiting in `_pending` to the sums, each forgotten as if it had
        joined on its own step (the oldest most), and learn the noise from those that
        teach it, each forgotten by `forgetting` per such step since (as one update per
        step would)."""
        if not self._pending:
            return
        steps = np.array(self._pending)
        self._pending.clear()
        x = self.features(steps[:, 0], steps[:, 1], steps[:, 2], steps[:, 3])
        predicted = np.maximum(x @ self._theta, 1e-6)
        self._clip_stalls(steps, predicted)
        teaching = steps[:, 5] > 0
        if teaching.any():
            residual = steps[teaching, 4] - predicted[teaching]
            age = np.arange(len(residual) - 1, -1, -1)
            self.noise_var = (self.forgetting ** len(residual) * self.noise_var
                              + (1.0 - self.forgetting)
                              * float((self.forgetting ** age) @ (residual * residual)))
        x, seconds, age = _by_pass(x, steps)
        weighted = x * (self.forgetting ** age)[:, None]
        fade = self.forgetting ** len(steps)
        self.gram = self.gram * fade + weighted.T @ x
        self.moment = self.moment * fade + weighted.T @ seconds
        self._cov, self._unfitted = None, True

    def _clip_stalls(self, steps: np.ndarray, predicted: np.ndarray) -> None:
        """Cap a stall's seconds (column 4) at `outlier_ratio` times `predicted`, its
        drafter's seconds (column 6) scaled alike, in place (GoodputSettings.outlier_ratio).
        A step that far over its price is a stall only after `_CALM_STEPS` in a row were
        not: where the fit is far off (a fresh engine on a machine unlike the prior's, a
        drafter pass first priced by a prior of 0) the steps are fitted in full at once."""
        over = steps[:, 4] > self.outlier_ratio * predicted
        if not over.any():
            self._calm = min(self._calm + len(steps), _CALM_STEPS)
            return
        for i in range(len(steps)):
            if not over[i]:
                self._calm = min(self._calm + 1, _CALM_STEPS)
                continue
            if self._calm >= _CALM_STEPS:
                cap = self.outlier_ratio * predicted[i]
                steps[i, 6] *= cap / steps[i, 4]  # NaN (not timed apart) stays NaN
                steps[i, 4] = cap
                self.num_stalls += 1
            self._calm = 0

    def _fit(self, cov: np.ndarray, precision: np.ndarray, moment: np.ndarray) -> np.ndarray:
        """The ridge solution with no negative cost: a coefficient of `_NONNEGATIVE`
        the solution puts below 0 is held at 0 and the rest refitted (an active set,
        at most one round per such coefficient). Where few steps differ in one feature
        alone (steps that run a drafter pass also have its rows), the unconstrained fit
        traded a negative pass for a dear row (measured: parallel at 16 running, pass
        -10 ms, row 0.15 ms), and drafting the whole batch looked cheaper than not.
        `cov`: the inverse of `precision`, which an optimistic price needs anyway."""
        theta = cov @ moment
        free = np.ones(len(theta), dtype=bool)
        for _ in _NONNEGATIVE:
            negative = [i for i in _NONNEGATIVE if free[i] and theta[i] < 0.0]
            if not negative:
                break
            free[negative] = False
            theta = np.zeros_like(theta)
            theta[free] = np.linalg.solve(precision[np.ix_(free, free)], moment[free])
        return theta


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
    # [K + 1] rows a decoding request puts in per step with k drafts: its target rows
    # (1 + its verifications) and its drafter rows (the cumulative sums of the above).
    target_at: np.ndarray
    drafter_at: np.ndarray
    passes_base: int = 0
    passes_drafting: int = 0
    sequential: bool = False
    # [K + 1] a sequential method's one-row steps expected of a step whose deepest
    # request is allowed d drafts (`with_reach`); None: d - 1, every chain drawn to d.
    chain_steps: np.ndarray | None = None

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
        return cls(np.diff(target), np.diff(drafter), int(drafter[0]), target, drafter,
                   int(passes[0]), drafting, sequential)

    def passes(self, num_sampling: int, draft_index: np.ndarray) -> np.ndarray:
        """Drafter passes of the step after each prefix of drafts (the first entry: no
        draft), `draft_index` the 0-based index in its request of each draft added."""
        if not num_sampling:
            return np.zeros(len(draft_index) + 1, dtype=np.int64)
        deepest = np.concatenate([[0], np.maximum.accumulate(draft_index + 1)])
        return self.passes_at_depth(deepest)

    def passes_at_depth(self, deepest: np.ndarray) -> np.ndarray:
        """Drafter passes of a step with requests sampling whose deepest request drafts
        `deepest` (0: none drafts): the base passes, the drafting ones once any drafts,
        and for a sequential method a one-row step per draft past the first."""
        got = self.passes_base + self.passes_drafting * (deepest > 0)
        return got + self.one_row_steps(deepest) if self.sequential else got

    def one_row_steps(self, deepest: np.ndarray) -> np.ndarray:
        """A sequential method's one-row steps where the deepest request is allowed
        `deepest` drafts: one per draft past the first, or as many as its chains are
        expected to reach (`with_reach`)."""
        if self.chain_steps is not None:
            return self.chain_steps[deepest]
        return np.maximum(deepest - 1, 0)

    def with_reach(self, reach: np.ndarray, num_sampling: int) -> DraftCosts:
        """These costs where a chain allowed j drafts proposes its j-th with chance
        `reach[j - 1]` ([K], `ProposalRates`: a gated chain drafter stops short,
        runner/draft_gate.py): the one-row step of depth j runs when any of the
        `num_sampling` chains reaches it. Itself where every chain is drawn whole."""
        if not self.sequential or bool((reach >= 1.0).all()):
            return self
        runs = 1.0 - (1.0 - np.clip(reach[1:], 0.0, 1.0)) ** max(num_sampling, 1)
        steps = np.concatenate([[0.0, 0.0], np.cumsum(runs)])
        return replace(self, chain_steps=steps)
