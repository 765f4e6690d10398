"""The goodput policy's search: which prefix of the batch's drafts, sorted by gain,
gives the step the most expected tokens per predicted second.

The drafts are sorted once per decision (`SortedDrafts`); a sequential drafter's
depths are searched on subsequences of that one order. A prefix fits while its target
rows stay within the budget and its drafts still gain (both hold for a prefix and then
stop, so the search is over that prefix alone). Up to `exhaustive` prefixes are priced
one by one; past it (256 running at K = 4 has 1,024), every `m`-th is priced, and the
first `m` from the start and from each prefix that adds a drafter pass (where the
price jumps), then every prefix within `m` of the best of those: pricing a prefix is
the step-time model's features and their spread, 13 columns a prefix, and at 1,024
running that was half a decision (measured: `benchmarks/goodput_cost.py`, README).
The rate along the prefixes is smooth at that size (a draft adds a thousandth of the
step's rows), but the optimistic price may peak a few drafts past a jump, and the
running maximum that keeps a misfit from rewarding drafts carries such a peak on;
`tests/scheduler/test_prefix_search.py` checks the rate of the grid's choice against
the best prefix's, and that a grid without those runs and the refinement misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from scheduler.step_cost import DraftCosts, StepTimeModel


@dataclass(frozen=True)
class SortedDrafts:
    """A batch's drafts by falling gain (ties in request order, then draft order)."""

    gain: np.ndarray  # [D] the chance the draft and those before it are all accepted
    index: np.ndarray  # [D] its index in its request (0: the first draft)
    request: np.ndarray  # [D] its request

    @classmethod
    def of(cls, gains: np.ndarray) -> SortedDrafts:
        """From [N, K] gains (0 where a request may not draft)."""
        k = gains.shape[1]
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")
        return cls(flat[order], order % k, order // k)

    def below_depth(self, depth: int) -> SortedDrafts:
        """The drafts with index < depth, in the same order (a stable sort of
        gains[:, :depth] orders its ties by (request, index) too)."""
        keep = self.index < depth
        return SortedDrafts(self.gain[keep], self.index[keep], self.request[keep])


class Best(NamedTuple):
    """`PrefixSearch.best`: the best prefix's rate, its smallest gain (inf where no
    prefix beats drafting nothing), by how much drafting falls short where none is
    worth it (else 0), and the price of a draft there (`price`)."""

    rate: float
    threshold: float
    margin: float
    price: float


def price(tokens: np.ndarray, at: np.ndarray, rate: np.ndarray, best: int,
          threshold: float) -> float:
    """The gain a draft needs to pay at the best prefix (`at[best]`, `threshold` its
    smallest gain): what the next draft in order would have to gain for the step with
    it to run at the best rate, never below that draft's own gain (it did not pay);
    where no next prefix fits or was priced, what the last draft in had to gain to pay
    against the prefix without it. Never above `threshold`, so the prefix's own drafts
    pass it. A decision kept for later steps caps each request by this price, not by
    the smallest gain in: at one request that gain is its own last draft's, and a
    request whose next state rated that draft a little lower lost it on every kept
    step (measured: parallel at one request, caps of 2 fell to 1 on kept steps while a
    new decision drafted 2-3, README)."""
    i = int(at[best])
    if not np.isfinite(threshold):
        return threshold
    after, before = np.flatnonzero(at == i + 1), np.flatnonzero(at == i - 1)
    if after.size:
        seconds = tokens[i + 1] / rate[after[0]]
        own = float(tokens[i + 1] - tokens[i])  # the next draft's gain
        return min(max(float(rate[best] * seconds - tokens[i]), own), threshold)
    if before.size:
        seconds = tokens[i] / rate[best]
        return min(max(float(rate[before[0]] * seconds - tokens[i - 1]), 0.0), threshold)
    return threshold


@dataclass(frozen=True)
class PrefixSearch:
    """What a step costs and may hold: the search's fixed inputs for one policy."""

    costs: DraftCosts
    time_model: StepTimeModel
    budget: int  # B: the target pass's rows at most
    exhaustive: int  # prefixes priced one by one at most, past it a grid (module doc)

    def best(self, drafts: SortedDrafts, num_sampling: int, catch_up: np.ndarray) -> Best:
        """The prefix that maximises (tokens) / (predicted seconds): its rate, its
        smallest gain (inf where no prefix beats drafting nothing) and the price of a
        draft there (`price`). Also, where no draft is worth it, by how much the best
        prefix falls short (its tokens per second under those without drafts, as a
        share; 0 where drafts win or none fits)."""
        prefixes = self.prefixes(drafts, num_sampling, catch_up)
        at, rate = self._search(prefixes)
        best = int(np.argmax(rate))
        if at[best] > 0:
            smallest = float(drafts.gain[at[best] - 1])
            return Best(float(rate[best]), smallest, 0.0,
                        price(prefixes.tokens, at, rate, best, smallest))
        runner_up = float(rate[1:].max(initial=-np.inf))
        return Best(float(rate[0]), np.inf,
                    1.0 - runner_up / rate[0] if runner_up > 0 else 0.0, np.inf)

    def prefixes(self, drafts: SortedDrafts, num_sampling: int,
                 catch_up: np.ndarray) -> Prefixes:
        """The prefixes of `drafts` that fit, with their rows and tokens. A request's
        first draft also brings the rows its parked drafter catches up."""
        costs = self.costs
        n = int(np.count_nonzero(drafts.gain > 0))  # sorted: those that gain come first
        index = drafts.index[:n]
        target = num_sampling + np.cumsum(costs.target[index])
        n = int(np.searchsorted(target, self.budget, side="right"))  # target only grows
        index = index[:n]
        base = num_sampling * costs.drafter_base
        added = costs.drafter[index] + np.where(index == 0, catch_up[drafts.request[:n]], 0)
        # Every verification row gives logits, so the target rows are logit rows.
        return Prefixes(rows=np.concatenate([[num_sampling], target[:n]]),
                        drafter=np.concatenate([[base], base + np.cumsum(added)]),
                        passes=costs.passes(num_sampling, index),
                        tokens=num_sampling + np.concatenate([[0.0],
                                                              np.cumsum(drafts.gain[:n])]))

    def _search(self, prefix: Prefixes) -> tuple[np.ndarray, np.ndarray]:
        """The prefixes priced (0 first) and their rates: all n + 1, or a grid of
        every m-th and the runs where the price jumps, then every prefix within m of
        the grid's best (the running maximum of the prices carries a peak on, so the
        grid must hold the peaks)."""
        n = len(prefix.rows) - 1
        if n < self.exhaustive:
            at = np.arange(n + 1)
            return at, prefix.rates(self.time_model, at)[0]
        step = -(-(n + 1) // self.exhaustive)
        # The first m prefixes from the start and from each one that adds a drafter
        # pass: there the price jumps, and its optimism may peak a few drafts on.
        starts = np.concatenate([[0], np.flatnonzero(np.diff(prefix.passes)) + 1])
        runs = (starts[:, None] + np.arange(step)).ravel()
        grid = np.unique(np.concatenate([runs[runs <= n], np.arange(0, n + 1, step), [n]]))
        grid_rate, grid_seconds = prefix.rates(self.time_model, grid)
        centre = int(grid[np.argmax(grid_rate)])
        near = np.arange(max(centre - step + 1, 1), min(centre + step, n + 1))
        # A misfit that predicts less time for more rows must not reward drafting: each
        # prefix near the best is priced at least what the grid's prefixes before it were.
        floor = float(grid_seconds[np.searchsorted(grid, near[0], side="right") - 1])
        near_rate, _ = prefix.rates(self.time_model, np.concatenate([[0], near]), floor)
        return np.concatenate([grid, near]), np.concatenate([grid_rate, near_rate[1:]])


@dataclass(frozen=True)
class Prefixes:
    """Each prefix's target rows, drafter rows, drafter passes and expected tokens
    (the first: no draft)."""

    rows: np.ndarray
    drafter: np.ndarray
    passes: np.ndarray
    tokens: np.ndarray

    def rates(self, time_model: StepTimeModel, at: np.ndarray,
              floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Tokens per predicted second of the prefixes `at` (ascending, 0 first: the
        base the time model prices the rest against), and their seconds, made
        non-decreasing along them and at least `floor` past the base."""
        rows = self.rows[at]
        seconds = time_model.predict_optimistic(rows, rows, self.drafter[at], self.passes[at])
        # A misfit that predicts less time for more rows must not reward drafting.
        seconds = np.maximum.accumulate(seconds)
        if floor:
            seconds[1:] = np.maximum(seconds[1:], floor)
        return self.tokens[at] / seconds, seconds
