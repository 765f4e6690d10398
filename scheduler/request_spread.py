"""How far requests' own acceptance spreads around what their states predict, learnt
from finished requests: it sets how many of a request's verifications its own record
needs before it counts (`AcceptanceEstimates.rates_and_optimism`).

A request's first drafts are Bernoulli draws at its own rate: its states' rate times a
scale of its own. Over finished requests, the squared miss of each one's first-draft
acceptances against its states' forecast is the draws' own variance (binomial) plus its
scale's spread times the forecast squared; what is left over the binomial part is the
spread (method of moments). A Beta prior with that spread is worth
`(1 - p) / (p * v) - 1` verifications, v the scale's variance and p the first-draft rate.

Measured on held-out chat with fixed K = 1 (`benchmarks/request_spread.py`: one
request's first drafts against the others'): heads spread little (eagle, parallel,
dflash: sd 0.12-0.14 around 0.28-0.39, a prior worth 11.5-13 verifications) and lookup
drafters much (ngram, suffix: sd 0.21-0.23 around 0.41, 3.6-4.7), so one fixed weight
either parks a head's request on a few rejections or lets a lookup request's own
record count late.
"""

from __future__ import annotations

# The weight before enough requests have finished, by drafter kind: measured as above
# (36 held-out prompts each), 11.5-13 for the three heads; the lookup drafters' 3.6-4.7
# keep the 4 every method had before. At one request, eagle with 12 ran 0.98x fixed
# K = 2 where 4 ran 0.94x (paired runs, 4 passes each).
PRIOR_WEIGHT_BY_KIND = {"head": 12.0}
PRIOR_WEIGHT = 4.0


def prior_weight(configured: float | None, drafter_kind: str | None) -> float:
    """`GoodputSettings.request_weight` if set, else the drafter kind's measured one."""
    if configured is not None:
        return configured
    return PRIOR_WEIGHT_BY_KIND.get(drafter_kind or "", PRIOR_WEIGHT)


class RequestSpread:
    """Decayed moment sums over finished requests, and the prior weight they imply."""

    def __init__(self, prior_weight: float, min_requests: int, decay: float,
                 max_weight: float, min_verifications: int = 4) -> None:
        # Until `min_requests` have finished (a kind's measured figure may exceed a
        # configured cap: the cap wins).
        self.prior_weight = min(prior_weight, max_weight)
        self.min_requests = min_requests
        self.decay = decay  # per finished request
        self.max_weight = max_weight  # no measurable spread: own records barely count
        self.min_verifications = min_verifications  # fewer say nothing of a rate
        self.requests = 0
        self.miss = 0.0  # sum of (accepted - forecast)^2
        self.binomial = 0.0  # sum of the draws' own variance, forecast * (1 - p)
        self.scale = 0.0  # sum of forecast^2: the spread's share of the miss
        self.forecast = 0.0  # sum of forecasts ...
        self.verifications = 0.0  # ... over the verifications they came from

    def record(self, verifications: int, first_accepted: int, forecast: float) -> None:
        """A finished request: its verifications, how many accepted their first draft,
        and how many its states forecast (the sum of their first-draft rates)."""
        if verifications < self.min_verifications or forecast <= 0.0:
            return
        d = self.decay
        rate = forecast / verifications
        self.requests += 1
        self.miss = self.miss * d + (first_accepted - forecast) ** 2
        self.binomial = self.binomial * d + forecast * (1.0 - rate)
        self.scale = self.scale * d + forecast * forecast
        self.forecast = self.forecast * d + forecast
        self.verifications = self.verifications * d + verifications

    @property
    def variance(self) -> float | None:
        """The variance of a request's scale (0 where the misses are all binomial), or
        None before `min_requests` have finished."""
        if self.requests < self.min_requests or self.scale <= 0.0:
            return None
        return max(self.miss - self.binomial, 0.0) / self.scale

    @property
    def weight(self) -> float:
        """Verifications a request's own record needs before it counts as much as its
        states' rates: the prior's until enough requests have finished, then the Beta
        prior's worth for the measured spread, within [1, max_weight]."""
        variance = self.variance
        if variance is None:
            return self.prior_weight
        p = self.forecast / self.verifications
        if variance <= 0.0 or p <= 0.0:
            return self.max_weight
        return min(max((1.0 - p) / (p * variance) - 1.0, 1.0), self.max_weight)
