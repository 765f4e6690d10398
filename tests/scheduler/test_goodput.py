"""The goodput draft policy: its estimates, its allocation, and the scheduler using it.

The estimates and the step-time model are injected (settings, a seeded simulated
clock), so every decision here is deterministic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.simulate import synthetic_step_time
from runner.simulated import SimulatedRunner
from scheduler.budget import ThrottleRule
from scheduler.goodput import (
    AcceptanceEstimates,
    DraftCosts,
    GoodputPolicy,
    GoodputSettings,
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
    for _ in range(300):  # rows that vary, so every slope is identifiable
        target, drafter = int(rng.integers(1, 600)), int(rng.integers(0, 600))
        model.observe(target, drafter, clock({"target": target, "draft": drafter}))
    gp = GoodputPolicy(rule, 8192, chosen, model)
    # Each reached draft accepted with probability `acceptance`: the accepted prefix of
    # K drafts is geometric.
    accepted = np.minimum(rng.geometric(1 - acceptance, 400) - 1, K)
    gp.acceptance.record([K] * 400, accepted.tolist())
    return gp


def caps(gp: GoodputPolicy, num: int, reached: int = 0, accepted: int = 0) -> np.ndarray:
    return gp.caps(np.full(num, reached), np.full(num, accepted), np.full(num, K))


def test_acceptance_counts_only_reached_positions() -> None:
    """3 verified, 1 accepted: positions 0 and 1 were reached, only 0 accepted; 2 was
    never reached (a rejection before it), so it says nothing about position 2."""
    est = AcceptanceEstimates(4, GoodputSettings(prior_weight=0.0, decay=1.0))
    est.record([3], [1])
    assert est.reached.tolist() == [1, 1, 0, 0] and est.accepted.tolist() == [1, 0, 0, 0]
    est.record([4, 2], [4, 2])
    assert est.reached.tolist() == [3, 3, 1, 1] and est.accepted.tolist() == [3, 2, 1, 1]


def test_the_time_model_learns_the_clock_it_is_fed() -> None:
    model = policy("eagle", 0.01, 0.0005, 0.5).time_model
    clock = synthetic_step_time(0.01, 0.0005)
    for target, drafter in ((1, 1), (16, 16), (300, 40), (64, 0)):
        expect = clock({"target": target, "draft": drafter})
        assert float(model.predict(target, drafter)) == pytest.approx(expect, rel=0.05)


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
    got = gp.caps(np.array([200, 200, 0]), np.array([0, 195, 0]), np.full(3, K))
    assert got[0] == 0 and got[1] == K and 0 < got[2] < K


def test_more_load_means_fewer_drafts() -> None:
    gp = policy("ngram", 0.02, 0.0003, acceptance=0.6)
    per_request = [caps(gp, n, 40, 24).mean() for n in (1, 16, 256)]
    assert per_request[0] > per_request[1] > per_request[2]


@settings(max_examples=200, deadline=None)
@given(rule_k=st.lists(st.integers(0, K), min_size=1, max_size=20),
       reached=st.integers(0, 100), share=st.floats(0, 1), per_row=st.floats(0, 0.01))
def test_caps_never_exceed_the_rule(rule_k: list[int], reached: int, share: float,
                                    per_row: float) -> None:
    gp = policy("dflash", 0.02, per_row, acceptance=0.7)
    num = len(rule_k)
    got = gp.caps(np.full(num, reached), np.full(num, int(reached * share)), np.array(rule_k))
    assert (got <= np.array(rule_k)).all() and (got >= 0).all()


def test_draft_costs_follow_the_cost_table() -> None:
    """dflash: the j-th draft adds its verification row and one query row (the first
    also the bonus row); eagle: one target row, and from the second draft on one
    one-row step."""
    dflash = DraftCosts.for_rule(ThrottleRule(get_method("dflash"), K, 4096))
    assert dflash.target.tolist() == [1] * K
    assert dflash.drafter.tolist() == [3, 2, 2, 2] and dflash.drafter_base == 1
    eagle = DraftCosts.for_rule(ThrottleRule(get_method("eagle"), K, 4096))
    assert eagle.drafter.tolist() == [1, 2, 2, 2] and eagle.drafter_base == 1


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
    sched, outputs = run_workload("goodput", 0.00001, 0.9)
    chosen = sched.stats.goodput.chosen_k
    assert chosen[K] > sum(chosen[:K])  # most sampling requests drafted K
    assert sched.stats.goodput.num_timed_steps == len(outputs)


def test_a_policy_asking_past_the_rule_is_held_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: caps far above K. The scheduler takes min(rule, cap), so the
    strict runner (which re-derives the rule) accepts every step and drains."""
    monkeypatch.setattr(GoodputPolicy, "caps",
                        lambda self, reached, accepted, rule_k: np.full(len(rule_k), 99))
    sched = make_scheduler("pard", k=K, budget=64, max_model_len=48, draft_policy="goodput")
    runner = SimulatedRunner(sched, acceptance=1.0, seed=0)
    sched.add_request(make_request("r", 10, max_tokens=60, ignore_eos=True))
    drain(sched, runner)
    assert sched.stats.goodput.chosen_k[K] > 0  # it did draft K where the rule allowed
