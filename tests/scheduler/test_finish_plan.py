"""The goodput policy's plan for a closed batch (nothing waits, nobody joins): k chosen
to finish every running request soonest. Seeded clocks and estimates, as in
test_goodput.py; the reference timings below are computed independently of
scheduler/finish_plan.py."""

from __future__ import annotations

import copy
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.simulate import synthetic_step_time
from runner.simulated import SimulatedRunner
from scheduler.acceptance import ProposalRates
from scheduler.config import GoodputSettings
from scheduler.finish_plan import finish_caps
from scheduler.goodput import GoodputPolicy
from scheduler.request import ALL_ACCEPTED, FRESH, NONE_ACCEPTED, NUM_OUTCOMES, SOME_ACCEPTED
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.test_goodput import K, history
from tests.scheduler.test_goodput import policy as step_policy


def policy(method: str, seconds_per_pass: float, seconds_per_row: float,
           acceptance: float, **knobs: float) -> GoodputPolicy:
    """test_goodput.py's policy, planning a closed batch of any size (the default plans
    only from `finish_min_running` running: these batches are smaller)."""
    return step_policy(method, seconds_per_pass, seconds_per_row, acceptance,
                       finish_min_running=1, **knobs)


def closed_caps(gp: GoodputPolicy, remaining: list[int], reached: int = 40,
                accepted: int = 24) -> np.ndarray:
    num = len(remaining)
    return gp.caps(history([reached] * num), np.full(num, accepted), np.zeros(num, dtype=int),
                   np.full(num, K), remaining=np.array(remaining))


def test_a_closed_batch_drafts_only_for_the_request_it_waits_for() -> None:
    """Rows cheap, drafts accepted: per step every request drafts. A closed batch waits
    for its one long request; the seven short ones finish first whatever they draft, so
    only the long one drafts."""
    gp = policy("ngram", 0.02, 0.0005, acceptance=0.6)
    num = 8
    open_caps = gp.caps(history([40] * num), np.full(num, 24), np.zeros(num, dtype=int),
                        np.full(num, K))
    assert (open_caps > 0).all()
    got = closed_caps(gp, [64] + [8] * (num - 1))
    assert got[0] > 0 and got[1:].tolist() == [0] * (num - 1)


def test_a_closed_batch_in_lockstep_drafts_where_it_pays_and_nowhere_else() -> None:
    """Every request as long as the others: all draft where rows are cheap and drafts
    accepted; none where a row costs half a pass and drafts are mostly rejected."""
    cheap = closed_caps(policy("ngram", 0.02, 0.0005, acceptance=0.7), [48] * 6)
    assert (cheap > 0).all()
    dear = closed_caps(policy("ngram", 0.002, 0.001, acceptance=0.2), [48] * 6,
                       accepted=4)
    assert dear.tolist() == [0] * 6


def test_the_rule_and_the_budget_still_cut() -> None:
    """A request the rule allows no draft gets none; a plan whose verification rows
    exceed the budget is never chosen."""
    gp = policy("ngram", 0.02, 0.0005, acceptance=0.7)
    got = gp.caps(history([40] * 3), np.full(3, 28), np.zeros(3, dtype=int),
                  np.array([K, 1, 0]), remaining=np.array([48, 48, 48]))
    assert got[2] == 0 and got[1] <= 1 and got[0] > 0
    gains = np.full((4, K), 0.9)
    caps, _ = finish_caps(gains, np.full(4, K), np.full(4, 60), np.zeros(4, dtype=int),
                          gp.costs, gp.time_model, budget=4 + 4 * 2)
    assert 4 + int(caps.sum()) <= 4 + 4 * 2


def reference_seconds(gp: GoodputPolicy, gains: np.ndarray, remaining: np.ndarray,
                      ks: np.ndarray) -> float:
    """The predicted seconds to finish with each request drafting ks every step, by a
    walk over the moments a request finishes (a Python loop over the active set)."""
    finish = []
    for i, k in enumerate(ks.tolist()):
        cum = np.concatenate([[0.0], np.cumsum(gains[i])])
        finish.append(max(int(remaining[i]), 1) / (1.0 + cum[k]))
    moments = sorted(set(finish) | {0.0})
    total = 0.0
    target_of = np.concatenate([[0], np.cumsum(gp.costs.target)])
    drafter_of = gp.costs.drafter_base + np.concatenate([[0], np.cumsum(gp.costs.drafter)])
    for start, end in pairwise(moments):
        active = [i for i, f in enumerate(finish) if f > start]
        rows = sum(1 + int(target_of[ks[i]]) for i in active)
        drafter = sum(int(drafter_of[ks[i]]) for i in active)
        deepest = max(int(ks[i]) for i in active)
        passes = (gp.costs.passes_base + gp.costs.passes_drafting * (deepest > 0)
                  + (max(deepest - 1, 0) if gp.costs.sequential else 0))
        total += (end - start) * gp.time_model.predict_one(rows, rows, drafter, passes)
    return total


@settings(max_examples=60, deadline=None)
@given(method=st.sampled_from(["ngram", "eagle", "dflash"]),
       per_row=st.sampled_from([0.0001, 0.0009, 0.004]),
       rates=st.lists(st.floats(0.0, 0.95), min_size=1, max_size=6),
       remaining=st.lists(st.integers(1, 200), min_size=6, max_size=6),
       limits=st.lists(st.integers(0, K), min_size=6, max_size=6))
def test_the_plan_is_never_slower_than_one_k_for_all(method: str, per_row: float,
                                                      rates: list[float],
                                                      remaining: list[int],
                                                      limits: list[int]) -> None:
    """Under the model, the plan finishes no later than every request drafting the same
    k (each cut to its rule), no drafts included, timed by the reference walk."""
    gp = policy(method, 0.02, per_row, acceptance=0.6)
    num = len(rates)
    limit = np.array(limits[:num])
    gains = np.cumprod(np.repeat(np.array(rates)[:, None], K, axis=1), axis=1)
    gains[np.arange(K)[None, :] >= limit[:, None]] = 0.0
    left = np.array(remaining[:num])
    got, margin = finish_caps(gains, limit, left, np.zeros(num, dtype=int), gp.costs,
                              gp.time_model, budget=4096)
    assert (got <= limit).all()
    mine = reference_seconds(gp, gains, left, got)
    for k in range(K + 1):
        uniform = reference_seconds(gp, gains, left, np.minimum(k, limit))
        assert mine <= uniform * (1 + 1e-9) + 1e-12
        if not got.any() and np.minimum(k, limit).any():  # the margin it reports holds
            assert uniform >= mine * (1 + margin) * (1 - 1e-9) - 1e-12


def run_closed(arrivals_closed: bool) -> dict[str, int]:
    """A batch of one long and seven short requests, drafts mostly accepted; returns
    the drafts each request proposed over the run."""
    sched = make_scheduler("ngram", k=K, budget=256, max_num_seqs=8,
                           draft_policy="goodput", max_model_len=512,
                           goodput=GoodputSettings(finish_min_running=1))
    sched.arrivals_closed = arrivals_closed
    runner = SimulatedRunner(sched, acceptance=0.8, seed=3,
                             step_time=synthetic_step_time(0.02, 0.0002))
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 6 + i, max_tokens=80 if i == 0 else 12,
                                       ignore_eos=True))
    drafts = {f"r{i}": 0 for i in range(8)}
    while sched.has_unfinished_requests():
        out, _ = run_step(sched, runner)
        for rid, k in out.num_draft_tokens.items():
            drafts[rid] += k
    return drafts


def test_the_scheduler_plans_to_finish_only_when_told_nobody_joins() -> None:
    """Open (a server: someone may join any time): every request drafts. Closed (an
    offline batch): the short requests finish long before the long one, so they draft
    nothing and the long one drafts."""
    open_run = run_closed(False)
    assert all(open_run[f"r{i}"] > 0 for i in range(8))
    closed = run_closed(True)
    assert closed["r0"] > 0
    assert sum(closed[f"r{i}"] for i in range(1, 8)) < sum(open_run[f"r{i}"]
                                                           for i in range(1, 8)) / 4


def test_a_closed_batch_plans_on_the_drafts_its_drafter_proposes() -> None:
    """A lookup drafter that proposes a draft on a fifth of the steps that allow one
    (held-out chat: suffix proposed none on half, ngram on 63 %) speeds its requests
    up a fifth as much: the lockstep batch that drafts when every allowed draft is
    proposed drafts nothing. A drafter that proposes all it is allowed plans as if
    none were counted."""
    num = 6
    full = policy("ngram", 0.02, 0.0005, acceptance=0.7)
    full.observe_proposals([K] * 400, [K] * 400)
    assert full.proposals.rates.tolist() == [1.0] * K
    assert (closed_caps(full, [48] * num) > 0).all()
    rare = policy("ngram", 0.02, 0.0005, acceptance=0.7)
    rare.observe_proposals([K] * 400, [K if i % 5 == 0 else 0 for i in range(400)])
    assert rare.proposals.rates == pytest.approx([0.2] * K, abs=0.01)
    assert closed_caps(rare, [48] * num).tolist() == [0] * num
    # Per step the request still drafts: only the plan's horizon reads proposals.
    assert (rare.caps(history([40] * num), np.full(num, 24), np.zeros(num, dtype=int),
                      np.full(num, K)) > 0).all()


def test_the_scheduler_counts_what_the_drafter_proposed_against_what_it_allowed() -> None:
    """Through a scheduler: a drafter that proposes one draft of the K allowed on every
    other step and none on the rest is counted so (first position ~0.5, later ones
    ~0); one that proposes all it is allowed leaves every rate exactly 1."""
    def rates(propose: object) -> np.ndarray:
        sched = make_scheduler("ngram", k=K, budget=256, max_num_seqs=4,
                               draft_policy="goodput", max_model_len=512)
        runner = SimulatedRunner(sched, acceptance=0.8, seed=3, propose=propose,  # type: ignore[arg-type]
                                 step_time=synthetic_step_time(0.02, 0.0002))
        for i in range(4):
            sched.add_request(make_request(f"r{i}", 8, max_tokens=60, ignore_eos=True))
        drain(sched, runner)
        assert sched.policy is not None
        return sched.policy.proposals.rates

    turn = iter(range(10_000))
    sparse = rates(lambda rid, k: [7] if next(turn) % 2 else [])
    assert 0.3 < sparse[0] < 0.7 and (sparse[1:] < 0.2).all()
    assert rates(lambda rid, k: [7] * k).tolist() == [1.0] * K


def test_proposal_rates_count_each_position_allowed_and_proposed() -> None:
    """Per position: of the requests allowed at least j + 1 drafts, the share that
    proposed at least j + 1 (a proposal past what was allowed counts only up to it),
    behind one allowed draft proposed; older steps fade by the estimates' decay."""
    rates = ProposalRates(3, decay=1.0)
    rates.record([3, 3, 2, 1], [3, 1, 0, 5])
    # allowed: 4, 3, 2 (+1 each); proposed: 3, 1, 1 (+1 each)
    assert rates.rates.tolist() == [4 / 5, 2 / 4, 2 / 3]
    faded = ProposalRates(1, decay=0.5)
    faded.record([1], [0])
    faded.record([1], [1])
    assert faded.rates.tolist() == [(0.25 + 1) / (0.25 + 0.5 + 1)]


def runs_policy() -> GoodputPolicy:
    """Drafts come in runs: after all were accepted the next first draft is accepted
    0.8 of the time, after some 0.4, after none 0.05; rows cheap."""
    gp = policy("ngram", 0.02, 0.0005, acceptance=0.4)
    rng = np.random.default_rng(1)
    for state, rate in ((ALL_ACCEPTED, 0.8), (SOME_ACCEPTED, 0.4), (NONE_ACCEPTED, 0.05)):
        accepted = np.minimum(rng.geometric(1 - rate, 400) - 1, K)
        gp.acceptance.record([K] * 400, accepted.tolist(), [state] * 400)
    return gp


def test_a_closed_batch_plans_on_each_requests_run_of_states_not_its_last_one() -> None:
    """A plan spans the rest of each answer, over which a request's state moves with
    every verification. Four requests with the same record, one of which has just
    rejected its drafts: it is no slower over the rest of its answer than the others,
    so the plan is the one it makes when all four have just accepted theirs."""
    def plan(last: list[int]) -> list[int]:
        num = len(last)
        record = np.tile(np.array([0, 10, 10, 10]), (num, 1))  # FRESH, all, some, none
        return runs_policy().caps(record, np.full(num, 12), np.array(last), np.full(num, K),
                                  remaining=np.full(num, 48),
                                  produced=np.full(num, 20)).tolist()

    alike = plan([ALL_ACCEPTED] * 4)
    assert all(k > 0 for k in alike)
    assert plan([ALL_ACCEPTED] * 3 + [NONE_ACCEPTED]) == alike
    assert plan([NONE_ACCEPTED] * 4) == alike


def test_a_closed_batch_plans_only_from_finish_min_running_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Below `finish_min_running` a closed batch chooses per step, as an open one does
    (measured: at 4 running the plan drafted less than a step's choice and lost to it,
    README); from it on, it plans."""
    import scheduler.goodput as goodput

    calls: list[int] = []
    plan = goodput.finish_caps
    monkeypatch.setattr(goodput, "finish_caps",
                        lambda *a, **k: calls.append(1) or plan(*a, **k))
    for num, planned in ((3, False), (4, True), (6, True)):
        gp = step_policy("ngram", 0.02, 0.0005, acceptance=0.7, finish_min_running=4)
        calls.clear()
        got = closed_caps(gp, [48] * num)
        assert bool(calls) == planned and got.any()
        assert gp.holding(num, closed=True) is False
    assert GoodputSettings().finish_min_running > 4  # the default: per step at 4


def test_a_requests_mix_of_states_is_its_own_record_behind_the_methods() -> None:
    """With no record a request is in each state as often as the method's drafts were;
    a long record of rejections puts it mostly in "none accepted"; FRESH comes once."""
    est = runs_policy().acceptance
    record = np.zeros((2, NUM_OUTCOMES), dtype=np.int64)
    record[1, NONE_ACCEPTED] = 100
    record[1, FRESH] = 1
    mix = est.state_mix(record)
    assert np.allclose(mix.sum(axis=1), 1.0) and (mix[:, FRESH] == 0).all()
    method = est.reached[:, :, 0].sum(axis=1)
    method[FRESH] = 0.0
    assert np.allclose(mix[0], method / method.sum())
    assert mix[1, NONE_ACCEPTED] > 0.95


def test_a_closed_batch_is_planned_without_the_optimism_of_fresh_requests() -> None:
    """Fresh requests get an exploration bonus per step, where one request's try is
    cheap; a closed plan drafts the whole batch alike, so it plans at the mean."""
    gp = policy("ngram", 0.02, 0.0005, acceptance=0.5)
    fresh = (history([0] * 4), np.zeros(4, dtype=int), np.zeros(4, dtype=int))
    hopeful = gp.acceptance.request_rates(*fresh)
    plain = gp.acceptance.request_rates(*fresh, explore=False)
    assert (hopeful > plain).all()
    est = gp.acceptance
    pooled = est.pooled_rates()
    cells = est.cell_rates(pooled, est.position_rates(pooled), est.span_rates(pooled))
    assert np.allclose(plain, cells[FRESH, 0])  # a fresh request, in an answer's first span


def test_a_plan_that_drafts_nothing_by_a_clear_margin_is_kept_a_few_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafting clearly loses: after one plan, the next steps reuse it (no re-plan)
    up to `max_idle_steps`, one step per `idle_margin_per_step` of the margin; a
    request that finishes scales the margin by the count left, one that joins plans
    again at once."""
    import scheduler.goodput as goodput

    calls = []
    plan = goodput.finish_caps
    monkeypatch.setattr(goodput, "finish_caps",
                        lambda *a, **k: calls.append(1) or plan(*a, **k))
    gp = policy("ngram", 0.002, 0.001, acceptance=0.2)
    cap = gp.settings.max_idle_steps
    for _ in range(cap + 4):
        assert closed_caps(gp, [48] * 6, accepted=4).tolist() == [0] * 6
    assert len(calls) == 2  # planned, kept `cap` steps, planned, kept 3 so far
    assert gp._idle_margin >= cap * gp.settings.idle_margin_per_step
    assert closed_caps(gp, [48] * 5, accepted=4).tolist() == [0] * 5
    assert len(calls) == 2  # one finished: a margin that wide still holds for 5
    assert closed_caps(gp, [48] * 6, accepted=4).tolist() == [0] * 6
    assert len(calls) == 3  # one joined: planned again
    gp._keep(0.05, 6, planned=True)  # 5 % short: held 2 steps at 6 ...
    assert closed_caps(gp, [48] * 3, accepted=4).tolist() == [0] * 3
    assert len(calls) == 3 and gp._idle_steps == 0  # ... 2.5 % at 3: this step only
    gp._keep(0.05, 6, planned=True)
    closed_caps(gp, [48] * 2, accepted=4)
    assert len(calls) == 4  # ... 1.7 % at 2: planned again
    cheap = policy("ngram", 0.02, 0.0005, acceptance=0.7)
    calls.clear()
    for _ in range(3):
        assert (closed_caps(cheap, [48] * 6) > 0).all()
    assert len(calls) == 3  # drafting: planned every step


def test_a_held_step_joins_the_time_models_sums_and_the_next_plan_refits() -> None:
    """A step whose caps held the last plan is observed without a refit: the metrics'
    price stays the plan's, and the next plan prices from a fit over every step,
    held ones included (the same fit as refitting at each of them)."""
    gp = policy("ngram", 0.002, 0.001, acceptance=0.2)
    eager = copy.deepcopy(gp.time_model)
    closed_caps(gp, [48] * 6, accepted=4)  # plans, and holds for the next steps
    assert gp.holding(6, closed=True)
    before = gp.time_model.predict_one(6, 6, 0, 0)
    noise = gp.time_model.noise_var
    clock = synthetic_step_time(0.01, 0.004)  # steps slower than the fit thinks
    for _ in range(3):
        assert closed_caps(gp, [48] * 6, accepted=4).tolist() == [0] * 6
        seconds = clock({"target": 6})
        gp.observe_step([], [], [], (6, 6, 0, 0), seconds)
        eager.observe(6, 6, 0, 0, seconds)
        assert gp.time_model.predict_one(6, 6, 0, 0) == before
    assert gp.time_model.noise_var == noise
    assert np.allclose(gp.time_model.theta, eager.theta)
    assert gp.time_model.predict_one(6, 6, 0, 0) > before


def test_a_scheduler_holding_a_plan_skips_the_rules_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the policy holds a closed batch's plan the scheduler asks nothing else of
    it: neither the rule's k nor a plan, and nobody drafts."""
    scheduler = make_scheduler("ngram", k=K, budget=256, draft_policy="goodput",
                               goodput=GoodputSettings(finish_min_running=1))
    gp = scheduler.policy
    assert gp is not None
    runner = SimulatedRunner(scheduler, seed=0, acceptance=0.0)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", prompt_len=8, max_tokens=40))
    scheduler.arrivals_closed = True
    run_step(scheduler, runner)
    gp._keep(0.1, len(scheduler.running), planned=True)  # 10 % short: held 5 steps
    calls = []
    rule_k = scheduler.rule.k
    monkeypatch.setattr(scheduler.rule, "k", lambda *a: calls.append(1) or rule_k(*a))
    out, _ = run_step(scheduler, runner)
    assert calls == [] and gp._idle_steps == 4
    assert not out.scheduled_spec_decode_tokens


def test_a_step_that_drafts_nothing_by_a_clear_margin_is_kept_a_few_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Per step too (requests may join): a choice that drafts nothing by a clear
    margin is kept for the next steps, one per `idle_margin_per_step` of the margin,
    while the count of running requests holds; a request in prefill (rule's k 0),
    which may draft in a step or two, is never held for; a choice that drafts is
    made again every step."""
    calls = []
    decide = GoodputPolicy._threshold
    monkeypatch.setattr(GoodputPolicy, "_threshold",
                        lambda self, *a: calls.append(1) or decide(self, *a))

    def step(gp: GoodputPolicy, rule_k: list[int], accepted: int = 4) -> list[int]:
        num = len(rule_k)
        return gp.caps(history([40] * num), np.full(num, accepted), np.zeros(num, dtype=int),
                       np.array(rule_k)).tolist()

    gp = policy("ngram", 0.002, 0.001, acceptance=0.2)
    assert step(gp, [K] * 6) == [0] * 6 and len(calls) == 1
    held = gp._idle_steps
    assert held >= 2
    for _ in range(held):
        assert step(gp, [K] * 6) == [0] * 6 and gp.new_request_cap == 0
    assert len(calls) == 1
    assert step(gp, [K] * 6) == [0] * 6 and len(calls) == 2
    gp._keep(0.02, 6, planned=False)  # 2 % short: one step at 6, none at 5
    assert step(gp, [K] * 5) == [0] * 5 and len(calls) == 3  # one finished: decided again
    gp._keep(0.2, 5, planned=False)
    assert step(gp, [K] * 4) == [0] * 4 and len(calls) == 3  # still 16 % short: held
    assert step(gp, [K] * 5) == [0] * 5 and len(calls) == 4  # one joined: decided again
    calls.clear()
    gp = policy("ngram", 0.002, 0.001, acceptance=0.2)
    for _ in range(3):
        assert step(gp, [0] + [K] * 3) == [0] * 4
    assert len(calls) == 3
    cheap = policy("ngram", 0.02, 0.0005, acceptance=0.7)
    calls.clear()
    for _ in range(3):
        assert sum(step(cheap, [K] * 6, accepted=30)) > 0
    assert len(calls) == 3
