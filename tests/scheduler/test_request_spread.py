"""How much a request's own acceptance record counts, learnt from finished requests'
spread (scheduler/request_spread.py), and the scheduler feeding it."""

from __future__ import annotations

import numpy as np
import pytest

from engine.simulate import synthetic_step_time
from runner.simulated import SimulatedRunner
from scheduler.acceptance import AcceptanceEstimates
from scheduler.budget import ThrottleRule
from scheduler.config import GoodputSettings
from scheduler.goodput import GoodputPolicy
from scheduler.request import FRESH, NUM_OUTCOMES
from scheduler.request_spread import RequestSpread
from spec_decode.methods import get_method
from tests.helpers import make_request, make_scheduler, run_step


def spread_of(strength: float | None, rate: float = 0.35, requests: int = 400,
              verifications: int = 40, seed: int = 0) -> RequestSpread:
    """A spread fed `requests` finished requests whose own first-draft rates are drawn
    from a Beta of mean `rate` worth `strength` verifications (all at `rate` if None),
    each forecast at `rate`."""
    rng = np.random.default_rng(seed)
    spread = RequestSpread(prior_weight=4.0, min_requests=16, decay=1.0, max_weight=64.0)
    if strength is None:
        own = np.full(requests, rate)
    else:
        own = rng.beta(rate * strength, (1 - rate) * strength, requests)
    for p in own:
        spread.record(verifications, int(rng.binomial(verifications, p)), verifications * rate)
    return spread


@pytest.mark.parametrize(("strength", "low", "high"), [(12.0, 8.0, 18.0), (3.0, 2.0, 4.5)])
def test_the_weight_is_what_the_requests_spread_is_worth(strength: float, low: float,
                                                         high: float) -> None:
    """Requests whose own rates spread as a Beta worth 12 (a head, measured) or 3 (a
    lookup drafter) verifications: the learnt weight finds it."""
    assert low <= spread_of(strength).weight <= high


def test_requests_alike_leave_their_own_records_barely_counting() -> None:
    """No spread beyond the draws' own: the weight is the largest allowed. (Without
    the binomial part taken off the misses it would read ~verifications - 1 = 39.)"""
    assert spread_of(None).weight == 64.0


def test_the_prior_holds_until_enough_requests_finished() -> None:
    spread = spread_of(3.0, requests=15)
    assert spread.variance is None and spread.weight == 4.0
    spread.record(40, 14, 14.0)
    assert spread.variance is not None and spread.weight != 4.0


def test_requests_verified_a_few_times_say_nothing() -> None:
    spread = RequestSpread(4.0, min_requests=2, decay=1.0, max_weight=64.0)
    for _ in range(50):
        spread.record(3, 0, 1.0)
        spread.record(3, 3, 1.0)
    assert spread.requests == 0 and spread.weight == 4.0


def test_a_learnt_weight_keeps_a_few_rejections_from_parking_a_request() -> None:
    """Four first drafts rejected: with the prior's weight of 4 a request is rated at
    half its state's rate; once finished requests show a head's small spread, at ~3/4."""
    est = AcceptanceEstimates(4, GoodputSettings(prior_acceptance=0.35))
    rejected = np.zeros((1, NUM_OUTCOMES), dtype=np.int64)
    rejected[0, FRESH] = 4

    def rate() -> float:
        own, _ = est.rates_and_optimism(rejected, np.zeros(1), np.array([FRESH]))
        return float(own[0, 0])

    before = rate()
    assert before == pytest.approx(0.35 * 0.5)
    rng = np.random.default_rng(1)
    for p in rng.beta(0.35 * 12, 0.65 * 12, 200):
        verifications = [0] * NUM_OUTCOMES
        verifications[FRESH] = 40
        est.record_finished(verifications, int(rng.binomial(40, p)))
    assert rate() > 0.35 * 0.65 > before


@pytest.mark.parametrize(("method", "configured", "weight"),
                         [("eagle", None, 12.0), ("dflash", None, 12.0), ("ngram", None, 4.0),
                          ("draft_model", None, 4.0), ("eagle", 6.0, 6.0)])
def test_before_any_request_finishes_the_weight_is_the_drafter_kinds(
        method: str, configured: float | None, weight: float) -> None:
    """A head's requests spread less than a lookup drafter's (measured), so a fresh
    engine already lets a head's request's own record count later; a configured
    weight wins."""
    policy = GoodputPolicy(ThrottleRule(get_method(method), 4, 4096), 2048,
                           GoodputSettings(request_weight=configured))
    assert policy.acceptance.spread.weight == weight


@pytest.mark.parametrize(("field", "value"), [("request_weight", 0.5),
                                              ("request_weight", 100.0),
                                              ("spread_min_requests", 1),
                                              ("spread_decay", 0.0),
                                              ("max_request_weight", 0.5),
                                              ("max_request_weight", float("nan"))])
def test_bad_spread_settings_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"GoodputSettings.{field}"):
        GoodputSettings(**{field: value})  # type: ignore[arg-type]


def test_the_scheduler_teaches_the_spread_from_every_finished_request() -> None:
    """Requests that all accept alike (the simulated runner's one rate), on a clock
    where drafting pays, so every request drafts and is verified: each one that
    finishes is counted, and the weight it learns, the largest, shows in the stats."""
    sched = make_scheduler("ngram", k=4, budget=256, draft_policy="goodput",
                           max_model_len=512)
    assert sched.policy is not None
    runner = SimulatedRunner(sched, acceptance=0.9, seed=3,
                             step_time=synthetic_step_time(0.02, 0.0001))
    for i in range(40):
        sched.add_request(make_request(f"r{i}", 5 + i % 7, max_tokens=40, ignore_eos=True))
    assert sched.stats.goodput.request_weight is None
    while sched.has_unfinished_requests():
        run_step(sched, runner)
    spread = sched.policy.acceptance.spread
    assert spread.requests == 40
    assert spread.weight == sched.stats.goodput.request_weight == 64.0
    assert sched.stats.goodput.as_dict()["request_weight"] == 64.0


def test_a_kinds_prior_weight_never_exceeds_a_configured_cap() -> None:
    policy = GoodputPolicy(ThrottleRule(get_method("eagle"), 4, 4096), 2048,
                           GoodputSettings(max_request_weight=8.0))
    assert policy.acceptance.spread.weight == 8.0
