"""The goodput policy's prefix search (scheduler/prefix_search.py): one sort shared by a
sequential drafter's depths, the search cut to the prefixes that fit, and past
`exhaustive` prefixes the grid, against pricing every prefix."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import prefix_search
from scheduler.budget import ThrottleRule
from scheduler.config import GoodputSettings
from scheduler.prefix_search import Prefixes, PrefixSearch, SortedDrafts
from scheduler.step_cost import DraftCosts, StepTimeModel
from spec_decode.methods import get_method
from tests.scheduler.test_goodput import policy

K = 4
METHODS = ("ngram", "eagle", "parallel", "dflash")


def search(method: str, seed: int, steps: int, exhaustive: int = 256,
           budget: int = 1 << 16) -> PrefixSearch:
    """A search whose time model saw `steps` steps of a clock whose price per row
    varies step to step (the scatter makes its optimistic prices wiggle, the case the
    prices' running maximum guards)."""
    rule = ThrottleRule(get_method(method), K, budget)
    model = StepTimeModel(rule.method.drafter if rule.method else None, GoodputSettings())
    rng = np.random.default_rng(seed)
    noise = rng.choice([1e-4, 2e-3, 1e-2])
    for _ in range(steps):
        rows, drafter = int(rng.integers(256, 5000)), int(rng.integers(0, 3000))
        passes = int(rng.integers(0, 5))
        seconds = (0.02 + rows * rng.uniform(2e-5, 1e-4) + drafter * 2e-5 + passes * 1e-3
                   + rng.normal(0.0, noise))
        model.observe(rows, rows, drafter, passes, seconds)
    return PrefixSearch(DraftCosts.for_rule(rule), model, budget, exhaustive)


def batch(seed: int, num: int) -> np.ndarray:
    """[N, K] gains: each request's chance its first j + 1 drafts are all accepted."""
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.05, 0.95, (num, 1)) * rng.uniform(0.3, 1.0, (num, K))
    return np.cumprod(rates, axis=1)


def reference(found: PrefixSearch, gains: np.ndarray, num_sampling: int,
              catch_up: np.ndarray) -> tuple[float, float, float]:
    """Every prefix of the whole sorted order priced, those that do not fit ruled out
    afterwards: the search as it was before it was cut to the prefixes that fit."""
    k, costs = gains.shape[1], found.costs
    flat = gains.ravel()
    order = np.argsort(-flat, kind="stable")
    g, j = flat[order], order % k
    target = num_sampling + np.cumsum(costs.target[j])
    base = num_sampling * costs.drafter_base
    added = costs.drafter[j] + np.where(j == 0, catch_up[order // k], 0)
    drafter = np.concatenate([[base], base + np.cumsum(added)])
    rows = np.concatenate([[num_sampling], target])
    seconds = np.maximum.accumulate(found.time_model.predict_optimistic(
        rows, rows, drafter, costs.passes(num_sampling, j)))
    rate = (num_sampling + np.concatenate([[0.0], np.cumsum(g)])) / seconds
    rate[~np.concatenate([[True], (target <= found.budget) & (g > 0)])] = -np.inf
    best = int(np.argmax(rate))
    if best > 0:
        return float(rate[best]), float(g[best - 1]), 0.0
    runner_up = float(rate[1:].max(initial=-np.inf))
    return float(rate[0]), np.inf, (1.0 - runner_up / rate[0] if runner_up > 0 else 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5]), min_size=K, max_size=K),
                min_size=1, max_size=12), st.integers(1, K))
def test_a_depths_drafts_keep_the_order_of_their_own_sort(rows: list[list[float]],
                                                          depth: int) -> None:
    """Sorting once and keeping the drafts below a depth orders them as sorting that
    depth's drafts alone does, ties (many here) included."""
    gains = np.array(rows)
    kept = SortedDrafts.of(gains).below_depth(depth)
    alone = SortedDrafts.of(gains[:, :depth])
    np.testing.assert_array_equal(kept.gain, alone.gain)
    np.testing.assert_array_equal(kept.index, alone.index)
    np.testing.assert_array_equal(kept.request, alone.request)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [24, 200, 4096])
def test_the_search_over_the_prefixes_that_fit_finds_what_pricing_all_did(
        method: str, budget: int) -> None:
    """Below `exhaustive`, cutting the search to the prefixes that fit (the budget,
    drafts that gain) changes nothing: the same rate, threshold and shortfall as
    pricing every prefix and ruling the rest out (zero gains and catch-ups included)."""
    for seed in range(6):
        found = search(method, seed, steps=seed * 8, budget=budget)
        gains = batch(seed, 40)
        gains[::3, 2:] = 0.0  # requests whose rule allows two drafts
        catch_up = np.random.default_rng(seed).integers(0, 3, 40) * (method != "ngram")
        got = found.best(SortedDrafts.of(gains), 40, catch_up)
        want = reference(found, gains, 40, catch_up)
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-12)
        assert got[2] == pytest.approx(want[2], rel=1e-12)


def by_depth_and_alone(method: str, seed: int, num: int, budget: int,
                       exhaustive: int = 256) -> tuple[list, list]:
    """A sequential drafter's depths searched in one call (`best_by_depth`) and each
    depth's drafts searched alone, on a noisy clock, with catch-ups, requests whose rule
    allows fewer drafts and ties."""
    found = search(method, seed, steps=seed * 8, budget=budget, exhaustive=exhaustive)
    rng = np.random.default_rng(seed)
    gains = batch(seed, num)
    gains[rng.random(num) < 0.3, 2:] = 0.0
    gains[rng.random(num) < 0.2] = gains[0]  # ties across requests
    catch_up = rng.integers(0, 40, num) * rng.integers(0, 2, num) / 8.0
    drafts = SortedDrafts.of(gains)
    alone = [found.best(drafts.below_depth(depth), num, catch_up) for depth in range(1, K + 1)]
    return found.best_by_depth(drafts, num, catch_up, K), alone


@pytest.mark.parametrize("num", [1, 2, 4, 16, 40])
@pytest.mark.parametrize("budget", [6, 24, 4096])
def test_every_depth_searched_in_one_call_finds_what_each_depth_alone_did(
        num: int, budget: int) -> None:
    """Below `exhaustive`, pricing every depth's prefixes in one call of the time model
    gives each depth the rate, threshold, shortfall and price its own search gives, to
    the last bit (the decision digests hold too, benchmarks/decision_digest.py); past
    it, each depth's grid runs alone."""
    for seed in range(8):
        for exhaustive in (256, 3):
            together, alone = by_depth_and_alone("eagle", seed, num, budget, exhaustive)
            assert together == alone


def test_the_depth_check_fails_a_search_that_does_not_cap_the_depth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is real: priced with the passes of the whole order (the deepest
    draft so far not capped at the depth), the shallow depths' prices are wrong."""
    def uncapped(index: np.ndarray, max_depth: int) -> np.ndarray:
        return np.broadcast_to(np.maximum.accumulate(index + 1), (max_depth, len(index)))

    monkeypatch.setattr(prefix_search, "deepest_by_depth", uncapped)
    differ = sum(together != alone for seed in range(8)
                 for together, alone in [by_depth_and_alone("eagle", seed, 16, 4096)])
    assert differ > 0


def grid_shortfall(found: PrefixSearch, num: int, seed: int) -> float:
    """How far below the best prefix's rate the grid's choice runs, both priced one by
    one (the grid prices few prefixes, so its own figure for them can differ)."""
    drafts = SortedDrafts.of(batch(seed, num))
    catch_up = np.zeros(num, dtype=np.int64)
    prefixes = found.prefixes(drafts, num, catch_up)
    rates, _ = prefixes.rates(found.time_model, np.arange(len(prefixes.rows)))
    threshold = found.best(drafts, num, catch_up).threshold
    chosen = int(np.count_nonzero(drafts.gain[:len(rates) - 1] >= threshold))
    return 1.0 - float(rates[chosen] / rates.max())


@pytest.mark.parametrize("method", METHODS)
def test_past_exhaustive_the_grid_finds_the_best_prefixs_rate(method: str) -> None:
    """At 256-1,024 running (1,024-4,096 drafts, the grid's size) the grid's choice
    serves within 0.2 % of the best prefix's rate, on time models taught by noisy
    clocks whose optimistic prices wiggle."""
    worst = max(grid_shortfall(search(method, seed, steps=seed % 40 + 20), num, seed)
                for seed in range(12) for num in (256, 600, 1024))
    assert worst < 2e-3


def test_the_grid_check_fails_a_grid_that_is_not_refined(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is real: pricing only every m-th prefix (no runs priced one by
    one from the start and at each new drafter pass, no refinement around the best)
    misses by more than it allows."""
    def coarse(self: PrefixSearch, prefix: Prefixes) -> tuple[np.ndarray, np.ndarray]:
        n = len(prefix.rows) - 1
        step = -(-(n + 1) // self.exhaustive)
        grid = np.unique(np.append(np.arange(0, n + 1, step), n))
        return grid, prefix.rates(self.time_model, grid)[0]

    monkeypatch.setattr(PrefixSearch, "_search", coarse)
    worst = max(grid_shortfall(search(method, seed, steps=seed % 40 + 20), 1024, seed)
                for method in METHODS for seed in range(12))
    assert worst >= 2e-3


def price_bounds(found: PrefixSearch, num: int, seed: int) -> bool:
    """Checks the best prefix's price of a draft for a batch of `num`: it lies between
    the next draft's own gain (that draft did not pay) and the prefix's smallest gain
    (its drafts pass it), and where strictly inside, a next draft gaining exactly the
    price runs at the best rate. Whether it was strictly inside."""
    drafts = SortedDrafts.of(batch(seed, num))
    catch_up = np.zeros(num, dtype=np.int64)
    best = found.best(drafts, num, catch_up)
    prefixes = found.prefixes(drafts, num, catch_up)
    _, seconds = prefixes.rates(found.time_model, np.arange(len(prefixes.rows)))
    i = int(np.count_nonzero(drafts.gain[:len(seconds) - 1] >= best.threshold))
    assert best.price <= best.threshold
    if i + 1 >= len(seconds):
        return False
    assert best.price >= drafts.gain[i]
    if not drafts.gain[i] < best.price < best.threshold:
        return False
    rate = (prefixes.tokens[i] + best.price) / seconds[i + 1]
    assert rate == pytest.approx(best.rate, rel=1e-9)
    return True


@pytest.mark.parametrize("method", METHODS)
def test_the_price_of_a_draft_lies_between_the_next_draft_and_the_last(method: str) -> None:
    """On the noisy clocks above, for every method."""
    for seed in range(12):
        price_bounds(search(method, seed, steps=40), 12, seed)


def test_the_price_of_a_draft_is_where_the_next_draft_breaks_even() -> None:
    """On clean clocks where 2-16 requests draft part of their drafts, the price lies
    strictly below the smallest gain in most batches (the check is not vacuous)."""
    inside = 0
    for row in (5e-5, 1e-4, 2e-4):
        found = policy("ngram", 0.001, row, acceptance=0.5).search
        inside += sum(price_bounds(found, (2, 6, 16)[seed % 3], seed) for seed in range(12))
    assert inside >= 20
