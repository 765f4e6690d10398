"""The goodput policy's search: which prefix of the batch's drafts, sorted by gain, gives
the step the most expected tokens per predicted second.

The drafts are sorted once per decision (`SortedDrafts`); a sequential drafter's
depths are searched on subsequences of that one order, all priced in one call of the
time model where each is priced one by one (`PrefixSearch.best_by_depth`). A prefix
fits while its target rows stay within the budget and its drafts still gain (both hold
for a prefix and then stop, so the search is over that prefix alone). Up to
`exhaustive` prefixes are priced one by one; past it (256 running at K = 4 has 1,024),
every `m`-th is priced, and the first `m` from the start and from each prefix that
adds a drafter pass (where the price jumps), then every prefix within `m` of the best
of those: pricing a prefix is the step-time model's features and their spread, 13
columns a prefix, and at 1,024 running that was half a decision (measured:
`benchmarks/goodput_cost.py`, README). The rate along the prefixes is smooth at that
size (a draft adds a thousandth of the step's rows), but the optimistic price may peak
a few drafts past a jump, and the running maximum that keeps a misfit from rewarding
drafts carries such a peak on; `tests/scheduler/test_prefix_search.py` checks the rate
of the grid's choice against the best prefix's, and that a grid without those runs and
the refinement misses."""

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


def deepest_by_depth(index: np.ndarray, max_depth: int) -> np.ndarray:
    """[D, n] for each depth d = 1..D, the deepest draft (index + 1) among those of the
    order `index` below d up to each position: the full order's running deepest, capped
    at d (a request's shallower drafts come first in the order, so past a draft of
    index >= d its request's draft of index d - 1 came before it)."""
    return np.minimum(np.maximum.accumulate(index + 1), np.arange(1, max_depth + 1)[:, None])


def _best_of(gain: np.ndarray, tokens: np.ndarray, at: np.ndarray, rate: np.ndarray) -> Best:
    """`PrefixSearch.best` from the prefixes priced (`at`, 0 first) and their rates;
    `gain`: the drafts' gains in order, `tokens`: each prefix's expected tokens."""
    best = int(np.argmax(rate))
    if at[best] > 0:
        smallest = float(gain[at[best] - 1])
        return Best(float(rate[best]), smallest, 0.0, price(tokens, at, rate, best, smallest))
    runner_up = float(rate[1:].max(initial=-np.inf))
    return Best(float(rate[0]), np.inf,
                1.0 - runner_up / rate[0] if runner_up > 0 else 0.0, np.inf)


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
        return _best_of(drafts.gain, prefixes.tokens, at, rate)

    def best_by_depth(self, drafts: SortedDrafts, num_sampling: int, catch_up: np.ndarray,
                      max_depth: int) -> list[Best]:
        """`best` of the drafts below each depth 1..max_depth (`SortedDrafts.below_depth`:
        a sequential drafter's search). Where every depth's prefixes are priced one by
        one, all of them go to the time model in one call: four calls of `best` were
        two thirds of a decision for eagle at 1-16 running (~240 of ~340 us, measured
        alone; a decision is ~0.45 ms in place at 4 running, where the forward evicts
        the policy's data). The same prefixes: a depth's are the full order's positions
        holding a draft below it, its sums those of the full order with the other
        drafts' terms zero."""
        costs = self.costs
        n = int(np.count_nonzero(drafts.gain > 0))
        index, gain = drafts.index[:n], drafts.gain[:n]
        # Hundreds running: the deepest depth alone has too many prefixes (checked
        # before the [D, n] sums below are built for nothing).
        if n >= self.exhaustive and (num_sampling + np.cumsum(costs.target[index])
                                     <= self.budget).sum() >= self.exhaustive:
            return self._each_depth(drafts, num_sampling, catch_up, max_depth)
        kept = index[None, :] < np.arange(1, max_depth + 1)[:, None]  # [D, n]
        target = num_sampling + np.cumsum(costs.target[index] * kept, axis=1)
        kept &= target <= self.budget  # target only grows: a prefix of each depth's drafts
        counts = kept.sum(axis=1)
        if int(counts.max(initial=0)) >= self.exhaustive:
            return self._each_depth(drafts, num_sampling, catch_up, max_depth)
        base = num_sampling * costs.drafter_base
        added = costs.drafter[index] + np.where(index == 0, catch_up[drafts.request[:n]], 0)
        drafter = base + np.cumsum(added * kept, axis=1)
        tokens = num_sampling + np.cumsum(gain * kept, axis=1)
        deepest = deepest_by_depth(index, max_depth)
        passes = costs.passes_at_depth(deepest) if num_sampling else np.zeros_like(deepest)
        no_draft = costs.passes(num_sampling, index[:0])[0]
        rows = np.concatenate([[num_sampling], target[kept]])
        seconds = self.time_model.predict_optimistic(
            rows, rows, np.concatenate([[base], drafter[kept]]),
            np.concatenate([[no_draft], passes[kept]]))
        ends = np.cumsum(counts)
        got = []
        for depth in range(max_depth):
            own = np.concatenate([[seconds[0]], seconds[1 + ends[depth] - counts[depth]:
                                                        1 + ends[depth]]])
            # A misfit that predicts less time for more rows must not reward drafting.
            own = np.maximum.accumulate(own)
            own_tokens = np.concatenate([[float(num_sampling)], tokens[depth][kept[depth]]])
            at = np.arange(len(own))
            got.append(_best_of(gain[kept[depth]], own_tokens, at, own_tokens / own))
        return got

    def _each_depth(self, drafts: SortedDrafts, num_sampling: int, catch_up: np.ndarray,
                    max_depth: int) -> list[Best]:
        """`best_by_depth` one depth at a time: where a depth's prefixes are too many
        to price one by one, each depth's grid is its own."""
        return [self.best(drafts.below_depth(depth) if depth < max_depth else drafts,
                          num_sampling, catch_up) for depth in range(1, max_depth + 1)]

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
