"""The goodput draft policy: its estimates, its allocation, and the scheduler using it.

The estimates and the step-time model are injected (settings, a seeded simulated
clock), so every decision here is deterministic."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.simulate import synthetic_step_time
from runner.simulated import SimulatedRunner
from scheduler.acceptance import (
    AcceptanceEstimates,
    ForecastCheck,
    ProposalRates,
    reaching_by_state,
    span_of,
)
from scheduler.budget import ThrottleRule
from scheduler.config import GoodputSettings
from scheduler.goodput import GoodputPolicy
from scheduler.request import (
    ALL_ACCEPTED,
    FRESH,
    NONE_ACCEPTED,
    NUM_OUTCOMES,
    SOME_ACCEPTED,
    outcome,
)
from scheduler.scheduler import Scheduler
from scheduler.step_cost import (
    _CALM_STEPS,
    _MAX_PENDING,
    _WARM_STEPS,
    KNOTS,
    DraftCosts,
    StepTimeModel,
)
from spec_decode.methods import get_method
from tests.helpers import drain, make_request, make_scheduler, run_step

K = 4


def policy(method: str, seconds_per_pass: float, seconds_per_row: float,
           acceptance: float, **knobs: float) -> GoodputPolicy:
    """A policy whose time model has learnt a clock of that form, and whose global
    estimates have seen many verifications at `acceptance` per reached draft."""
    rule = ThrottleRule(get_method(method), K, 4096)
    chosen = GoodputSettings(**knobs)  # type: ignore[arg-type]
    model = StepTimeModel(rule.method.drafter if rule.method else None, chosen)
    clock = synthetic_step_time(seconds_per_pass, seconds_per_row)
    rng = np.random.default_rng(0)
    for i in range(300):
        # Rows spread over every segment of the model (log-uniform: as many steps below
        # the first knot as past the last), so every slope is identifiable, and steps
        # without a drafter pass, so its constant is too (not a copy of the target's).
        target, drafter = (int(np.exp(rng.uniform(0.0, np.log(600)))) for _ in range(2))
        drafter *= i % 2
        logits = int(rng.integers(1, target + 1))  # the clock does not price them apart
        model.observe(target, logits, drafter, int(drafter > 0),
                      clock({"target": target, "draft": drafter}))
    gp = GoodputPolicy(rule, 8192, chosen, model)
    # Each reached draft accepted with probability `acceptance`: the accepted prefix of
    # K drafts is geometric.
    accepted = np.minimum(rng.geometric(1 - acceptance, 400) - 1, K)
    gp.acceptance.record([K] * 400, accepted.tolist())
    return gp


def history(reached: list[int] | np.ndarray) -> np.ndarray:
    """[N, NUM_OUTCOMES]: each request's verifications, all made from state FRESH."""
    got = np.zeros((len(reached), NUM_OUTCOMES), dtype=np.int64)
    got[:, FRESH] = reached
    return got


def caps(gp: GoodputPolicy, num: int, reached: int = 0, accepted: int = 0,
         state: int = FRESH) -> np.ndarray:
    return gp.caps(history([reached] * num), np.full(num, accepted), np.full(num, state),
                   np.full(num, K))


def test_acceptance_counts_only_reached_positions() -> None:
    """3 verified, 1 accepted: positions 0 and 1 were reached, only 0 accepted; 2 was
    never reached (a rejection before it), so it says nothing about position 2."""
    est = AcceptanceEstimates(4, GoodputSettings(prior_weight=0.0, decay=1.0))
    est.record([3], [1])
    assert est.reached[FRESH, 0].tolist() == [1, 1, 0, 0]
    assert est.accepted[FRESH, 0].tolist() == [1, 0, 0, 0]
    est.record([4, 2], [4, 2])
    assert est.reached[FRESH, 0].tolist() == [3, 3, 1, 1]
    assert est.accepted[FRESH, 0].tolist() == [3, 2, 1, 1]
    assert not est.reached[FRESH + 1:].any()  # no state given: every one is FRESH


def test_a_prior_per_position_starts_each_position_there() -> None:
    """A tuple prior (a trained head's measured acceptance) sets each position's rate
    before any verification, its last repeated past its end; verifications then move
    each position from its own prior. A prior outside [0, 1] is refused by name."""
    settings = GoodputSettings(prior_acceptance=(0.36, 0.47, 0.42))
    est = AcceptanceEstimates(5, settings)
    assert est.pooled_rates() == pytest.approx([0.36, 0.47, 0.42, 0.42, 0.42])
    assert GoodputSettings(prior_acceptance=0.3).prior_by_position(2) == (0.3, 0.3)
    est.record([1] * 8, [1] * 8)  # 8 first drafts, all accepted: weight 8 each side
    assert est.pooled_rates()[0] == pytest.approx((8 + 8 * 0.36) / 16)
    assert est.pooled_rates()[1:] == pytest.approx([0.47, 0.42, 0.42, 0.42])
    for bad in ((), (0.5, 1.5), -0.1):
        with pytest.raises(ValueError, match="prior_acceptance"):
            GoodputSettings(prior_acceptance=bad)  # type: ignore[arg-type]


def test_a_low_measured_prior_keeps_a_fresh_batch_from_drafting() -> None:
    """Eight fresh requests whose head was measured to accept its first draft 0.2 of
    the time draft less than under the generic prior (0.5), on the same step-time
    model: the prior is what a fresh engine decides on. (At sixteen, the CPU prior's
    price of a verification row past the first knot keeps both from drafting.)"""
    num = 8
    rule = ThrottleRule(get_method("eagle"), K, 4096)
    drafts = []
    for prior in (0.5, 0.2):
        policy = GoodputPolicy(rule, 256, GoodputSettings(prior_acceptance=prior,
                                                          explore=0.0))
        caps = policy.caps(np.zeros((num, NUM_OUTCOMES), dtype=np.int64),
                           np.zeros(num, dtype=np.int64), np.full(num, FRESH),
                           np.full(num, K))
        drafts.append(int(caps.sum()))
    assert drafts[1] < drafts[0]


def test_a_prior_measured_on_served_drafts_earns_a_fresh_request_less_optimism() -> None:
    """The verifications a measured prior stands on count as the method's own history
    in the optimism a fresh request gets (not in its rates): a head served on hundreds
    of verifications starts nearly sure, the generic prior does not. A negative or NaN
    count is refused by name."""
    est = AcceptanceEstimates(K, GoodputSettings(prior_acceptance=0.36))
    measured = AcceptanceEstimates(K, GoodputSettings(prior_acceptance=0.36,
                                                      prior_evidence=312))
    fresh = (history([0]), np.zeros(1), np.full(1, FRESH))
    own, bonus = est.rates_and_optimism(*fresh)
    own_measured, bonus_measured = measured.rates_and_optimism(*fresh)
    np.testing.assert_allclose(own_measured, own)
    assert bonus[0] == pytest.approx(GoodputSettings().explore)
    assert bonus_measured[0] == pytest.approx(GoodputSettings().explore
                                              * np.sqrt(8 / (8 + 312)))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="prior_evidence"):
            GoodputSettings(prior_evidence=bad)


def test_outcomes_and_counts_per_state() -> None:
    assert [outcome(3, 3), outcome(3, 1), outcome(3, 0), outcome(1, 1)] == [
        ALL_ACCEPTED, SOME_ACCEPTED, NONE_ACCEPTED, ALL_ACCEPTED]
    # counts [1, 3] in state FRESH and [2] in state NONE_ACCEPTED, width 3
    got = reaching_by_state(np.array([1, 3, 2]), np.array([FRESH, FRESH, NONE_ACCEPTED]), 3)
    want = np.zeros((4, 3), dtype=int)
    want[FRESH], want[NONE_ACCEPTED] = [2, 1, 1], [1, 1, 0]
    assert got.tolist() == want.tolist()


def test_a_verification_counts_under_the_state_its_drafts_were_chosen_in() -> None:
    """A step's k is chosen before that step verifies, so the drafts it verifies next
    were chosen knowing the state the verification before left. Accept everything,
    then nothing, then anything: the first two verifications count under FRESH (the
    state when the first two k were chosen), the third under ALL_ACCEPTED, never under
    NONE_ACCEPTED (what the state was as the drafts were proposed)."""
    scheduler = make_scheduler("ngram", k=2, budget=64)
    runner = SimulatedRunner(scheduler, acceptance=1.0)
    request = make_request("r", 8, max_tokens=32)
    scheduler.add_request(request)
    run_step(scheduler, runner)  # prefill: samples, proposes its first drafts
    seen = []
    for acceptance in (1.0, 0.0, 0.5):
        runner.acceptance = acceptance
        out, _ = run_step(scheduler, runner)
        assert out.scheduled_spec_decode_tokens["r"]  # it verified drafts
        seen.append(request.last_outcome)
    assert seen[:2] == [ALL_ACCEPTED, NONE_ACCEPTED]
    assert request.verifications_by_state == [2, 1, 0, 0]


def test_a_request_in_a_run_of_accepted_drafts_drafts_deeper() -> None:
    """Drafts come in runs: after a verification that accepted everything the next
    drafts are accepted 0.9 of the time, after one that rejected everything 0.1. Same
    history otherwise, same costs: the first request drafts all K, the second none."""
    gp = policy("ngram", 0.02, 0.0008, acceptance=0.5)
    rng = np.random.default_rng(2)
    for state, rate in ((ALL_ACCEPTED, 0.9), (NONE_ACCEPTED, 0.1)):
        accepted = np.minimum(rng.geometric(1 - rate, 400) - 1, K)
        gp.acceptance.record([K] * 400, accepted.tolist(), [state] * 400)
    got = gp.caps(history([50, 50]), np.full(2, 25), np.array([ALL_ACCEPTED, NONE_ACCEPTED]),
                  np.full(2, K))
    assert got.tolist() == [K, 0]


def test_the_time_model_learns_the_clock_it_is_fed() -> None:
    model = policy("eagle", 0.01, 0.0005, 0.5).time_model
    clock = synthetic_step_time(0.01, 0.0005)
    for target, drafter in ((1, 1), (16, 16), (300, 40), (64, 0)):
        expect = clock({"target": target, "draft": drafter})
        assert float(model.predict(target, target, drafter, int(drafter > 0))) == \
            pytest.approx(expect, rel=0.05)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 80), st.integers(0, 3),
                          st.floats(0.001, 0.2), st.booleans()), min_size=1, max_size=150))
def test_unfitted_steps_fold_into_the_sums_as_if_added_one_by_one(
        steps: list[tuple[int, int, int, float, bool]]) -> None:
    """Steps wait and join the sums in one product when the fit is next refitted (every
    step over the first `_WARM_STEPS`, then every `refit_every` steps that teach the
    noise; more than `_MAX_PENDING` waiting fold on the way): the same sums, fit and
    prices as adding each on its own step, and the noise of each teaching step's
    residual against the fit as last refitted (each step capped at `outlier_ratio` times
    that fit's price)."""
    lazy = StepTimeModel("head", GoodputSettings())
    eager = StepTimeModel("head", GoodputSettings())
    fit, teaching, calm = eager.theta.copy(), 0, 0
    for i, (target, drafter, passes, seconds, refit) in enumerate(steps):
        rows = (target, min(target, 16), drafter, passes)
        lazy.observe(*rows, seconds, refit=refit)
        x = eager.features_one(*rows)
        price = max(float(x @ fit), 1e-6)
        if seconds <= eager.outlier_ratio * price:
            calm += 1
        else:  # over: a stall after calm steps counts as 4x its price
            if calm >= _CALM_STEPS:
                seconds = eager.outlier_ratio * price
            calm = 0
        if refit:
            residual = seconds - price
            eager.noise_var += (1 - eager.forgetting) * (residual ** 2 - eager.noise_var)
            teaching += 1
        eager.gram = eager.gram * eager.forgetting + np.outer(x, x)
        eager.moment = eager.moment * eager.forgetting + x * seconds
        eager._cov = None
        if teaching >= (1 if i < _WARM_STEPS else eager.refit_every):
            eager._refresh()
            fit, teaching = eager._theta.copy(), 0
    eager._refresh()
    assert np.allclose(lazy.cov, eager.cov, rtol=1e-9, atol=1e-12)
    assert np.allclose(lazy.gram, eager.gram, rtol=1e-9)
    assert np.allclose(lazy.theta, eager.theta, rtol=1e-7, atol=1e-12)
    assert lazy.noise_var == pytest.approx(eager.noise_var, rel=1e-9)


def test_a_decision_reads_a_fit_refitted_every_few_steps() -> None:
    """Past its first steps the fit a decision prices by is refitted once `refit_every`
    steps teach it, not on every step: between refits it is the same object."""
    model = StepTimeModel("lookup", GoodputSettings(refit_every=4))
    for _ in range(_WARM_STEPS):
        model.observe(16, 16, 0, 0, 0.03)
    fits = []
    for i in range(8):
        model.observe(16 + i, 16 + i, 0, 0, 0.03 + 0.001 * i)
        fits.append(model.fit_for_decision()[0])
    assert [f is fits[0] for f in fits[:3]] == [True] * 3  # refitted on the 4th step
    assert fits[3] is not fits[2] and all(f is fits[3] for f in fits[3:7])
    assert fits[7] is not fits[6]


def test_unfitted_steps_wait_in_a_bounded_list() -> None:
    """A fit nobody reads (a policy holding for long) keeps at most `_MAX_PENDING`
    steps waiting: the rest are in the sums."""
    model = StepTimeModel("lookup", GoodputSettings())
    for _ in range(3 * _MAX_PENDING):
        model.observe(16, 16, 0, 0, 0.03, refit=False)
        assert len(model._pending) < _MAX_PENDING
    assert model.gram[0, 0] > _MAX_PENDING  # the folded steps' constant column


def test_no_cost_is_fitted_below_zero() -> None:
    """Drafting steps always have drafter rows, and here those with few rows ran faster
    than steps without a drafter pass (noise): unconstrained, the fit prices the pass
    below zero, so a drafting step with few rows looks cheaper than none. The pass is
    held at 0 and the rows pay for the rest."""
    model = StepTimeModel("head", GoodputSettings())
    for _ in range(50):
        model.observe(16, 16, 0, 0, 0.032)
        model.observe(16, 16, 10, 1, 0.031)
        model.observe(16, 16, 100, 1, 0.040)
    pass_cost = 3 + len(KNOTS)  # the feature's index: constant, t - l, l, the knots
    assert model.theta[pass_cost] == 0.0
    assert (model.theta[[0, 1, 2, pass_cost, pass_cost + 1]] >= 0).all()
    drafting = model.predict(np.full(3, 16), np.full(3, 16), np.array([1, 10, 100]),
                             np.ones(3, dtype=int))
    assert (drafting >= float(model.predict(16, 16, 0, 0)) - 1e-9).all()


def test_rows_never_tried_look_cheap_until_measured() -> None:
    """Steps at one operating point (64 rows, every one a decode row; 2 ms of noise)
    teach the total but not the slope: 64 more rows are priced below the mean, so the
    policy tries them, but never below `optimism_floor` of the mean (the fit forgets,
    so its spread regrows while nobody drafts). Without optimism the price is the
    mean. Once steps at varied rows are seen, the optimistic price meets the mean, and
    the mean the clock."""
    models = {knob: StepTimeModel("lookup", GoodputSettings(optimism=knob))
              for knob in (0.0, 1.0, 100.0)}
    rows, none = np.array([64, 128]), np.zeros(2)

    def added(knob: float, optimistic: bool = True) -> float:
        model = models[knob]
        got = (model.predict_optimistic(rows, rows, none, none) if optimistic
               else model.predict(rows, rows, none, none))
        return float(got[1] - got[0])

    rng = np.random.default_rng(4)
    for _ in range(200):
        seconds = 0.016 + 0.001 * 64 + float(rng.normal(0, 0.002))
        for model in models.values():
            model.observe(64, 64, 0, 0, seconds)
    mean = added(1.0, optimistic=False)
    assert added(1.0) < 0.85 * mean
    assert added(100.0) == pytest.approx(GoodputSettings().optimism_floor * mean)
    assert added(0.0) == pytest.approx(added(0.0, optimistic=False))
    for _ in range(200):
        decode = int(rng.integers(32, 160))
        models[1.0].observe(decode, decode, 0, 0,
                            0.016 + 0.001 * decode + float(rng.normal(0, 0.001)))
    assert added(1.0) == pytest.approx(added(1.0, optimistic=False), rel=0.05)
    assert added(1.0, optimistic=False) == pytest.approx(0.064, rel=0.05)


def test_no_drafts_where_the_model_predicts_a_loss() -> None:
    """Every row costs as much as a pass (compute-bound) and drafts are rarely right:
    drafting can only lose, so no request drafts, a new one included."""
    gp = policy("ngram", 0.001, 0.01, acceptance=0.2)
    assert caps(gp, 32).tolist() == [0] * 32 and gp.new_request_cap == 0


def test_every_draft_where_rows_are_nearly_free_and_accepted() -> None:
    gp = policy("ngram", 0.05, 0.00001, acceptance=0.95)
    assert caps(gp, 4).tolist() == [K] * 4 and gp.new_request_cap == K


def test_a_request_that_keeps_rejecting_stops_drafting() -> None:
    """One batch, same costs: a request whose drafts were all rejected drafts nothing,
    one that accepted nearly all drafts the most."""
    gp = policy("ngram", 0.02, 0.001, acceptance=0.5)
    got = gp.caps(history([200, 200, 0]), np.array([0, 195, 0]), np.zeros(3, dtype=int),
                  np.full(3, K))
    assert got[0] == 0 and got[1] == K and 0 < got[2] < K


def test_drafts_are_rated_by_the_span_of_the_answer_they_are_in() -> None:
    """A lookup drafter copies more as the answer grows: drafts made in the first 16
    output tokens are accepted 0.1 of the time, past 64 tokens 0.7, whatever the state.
    Two requests alike but for their output length: the early one drafts nothing, the
    late one drafts. The (state, span) cell never seen, "all accepted" early, is rated
    by its row and its column: below "all accepted" late, above "none accepted" early."""
    gp = policy("ngram", 0.02, 0.002, acceptance=0.4)
    rng = np.random.default_rng(6)
    for produced, rate in ((4, 0.1), (80, 0.7)):
        for state in (NONE_ACCEPTED, ALL_ACCEPTED):
            if state == ALL_ACCEPTED and produced == 4:
                continue
            accepted = np.minimum(rng.geometric(1 - rate, 300) - 1, K)
            gp.acceptance.record([K] * 300, accepted.tolist(), [state] * 300, [produced] * 300)
    past, first = history([20, 20]), np.array([8, 8])
    got = gp.caps(past, first, np.full(2, NONE_ACCEPTED), np.full(2, K),
                  produced=np.array([4, 80]))
    assert got[0] == 0 < got[1]
    rates = gp.acceptance.request_rates(history([0] * 3), np.zeros(3),
                                        np.array([ALL_ACCEPTED, ALL_ACCEPTED, NONE_ACCEPTED]),
                                        explore=False, produced=np.array([4, 80, 4]))
    assert rates[2, 0] < rates[0, 0] < rates[1, 0]


def test_a_parked_requests_record_fades_back_to_the_method_rates() -> None:
    """A request whose 12 drafts were all rejected, and whose last verification left
    "none accepted", drafts nothing next; once it has made 64 tokens unverified (four
    half-lives), its record and state count for little and it is rated by what the
    method's drafts in its span of the answer got: it drafts again. Without the fading
    it never would, since a request that drafts nothing is never verified again. (A
    row costs a tenth of a step here, so a draft needs 0.1 tokens.)"""
    gp = policy("ngram", 0.02, 0.002, acceptance=0.5, reuse_steps=1)  # no holding
    rng = np.random.default_rng(4)
    gp.acceptance.record([K] * 400, np.minimum(rng.geometric(0.8, 400) - 1, K).tolist(),
                         [NONE_ACCEPTED] * 400)  # the state predicts rejections

    def capped(unverified: int | None) -> int:
        return int(gp.caps(history([12]), np.zeros(1, dtype=int),
                           np.array([NONE_ACCEPTED]), np.full(1, K),
                           unverified=None if unverified is None else np.array([unverified]))[0])

    assert capped(None) == capped(0) == 0
    assert capped(64) > 0
    rates = gp.acceptance.request_rates(history([12]), np.zeros(1), np.array([NONE_ACCEPTED]),
                                        explore=False, unverified=np.array([1000]))
    np.testing.assert_allclose(rates[0], gp.acceptance.span_rates()[0], atol=1e-3)


def test_a_fresh_request_gets_less_optimism_as_the_method_is_measured() -> None:
    """A request with no history is rated above the method's rates (so the policy
    learns it), by less once the method has verified many drafts."""
    gp = GoodputPolicy(ThrottleRule(get_method("ngram"), K, 4096), 8192)
    fresh = (history([0]), np.zeros(1), np.full(1, FRESH))
    bonus = [float(gp.acceptance.request_rates(*fresh)[0, 0]
                   - gp.acceptance.position_rates()[FRESH, 0])]
    gp.acceptance.record([K] * 400, [1, 0] * 200)
    bonus.append(float(gp.acceptance.request_rates(*fresh)[0, 0]
                       - gp.acceptance.position_rates()[FRESH, 0]))
    assert bonus[0] == pytest.approx(GoodputSettings().explore)
    assert 0 < bonus[1] < bonus[0] / 5


def forecast_gap(forecast_weight: float) -> list[int]:
    """Caps of 16 requests stepped by a policy whose estimates rate its drafts at 0.7
    (pinned: nothing it learns changes them) while every draft is rejected; rows are
    cheap, so at 0.7 every draft pays and at a tenth of it none does."""
    gp = policy("ngram", 0.02, 0.0003, acceptance=0.7, forecast_weight=forecast_weight)
    pinned = gp.acceptance.request_rates(history([40] * 17), np.full(17, 28),
                                         np.full(17, FRESH))  # 16 and a fresh one
    gp.acceptance.request_rates = lambda *_, **__: pinned  # type: ignore[method-assign]
    got = []
    for _ in range(60):
        cap = caps(gp, 16)
        got.append(int(cap.sum()))
        verified = [int(c) for c in cap if c]
        gp.observe_step(verified, [0] * len(verified), [FRESH] * len(verified),
                        (16, 16, 0, 0), None)
    return got


def test_drafts_forecast_to_pay_that_never_do_stop() -> None:
    """The forecast check: the chosen drafts got none of the 0.7 forecast, so the
    forecasts are scaled down until no draft is worth it. With the check held off (a
    prior no outcome can move), the same estimates draft to the end."""
    checked = forecast_gap(GoodputSettings().forecast_weight)
    assert checked[0] > 0 and checked[-10:] == [0] * 10
    unchecked = forecast_gap(1e12)
    assert min(unchecked) > 0


def test_the_forecast_check_waits_a_step_for_its_outcome() -> None:
    """Drafts allowed when a step is planned are verified by the next one: the first
    step's verifications (none were allowed before) settle nothing."""
    check = ForecastCheck(GoodputSettings(forecast_weight=1.0))
    check.expect(4.0, 8)
    check.settle(0, 8)
    assert check.factor == 1.0
    check.expect(1.0, 8)
    check.settle(2, 8)  # settles the first forecast: 0.5 per draft, 8 verified, 2 got
    assert check.factor == pytest.approx((1.0 * 0.999 ** 8 + 2) / (1.0 * 0.999 ** 8 + 4))


def test_more_load_means_fewer_drafts() -> None:
    gp = policy("ngram", 0.02, 0.0003, acceptance=0.6)
    per_request = [caps(gp, n, 40, 24).mean() for n in (1, 16, 256)]
    assert per_request[0] > per_request[1] > per_request[2]


def test_a_pass_bound_by_its_weights_drafts_everything_worth_a_token() -> None:
    """Below the first knot a row costs next to nothing (the pass reads the weights
    either way); prefill chunks past it cost 0.6 ms a row. Fed one request's decode
    steps of 1-5 rows and a prefill now and then, the model keeps the two apart, so a
    lone request drafts all K at acceptance 0.4 (its fourth draft gains ~0.026 tokens,
    the row costs 0.05 ms of a 20 ms step that yields ~1.7 tokens). A single slope
    fitted through both priced a decode row at ~0.5 ms and drafted 2-3."""
    def clock(rows: int) -> float:
        return 0.02 + 0.00005 * rows + 0.0006 * max(rows - 16, 0)

    gp = GoodputPolicy(ThrottleRule(get_method("ngram"), K, 4096), 256)
    rng = np.random.default_rng(1)
    for step in range(400):
        rows = int(rng.integers(20, 60)) if step % 20 == 0 else int(rng.integers(1, 6))
        gp.observe_step([], [], [], (rows, rows if rows < 6 else 1, 0, 0),
                        clock(rows) + float(rng.normal(0, 0.001)))
    accepted = np.minimum(rng.geometric(0.6, 400) - 1, K)
    gp.acceptance.record([K] * 400, accepted.tolist())
    assert caps(gp, 1, 200, 80).tolist() == [K]


def test_cheap_prefill_rows_do_not_make_verification_rows_look_cheap() -> None:
    """A row that gives logits costs 2 ms (LM head, sampling, attention over a long
    context), a prefill row 0.1 ms. Fed 64-request decode steps (every row gives
    logits) and prefill chunks of 256 rows, the model prices one more verification row
    at ~2 ms, so 64 requests at acceptance 0.5 draft nothing (a draft would gain 0.5
    tokens for 2 ms where the step yields 64 tokens in ~0.15 s)."""
    def clock(target: int, logits: int) -> float:
        return 0.02 + 0.0001 * target + 0.002 * logits

    gp = GoodputPolicy(ThrottleRule(get_method("ngram"), K, 4096), 2048)
    rng = np.random.default_rng(3)
    for step in range(300):
        if step % 4 == 0:  # a prefill chunk, one request finishing its prompt
            rows = (256, 1)
        else:
            decode = 64 + int(rng.integers(0, 64))
            rows = (decode, decode)
        gp.observe_step([], [], [], (*rows, 0, 0), clock(*rows) + float(rng.normal(0, 0.002)))
    model = gp.time_model
    marginal = float(model.predict(101, 101, 0, 0) - model.predict(100, 100, 0, 0))
    assert marginal == pytest.approx(0.0021, rel=0.15)
    accepted = np.minimum(rng.geometric(0.5, 400) - 1, K)
    gp.acceptance.record([K] * 400, accepted.tolist())
    assert caps(gp, 64, 50, 25).tolist() == [0] * 64


@settings(max_examples=200, deadline=None)
@given(rule_k=st.lists(st.integers(0, K), min_size=1, max_size=20),
       reached=st.integers(0, 100), share=st.floats(0, 1), per_row=st.floats(0, 0.01),
       remaining=st.none() | st.lists(st.integers(1, 10**9), min_size=20, max_size=20))
def test_caps_never_exceed_the_rule(rule_k: list[int], reached: int, share: float,
                                    per_row: float, remaining: list[int] | None) -> None:
    gp = policy("dflash", 0.02, per_row, acceptance=0.7)
    num = len(rule_k)
    left = None if remaining is None else np.array(remaining[:num])
    got = gp.caps(history([reached] * num), np.full(num, int(reached * share)),
                  np.zeros(num, dtype=int), np.array(rule_k), remaining=left)
    assert (got <= np.array(rule_k)).all() and (got >= 0).all()


def test_draft_costs_follow_the_cost_table() -> None:
    """A request with k = 0 is parked: no drafter rows. dflash: its first draft brings
    its context rows (the chunk of 2), the query block's bonus and mask rows; each
    later one a context row and a mask row. eagle: the first draft its 2 context rows,
    each later one a context row and a one-row step."""
    dflash = DraftCosts.for_rule(ThrottleRule(get_method("dflash"), K, 4096))
    assert dflash.target.tolist() == [1] * K
    assert dflash.drafter.tolist() == [4, 2, 2, 2] and dflash.drafter_base == 0
    eagle = DraftCosts.for_rule(ThrottleRule(get_method("eagle"), K, 4096))
    assert eagle.drafter.tolist() == [2, 2, 2, 2] and eagle.drafter_base == 0


def test_draft_costs_count_the_drafter_passes() -> None:
    """Parked requests run no pass: dflash runs its context and query passes once any
    request drafts; eagle runs one pass, then one one-row step per draft past the
    first of the deepest request; ngram runs none. Drafts added by index 0, 0, 1, 2, 0."""
    added = np.array([0, 0, 1, 2, 0])
    dflash = DraftCosts.for_rule(ThrottleRule(get_method("dflash"), K, 4096))
    assert dflash.passes(3, added).tolist() == [0, 2, 2, 2, 2, 2]
    assert dflash.passes(0, added[:0]).tolist() == [0]  # nothing samples: no pass
    eagle = DraftCosts.for_rule(ThrottleRule(get_method("eagle"), K, 4096))
    assert eagle.passes(3, added).tolist() == [0, 1, 1, 2, 3, 3]
    ngram = DraftCosts.for_rule(ThrottleRule(get_method("ngram"), K, 4096))
    assert ngram.passes(3, added).tolist() == [0] * 6


def test_a_gated_chains_one_row_steps_are_priced_by_how_far_chains_go() -> None:
    """Where a chain allowed j drafts proposes its j-th with chance reach[j - 1] (a
    confidence gate stops it short), the one-row step of depth j runs when any sampling
    chain reaches it: at one request 0.5 and 0.25, at two 0.75 and 0.4375. Chains drawn
    whole keep the count of the cost table; a method without one-row steps has none."""
    eagle = DraftCosts.for_rule(ThrottleRule(get_method("eagle"), 3, 4096))
    assert eagle.with_reach(np.ones(3), 1) is eagle
    deepest = np.array([0, 1, 2, 3])
    one = eagle.with_reach(np.array([1.0, 0.5, 0.25]), 1)
    assert one.passes_at_depth(deepest).tolist() == pytest.approx([0, 1, 1.5, 1.75])
    assert one.one_row_steps(deepest).tolist() == pytest.approx([0, 0, 0.5, 0.75])
    two = eagle.with_reach(np.array([1.0, 0.5, 0.25]), 2)
    assert two.one_row_steps(deepest).tolist() == pytest.approx([0, 0, 0.75, 1.1875])
    assert eagle.passes_at_depth(deepest).tolist() == [0, 1, 2, 3]
    dflash = DraftCosts.for_rule(ThrottleRule(get_method("dflash"), 3, 4096))
    assert dflash.with_reach(np.array([1.0, 0.5, 0.25]), 1) is dflash


def test_proposal_rates_start_at_a_measured_prior() -> None:
    """A gated head's measured reach, the last repeated, behind `weight` observations;
    chains then seen drawn whole move it toward 1."""
    rates = ProposalRates(4, decay=1.0, prior=(1.0, 0.5, 0.2), weight=8.0)
    assert rates.rates.tolist() == pytest.approx([1.0, 0.5, 0.2, 0.2])
    rates.record([4] * 8, [4] * 8)
    assert rates.rates.tolist() == pytest.approx([1.0, 0.75, 0.6, 0.6])
    assert ProposalRates(2, decay=1.0).rates.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="prior_proposals must be rates in"):
        GoodputSettings(prior_proposals=(1.0, 1.5))


def test_a_gated_chain_drafts_deeper_where_its_steps_are_dear() -> None:
    """One request, eagle, a one-row step 8 ms on a 20 ms step, drafts accepted 0.45
    then 0.5 of the time: drawn whole, a third draft (0.11 tokens) does not pay for
    its step; where chains reach their third draft a fifth of the time (a confidence
    gate), the step is priced at a fifth and the third draft is allowed."""
    def draw(rng: np.random.Generator) -> tuple[int, int, int, int]:
        k = int(rng.integers(0, K + 1))
        return 1 + k, 1 + k, 1 + k, int(k > 0) + max(k - 1, 0)

    def cap(prior: tuple[float, ...]) -> int:
        gp = taught_pass_clock("eagle", draw, seed=2, noise=0.0002)
        gp.proposals = ProposalRates(K, 1.0, prior, 1e6)
        with_rates(gp, np.tile([0.45, 0.5, 0.5, 0.5], (NUM_OUTCOMES, 1)))
        return int(gp.caps(history([100]), np.array([45]), np.array([ALL_ACCEPTED]),
                           np.array([K]))[0])

    whole, gated = cap(()), cap((1.0, 0.2, 0.2, 0.2))
    assert whole <= 2 < gated


def taught_pass_clock(method: str,
                      draw: Callable[[np.random.Generator], tuple[int, int, int, int]],
                      seed: int, noise: float) -> GoodputPolicy:
    """A policy whose time model has seen 300 steps of `draw`'s rows (target, logit,
    drafter rows, drafter passes) on a clock where a drafter pass costs 8 ms whatever
    its rows: 20 ms a step, 0.1 ms a target row, 0.05 ms a drafter row."""
    gp = GoodputPolicy(ThrottleRule(get_method(method), K, 4096), 4096)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        target, logits, drafter, passes = draw(rng)
        seconds = 0.02 + 0.0001 * target + 0.008 * passes + 0.00005 * drafter
        gp.observe_step([], [], [], (target, logits, drafter, passes),
                        seconds + float(rng.normal(0, noise)))
    return gp


def with_rates(gp: GoodputPolicy, rates: np.ndarray) -> None:
    """Every state's and span's acceptance per position [NUM_OUTCOMES, K], as if
    measured on a million verifications."""
    gp.acceptance.reached[:] = 1e6
    gp.acceptance.accepted[:] = rates[:, None, :] * 1e6


def test_a_pass_that_runs_only_for_drafts_is_priced_whole() -> None:
    """dflash's query pass costs 8 ms whatever its rows, a row 0.1-0.15 ms. One request
    of 16 alone cannot pay for the pass with its 0.6-likely first draft (0.6 tokens for
    8 ms, where the step yields 0.5 tokens a ms); the same drafts from all 16 can.
    Without the pass count, one draft looked like 0.25 ms and was taken."""
    def draw(rng: np.random.Generator) -> tuple[int, int, int, int]:
        drafting = int(rng.integers(0, 17))
        return 16 + drafting, 16 + drafting, 16 + 3 * drafting, 1 + (drafting > 0)

    gp = taught_pass_clock("dflash", draw, seed=5, noise=0.0005)
    with_rates(gp, np.full((NUM_OUTCOMES, K), 0.6))
    past, first = history([100] * 16), np.full(16, 60)
    alone = gp.caps(past, first, np.array([ALL_ACCEPTED] + [NONE_ACCEPTED] * 15),
                    np.array([K] + [0] * 15))
    assert alone.tolist() == [0] * 16
    everyone = gp.caps(past, first, np.full(16, ALL_ACCEPTED), np.full(16, K))
    assert (everyone >= 1).all()


# ---- the scheduler with the policy -------------------------------------------------


def run_workload(draft_policy: str, seconds_per_row: float, acceptance: float) -> tuple:
    sched = make_scheduler("ngram", k=K, budget=256, max_num_seqs=16,
                           draft_policy=draft_policy, max_model_len=512)
    runner = SimulatedRunner(sched, acceptance=acceptance, seed=3,
                             step_time=synthetic_step_time(0.02, seconds_per_row))
    for i in range(16):
        sched.add_request(make_request(f"r{i}", 5 + i, max_tokens=40, ignore_eos=True))
    outputs = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched, runner)
        outputs.append(out)
    return sched, outputs


def test_the_scheduler_stops_drafting_when_the_clock_says_it_loses() -> None:
    """16 requests, each row as dear as a pass, drafts mostly rejected: after the first
    steps teach the model, no request drafts; the fixed policy drafts K throughout."""
    sched, outputs = run_workload("goodput", 0.02, 0.1)
    late = outputs[len(outputs) // 2:]
    assert all(not out.num_draft_tokens for out in late)
    assert sched.stats.goodput.share_steps_k0 is not None
    assert sched.stats.goodput.share_steps_k0 > 0.5
    _, fixed = run_workload("fixed", 0.02, 0.1)
    assert any(k == K for out in fixed[len(fixed) // 2:] for k in out.num_draft_tokens.values())


def test_the_scheduler_drafts_the_most_when_rows_are_cheap() -> None:
    """The prior prices a verification row at ~1 ms; a few steps of drafting teach
    the model that rows are nearly free here, and from then on every request drafts K
    (until the rule cuts k near max_tokens)."""
    sched, outputs = run_workload("goodput", 0.00001, 0.9)
    chosen = sched.stats.goodput.chosen_k
    assert chosen[K] == max(chosen)
    assert any(sorted(out.num_draft_tokens.values()) == [K] * 16 for out in outputs[:10])
    assert sched.stats.goodput.num_timed_steps == len(outputs)


def stalled_workload(outlier_ratio: float) -> Scheduler:
    """16 ngram requests on an affine clock whose every 30th step stalls for a second
    (kernels compiling on a fresh engine, the host preempting it)."""
    sched = make_scheduler("ngram", k=K, budget=256, max_num_seqs=16, max_model_len=512,
                           draft_policy="goodput",
                           goodput=GoodputSettings(outlier_ratio=outlier_ratio))
    clock, calls = synthetic_step_time(0.02, 0.0005), [0]

    def stalling(rows: dict[str, int]) -> float:
        calls[0] += 1
        return clock(rows) + (1.0 if calls[0] % 30 == 0 else 0.0)

    runner = SimulatedRunner(sched, acceptance=0.6, seed=3, step_time=stalling)
    for i in range(16):
        sched.add_request(make_request(f"r{i}", 5 + i, max_tokens=120, ignore_eos=True))
    drain(sched, runner)
    return sched


def test_the_scheduler_prices_steps_by_the_clock_not_its_stalls() -> None:
    """The stalls are counted (`stall_steps`, a metric) and fitted at a cap, so a step of
    16 decodes is priced near the clock's 28 ms; fitted as measured (the check is real),
    the same stalls price it far over."""
    truth = 0.02 + 0.0005 * 16
    capped = stalled_workload(GoodputSettings().outlier_ratio)
    assert capped.stats.goodput.stall_steps >= 3
    assert capped.stats.goodput.as_dict()["stall_steps"] == capped.stats.goodput.stall_steps
    assert float(capped.policy.time_model.predict(16, 16, 0, 0)) == pytest.approx(truth, rel=0.25)
    raw = stalled_workload(float("inf"))
    assert raw.stats.goodput.stall_steps == 0
    assert float(raw.policy.time_model.predict(16, 16, 0, 0)) > 1.5 * truth


def launch_bound_workload(step_prior: str, seed: int) -> Scheduler:
    """32 eagle requests, 16 at a time, K <= 2, on a GPU's clock (a step 12 ms whatever
    its rows, a head's pass 1.3 ms: an H200's, README), each draft accepted 0.42 of the
    time: drafting k = 1-2 for everyone gains 10-20 % there."""
    sched = make_scheduler("eagle", k=2, budget=512, max_num_seqs=16, max_model_len=1024,
                           block_size=16, num_blocks=4096, draft_policy="goodput",
                           goodput=GoodputSettings(step_prior=step_prior))
    runner = SimulatedRunner(sched, acceptance=0.42, seed=seed,
                             step_time=synthetic_step_time(0.012, 0.000005, 0.0013))
    for i in range(32):
        sched.add_request(make_request(f"r{i}", 30 + (i * 7) % 40, max_tokens=64,
                                       ignore_eos=True))
    drain(sched, runner)
    return sched


@pytest.mark.parametrize("seed", [0, 2])
def test_on_a_gpus_clock_the_gpu_prior_drafts_where_the_cpu_prior_parks(seed: int) -> None:
    """The CPU's prior prices a verification row ~1 ms; on a clock where rows are free
    and nobody drafts, no step shows otherwise, so it parks for good (98 % of steps
    here, the check that the test is real); the GPU's prior drafts, and its steps keep
    it right."""
    parked = launch_bound_workload("cpu", seed).stats.goodput
    assert parked.share_steps_k0 is not None and parked.share_steps_k0 > 0.9
    drafting = launch_bound_workload("gpu", seed).stats.goodput
    assert drafting.share_steps_k0 is not None and drafting.share_steps_k0 < 0.1
    assert sum(drafting.chosen_k[1:]) > 10 * drafting.chosen_k[0]


def test_the_step_prior_and_the_stall_cap_are_checked() -> None:
    with pytest.raises(ValueError, match="step_prior must be one of cpu, gpu"):
        GoodputSettings(step_prior="tpu")
    for ratio in (1.0, 0.5, float("nan")):  # a cap at or below the price caps every step
        with pytest.raises(ValueError, match="outlier_ratio must be > 1"):
            GoodputSettings(outlier_ratio=ratio)
    assert GoodputSettings(outlier_ratio=float("inf")).outlier_ratio == float("inf")


def test_the_scheduler_keeps_each_requests_last_outcome() -> None:
    """Every draft accepted leaves ALL_ACCEPTED, every one rejected NONE_ACCEPTED, and
    the policy learns under the state each verification started from."""
    for acceptance, state in ((1.0, ALL_ACCEPTED), (0.0, NONE_ACCEPTED)):
        sched = make_scheduler("ngram", k=K, budget=256, draft_policy="goodput")
        assert sched.policy is not None
        runner = SimulatedRunner(sched, acceptance=acceptance, seed=0)
        sched.add_request(make_request("r", 8, max_tokens=30, ignore_eos=True))
        for _ in range(6):
            run_step(sched, runner)
        assert sched.requests["r"].last_outcome == state
        assert sched.policy.acceptance.reached[state].any()


def test_the_scheduler_records_each_verification_at_its_span_of_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every verification is learnt under the span its request's output length was in
    when it drafted: counted here apart from the steps, as output tokens before each
    step that verified drafts."""
    sched = make_scheduler("ngram", k=K, budget=256, draft_policy="goodput",
                           max_model_len=512)
    assert sched.policy is not None
    seen: list[list[int] | None] = []
    real = sched.policy.acceptance.record

    def record(verified, accepted, states=None, produced=None):  # type: ignore[no-untyped-def]
        if verified:
            seen.append(None if produced is None else list(produced))
        return real(verified, accepted, states, produced)

    monkeypatch.setattr(sched.policy.acceptance, "record", record)
    runner = SimulatedRunner(sched, acceptance=0.7, seed=2)
    sched.add_request(make_request("r", 8, max_tokens=90, ignore_eos=True))
    want = []
    while sched.has_unfinished_requests():
        before = sched.requests["r"].num_output_tokens
        out, _ = run_step(sched, runner)
        if out.scheduled_spec_decode_tokens.get("r"):
            want.append([before])
    assert seen == want and len(want) > 5
    spans = span_of([w[0] for w in want])
    assert spans.max() >= 2  # past 32 tokens: the test reaches a later span
    reached = sched.policy.acceptance.reached[..., 0].sum(axis=0)  # per span
    assert (reached[np.unique(spans)] > 0).all()
    assert not reached[np.setdiff1d(np.arange(len(reached)), spans)].any()


def test_the_scheduler_tells_the_policy_how_long_each_request_went_unverified(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy is forced to park the request from its fifth step on; the tokens it
    is told the request made since its last verification are counted here apart,
    from the steps that verified drafts and the tokens each step made. Without shadow
    drafts (a parked ngram request's would verify it: tests/scheduler/test_shadow.py),
    as for every method whose drafts cost rows."""
    sched = make_scheduler("ngram", k=K, budget=256, draft_policy="goodput",
                           goodput=GoodputSettings(max_shadows=0))
    assert sched.policy is not None
    seen: list[int] = []
    real_caps = sched.policy.caps

    def caps(*args, unverified=None, **kw):  # type: ignore[no-untyped-def]
        got = real_caps(*args, unverified=unverified, **kw)
        if unverified is None:  # nothing running yet
            return got
        seen.append(int(unverified[0]))
        return got * 0 if len(seen) >= 5 else got

    monkeypatch.setattr(sched.policy, "caps", caps)
    runner = SimulatedRunner(sched, acceptance=0.5, seed=1)
    sched.add_request(make_request("r", 8, max_tokens=30, ignore_eos=True))
    run_step(sched, runner)  # the prompt: no caps asked
    want, made, last_verified = [], sched.requests["r"].num_output_tokens, 0
    for _ in range(12):
        want.append(made - last_verified)
        out, _ = run_step(sched, runner)
        if out.scheduled_spec_decode_tokens.get("r"):
            last_verified = made
        made = sched.requests["r"].num_output_tokens
    assert seen == want
    assert want[-1] >= 7  # parked for the last steps, so the count grew


def test_a_policy_asking_past_the_rule_is_held_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: caps far above K. The scheduler takes min(rule, cap), so the
    strict runner (which re-derives the rule) accepts every step and drains."""
    monkeypatch.setattr(GoodputPolicy, "caps",
                        lambda self, reached, accepted, states, rule_k, *args, **kwargs:
                        np.full(len(rule_k), 99))
    sched = make_scheduler("pard", k=K, budget=64, max_model_len=48, draft_policy="goodput")
    runner = SimulatedRunner(sched, acceptance=1.0, seed=0)
    sched.add_request(make_request("r", 10, max_tokens=60, ignore_eos=True))
    drain(sched, runner)
    assert sched.stats.goodput.chosen_k[K] > 0  # it did draft K where the rule allowed




@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, K), st.integers(0, K), st.integers(0, NUM_OUTCOMES - 1),
                          st.integers(0, 400)), min_size=1, max_size=4))
def test_a_few_verifications_are_counted_as_the_histograms_count_them(
        steps: list[tuple[int, int, int, int]]) -> None:
    """One to four verifications a step are added one by one; the counts are the
    histograms' (the path every larger step takes), cell by cell."""
    import scheduler.acceptance as acceptance

    verified = [v for v, _, _, _ in steps]
    accepted = [min(a, v) for v, a, _, _ in steps]
    states = [s for _, _, s, _ in steps]
    produced = [p for _, _, _, p in steps]
    few = AcceptanceEstimates(K, GoodputSettings())
    few.record(verified, accepted, states, produced)
    many = AcceptanceEstimates(K, GoodputSettings())
    few_limit, acceptance._FEW = acceptance._FEW, 0
    try:
        many.record(verified, accepted, states, produced)
    finally:
        acceptance._FEW = few_limit
    assert np.array_equal(few.reached, many.reached)
    assert np.array_equal(few.accepted, many.accepted)
    assert few.reached.sum() > 0


def test_only_a_few_requests_a_step_draft_on_optimism_alone() -> None:
    """A fresh method: drafts at the prior's rates do not pay, the optimism a request
    with no history gets makes one draft pay. Only `max_explorers` of them draft in a
    step, the oldest running first, then as many of those admitted; the rest get what
    their rates earn without optimism (nothing). Without the limit, every one drafts."""
    def fresh_policy(max_explorers: int) -> GoodputPolicy:
        gp = policy("ngram", 0.02, 0.002, acceptance=0.5, max_explorers=max_explorers)
        gp.acceptance = AcceptanceEstimates(K, gp.settings)  # nothing verified yet
        return gp

    def step(gp: GoodputPolicy, num: int) -> list[int]:
        return gp.caps(history([0] * num), np.zeros(num), np.full(num, FRESH),
                       np.full(num, K)).tolist()

    unlimited = fresh_policy(100)
    assert step(unlimited, 10) == [1] * 10
    assert unlimited.admission_cap() == 1
    gp = fresh_policy(4)
    assert step(gp, 10) == [1] * 4 + [0] * 6
    assert [gp.admission_cap() for _ in range(3)] == [0, 0, 0]
    assert min(step(gp, 2)) > 0  # two explore: two slots left for admissions
    hopeful, earned = gp.new_request_cap, gp.earned_request_cap
    assert hopeful > earned
    assert [gp.admission_cap() for _ in range(3)] == [hopeful, hopeful, earned]


def test_the_scheduler_takes_each_admitted_requests_cap_from_the_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests admitted in one step each ask the policy for their cap in turn
    (`admission_cap`: the step's explorer slots run out), and draft by it."""
    scheduler = make_scheduler("ngram", k=K, budget=256, draft_policy="goodput")
    gp = scheduler.policy
    assert gp is not None
    caps = iter([K, 1, 0, 0])
    monkeypatch.setattr(gp, "admission_cap", lambda: next(caps))
    runner = SimulatedRunner(scheduler, seed=0, acceptance=0.0)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", prompt_len=8, max_tokens=40))
    run_step(scheduler, runner)
    assert [len(r.spec_token_ids) for r in scheduler.running] == [K, 1, 0, 0]


def test_the_rate_tables_are_rebuilt_once_enough_verifications_are_new() -> None:
    """A decision reads the estimates' rate tables as last built until the verifications
    recorded since exceed `stale_share` of those counted: then they match the counts."""
    est = AcceptanceEstimates(K, GoodputSettings(stale_share=0.1))
    est.record([K] * 100, [1] * 100)
    built = est.tables()
    est.record([K] * 5, [K] * 5)  # 5 new of ~100 counted: not yet
    assert est.tables() is built
    est.record([K] * 6, [K] * 6)  # 11 new
    fresh = est.tables()
    assert fresh is not built
    np.testing.assert_allclose(fresh.pooled, est.pooled_rates())
    np.testing.assert_allclose(fresh.cells, est.cell_rates(
        est.pooled_rates(), est.position_rates(), est.span_rates()))


def test_rows_below_the_first_knot_are_learnt_free_and_past_it_dear() -> None:
    """This CPU's forward costs the same for 1 to 6 rows, then ~1 ms a row: steps at 1
    and 4 running (1-12 logit rows) teach both, so a draft that keeps a step below the
    knot is priced nearly free and one past it at a row's cost. One slope through
    both (no knot there) priced each row at the average and drafted too little."""
    model = StepTimeModel("lookup", GoodputSettings())
    rng = np.random.default_rng(5)
    for _ in range(300):
        rows = int(rng.integers(1, 13))
        seconds = 0.03 + 0.001 * max(rows - 6, 0) + float(rng.normal(0, 0.001))
        model.observe(rows, rows, 0, 0, seconds)
    price = model.predict(np.array([1, 5, 8, 12]), np.array([1, 5, 8, 12]), np.zeros(4),
                          np.zeros(4))
    assert price[1] - price[0] < 0.0005  # four rows below the knot
    assert price[3] - price[2] == pytest.approx(0.004, rel=0.2)  # four past it


def test_a_sequential_drafter_may_draft_everyone_shallow() -> None:
    """eagle: every draft past a request's first adds a one-row pass (8 ms here) for the
    whole step. One request accepts 0.95 of its drafts, three 0.5 of their first.
    Sorted by gain, the first request's four drafts come before anyone else's first,
    so every prefix that drafts for all four pays four passes, and none beats drafting
    nothing; one draft each, one pass, does (6.45 tokens in 29 ms against 4 in 20)."""
    def draw(rng: np.random.Generator) -> tuple[int, int, int, int]:
        drafting, depth = int(rng.integers(0, 5)), int(rng.integers(1, K + 1))
        drafts = drafting * depth
        return 4 + drafts, 4 + drafts, drafts + drafting, depth * (drafting > 0)

    gp = taught_pass_clock("eagle", draw, seed=6, noise=0.0003)
    rates = np.full((NUM_OUTCOMES, K), 0.3)
    rates[:, 0] = 0.5
    rates[ALL_ACCEPTED] = 0.95
    with_rates(gp, rates)
    got = gp.caps(history([100] * 4), np.full(4, 50),
                  np.array([ALL_ACCEPTED] + [NONE_ACCEPTED] * 3), np.full(4, K))
    assert got.tolist() == [1, 1, 1, 1]


def parked_caps(method: str, catch_up_steps: int, left: int) -> np.ndarray:
    """Caps of four parked requests, each 45 rows behind (its prompt), first drafts
    accepted 0.45 of the time, on a fresh CPU time model, each able to make `left`
    more output tokens."""
    num = 4
    rule = ThrottleRule(get_method(method), K, 4096)
    policy = GoodputPolicy(rule, 256, GoodputSettings(prior_acceptance=0.45, explore=0.0,
                                                      catch_up_steps=catch_up_steps))
    return policy.caps(np.zeros((num, NUM_OUTCOMES), dtype=np.int64),
                       np.zeros(num, dtype=np.int64), np.full(num, FRESH), np.full(num, K),
                       behind=np.full(num, 45), left=np.full(num, left))


@pytest.mark.parametrize("method", ["eagle", "parallel", "dflash"])
def test_a_catch_up_is_spread_over_the_steps_it_serves(method: str) -> None:
    """Four running requests, parked with 45 rows to catch up each: the catch-up is
    paid once and serves every later draft, so spread over the steps ahead they draft
    (measured at 4 running: parked for good, parallel ran 0.964x off against fixed
    K = 1's 1.11x). With two tokens left to make, there is nothing to spread it over."""
    assert parked_caps(method, GoodputSettings().catch_up_steps, left=60).all()
    assert not parked_caps(method, GoodputSettings().catch_up_steps, left=2).any()


@pytest.mark.parametrize("method", ["eagle", "parallel", "dflash"])
def test_a_catch_up_charged_whole_keeps_them_parked(method: str) -> None:
    """The check above is real: charged whole to the step that pays it, the same
    catch-up keeps all four parked."""
    assert not parked_caps(method, 1, left=60).any()
    with pytest.raises(ValueError, match="catch_up_steps"):
        GoodputSettings(catch_up_steps=0)


def test_a_closed_batch_that_cannot_fit_a_draft_holds_without_drafting() -> None:
    """Four requests on a budget of four rows: no plan with a draft fits, so drafting
    falls short by an infinite margin. The plan drafts nothing and is held the most
    steps, and holding on for fewer requests scales that margin (it once raised
    OverflowError turning the infinite margin into steps; found by the state machine)."""
    taught = policy("ngram", 0.02, 0.0001, 0.9, finish_min_running=1)
    gp = GoodputPolicy(ThrottleRule(get_method("ngram"), K, 4096), 4, taught.settings,
                       taught.time_model)
    gp.acceptance.record([K] * 50, [K] * 50)
    got = gp.caps(history([10] * 4), np.full(4, 10), np.full(4, ALL_ACCEPTED), np.full(4, K),
                  remaining=np.full(4, 40))
    assert not got.any()
    assert gp.holding(4, closed=True)
    assert gp.holding(3, closed=True)  # a request finished: held on, fewer steps
    assert not gp.hold().any()


def test_rates_by_state_are_each_states_rates_in_one_lookup() -> None:
    """`rates_by_state` (the kept choice's and the closed plan's table) gives, for every
    state, exactly what `rates_and_optimism` gives a request in that state with nothing
    unverified: its span's cell, scaled by its own record."""
    gp = policy("ngram", 0.02, 0.0005, acceptance=0.5)
    rng = np.random.default_rng(5)
    for state, rate in ((ALL_ACCEPTED, 0.8), (SOME_ACCEPTED, 0.4), (NONE_ACCEPTED, 0.1)):
        accepted = np.minimum(rng.geometric(1 - rate, 200) - 1, K)
        gp.acceptance.record([K] * 200, accepted.tolist(), [state] * 200,
                             rng.integers(0, 300, 200).tolist())
    num = 7
    record = rng.integers(0, 30, (num, NUM_OUTCOMES))
    firsts = rng.integers(0, 30, num)
    produced = rng.integers(0, 300, num)
    table = gp.acceptance.rates_by_state(record, firsts, produced)
    assert table.shape == (num, NUM_OUTCOMES, K)
    for state in range(NUM_OUTCOMES):
        own, _ = gp.acceptance.rates_and_optimism(record, firsts, np.full(num, state),
                                                  np.zeros(num, dtype=int), produced)
        assert np.array_equal(table[:, state], own)
    assert not np.allclose(table[:, ALL_ACCEPTED], table[:, NONE_ACCEPTED])


def test_the_time_model_is_fed_the_one_row_steps_the_chains_ran() -> None:
    """A chain drafter may propose fewer drafts than allowed (a confidence gate): the
    step is fitted with the one-row steps its longest chain really ran (none where
    every chain stopped at one draft), not those the policy allowed (K - 1)."""
    sched = make_scheduler("eagle", k=K, budget=256, draft_policy="goodput",
                           max_model_len=512)
    runner = SimulatedRunner(sched, acceptance=1.0, seed=1,
                             step_time=synthetic_step_time(0.02, 0.0001))
    assert sched.policy is not None
    execute, observe, price = (runner.execute, sched.policy.observe_step,
                               sched.policy.chain_steps)
    seen: list[int] = []
    priced: list[float] = []

    def one_draft(out):  # type: ignore[no-untyped-def]
        result = execute(out)
        result.draft_token_ids = {rid: d[:1] for rid, d in result.draft_token_ids.items()}
        return result

    def record(verified, accepted, states, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(rows[3])
        return observe(verified, accepted, states, rows, *args, **kwargs)

    def priced_steps(deepest: int, num_sampling: int) -> float:
        priced.append(price(deepest, num_sampling))
        return priced[-1]

    runner.execute = one_draft  # type: ignore[method-assign]
    sched.policy.observe_step = record  # type: ignore[method-assign]
    sched.policy.chain_steps = priced_steps  # type: ignore[method-assign]
    sched.add_request(make_request("r", 6, max_tokens=30, ignore_eos=True))
    drain(sched, runner)
    assert any(steps > 0 for steps in priced)  # the policy priced chains past one draft
    assert all(fed <= 1 for fed in seen)  # one pass, no one-row step, ever ran


def _taught_model() -> StepTimeModel:
    """A head's model taught steps at varied rows, drafter rows and passes."""
    model = StepTimeModel("head", GoodputSettings())
    rng = np.random.default_rng(7)
    for _ in range(60):
        t, d = int(rng.integers(1, 200)), int(rng.integers(0, 60))
        model.observe(t, t, d, int(rng.integers(0, 5)),
                      0.01 + 1e-4 * t + 5e-5 * d + float(rng.normal(0, 1e-3)))
    return model


def _prices_alone_and_together(model: StepTimeModel) -> tuple[np.ndarray, np.ndarray]:
    """Each of 300 steps priced with the base alone, and all of them in one call."""
    rng = np.random.default_rng(8)
    rows = np.concatenate([[4], rng.integers(5, 400, 300)])
    drafter = np.concatenate([[4], rng.integers(4, 300, 300)])
    passes = np.concatenate([[1], rng.integers(1, 5, 300)])
    together = model.predict_optimistic(rows, rows, drafter, passes)
    alone = np.array([model.predict_optimistic(rows[[0, i]], rows[[0, i]], drafter[[0, i]],
                                               passes[[0, i]])[1]
                      for i in range(1, len(rows))])
    return together[1:], alone


def test_a_steps_price_has_its_bits_whatever_is_priced_beside_it() -> None:
    """What the prefix search relies on when it prices every depth in one call: a
    step's optimistic price is bit for bit the one it gets priced beside the base
    alone."""
    together, alone = _prices_alone_and_together(_taught_model())
    assert np.array_equal(together, alone)


def test_the_price_check_fails_on_sums_that_depend_on_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: every row's sums in reverse order in a call of more than two
    steps (as a BLAS kernel may sum a taller call otherwise). The check must see it."""
    real = np.einsum

    def reordered(spec: str, *ops: np.ndarray) -> np.ndarray:
        if len(ops[0]) > 2:
            ops = (ops[0][:, ::-1], *(op[::-1] for op in ops[1:]))
        return real(spec, *ops)

    monkeypatch.setattr(np, "einsum", reordered)
    together, alone = _prices_alone_and_together(_taught_model())
    assert not np.array_equal(together, alone)


# ---- the price of a chain's next draft, told to the runner ---------------------------


def test_a_drafts_price_is_what_its_rows_and_a_pass_cost_at_the_steps_rate() -> None:
    """`StepTimeModel.draft_price`: the seconds one more draft's rows add, and one
    more drafter pass, at the step's forecast tokens per second (the fit
    `predict_one` prices with); twice the tokens, twice the price."""
    model = _taught_model()
    model.theta  # noqa: B018 (refit: `draft_price` reads the fit as last made)
    rows = (40, 8, 12, 2)
    seconds = model.predict_one(*rows)
    price = model.draft_price(*rows, tokens=6.0)
    row = model.predict_one(41, 9, 13, 2) - seconds
    extra_pass = model.predict_one(40, 8, 12, 3) - seconds
    assert price.per_row == pytest.approx(6.0 / seconds * row)
    assert price.per_pass == pytest.approx(6.0 / seconds * extra_pass)
    assert price.per_row > 0 and price.per_pass > 0
    doubled = model.draft_price(*rows, tokens=12.0)
    assert doubled.per_row == pytest.approx(2 * price.per_row)


def _eagle_prices(drafter_pass: float, draft_policy: str = "goodput") -> list:
    """Each step's `draft_price` of one eagle request on a simulated clock whose
    drafter pass costs `drafter_pass` seconds (the target's 20 ms, 0.1 ms a row)."""
    sched = make_scheduler("eagle", k=K, budget=256, draft_policy=draft_policy,
                           max_model_len=512)
    runner = SimulatedRunner(sched, acceptance=0.8, seed=2,
                             step_time=synthetic_step_time(0.02, 0.0001, drafter_pass))
    sched.add_request(make_request("r", 6, max_tokens=120, ignore_eos=True))
    prices = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched, runner)
        prices.append((out.draft_price, bool(out.num_draft_tokens)))
    return prices


def test_the_runner_is_told_a_drafts_price_where_the_policy_forecast_one() -> None:
    """Under the goodput policy every step that drafts a chain tells the runner what
    its next draft must gain, dearer where a drafter pass costs more; the fixed policy
    forecasts nothing and tells it nothing."""
    cheap, dear = _eagle_prices(0.0005), _eagle_prices(0.008)
    for prices in (cheap, dear):
        assert all((price is not None) == drafts for price, drafts in prices[1:])
        assert sum(drafts for _, drafts in prices) > len(prices) // 2
    per_pass = [np.median([p.per_pass for p, d in prices if d]) for prices in (cheap, dear)]
    assert per_pass[1] > 2 * per_pass[0]
    assert all(price is None for price, _ in _eagle_prices(0.008, "fixed"))
