"""Shadow drafts: where a method's drafts cost no rows (ngram), a request the goodput
policy parks still has its draft proposed, never verified, and checked against the
token it samples next, so its record and state stay current and it drafts again as
soon as its drafts would pay (scheduler/update.py `check_shadow`)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.simulate import synthetic_step_time
from runner.simulated import SimulatedRunner
from scheduler.config import GoodputSettings
from scheduler.outputs import check_runner_output
from scheduler.request import ALL_ACCEPTED
from scheduler.scheduler import Scheduler
from tests.helpers import drain, make_request, make_scheduler, run_step

K = 4


def parked_workload(shadow: bool, acceptance: float = 0.0, method: str = "ngram",
                    draft_policy: str = "goodput") -> tuple[Scheduler, SimulatedRunner]:
    """8 requests on a clock where a row costs a tenth of a step's constant: drafts
    pay only where most are accepted."""
    sched = make_scheduler(method, k=K, budget=256, max_num_seqs=8, max_model_len=512,
                           draft_policy=draft_policy,
                           goodput=GoodputSettings(max_shadows=64 if shadow else 0))
    runner = SimulatedRunner(sched, acceptance=acceptance, seed=5,
                             step_time=synthetic_step_time(0.02, 0.002, 0.001))
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 6 + i, max_tokens=200, ignore_eos=True))
    return sched, runner


def steps_to_draft_again(shadow: bool) -> int:
    """Steps after acceptance jumps from 0 to 0.95 until half the batch drafts."""
    sched, runner = parked_workload(shadow)
    for _ in range(40):  # every draft rejected: the batch parks
        out, _ = run_step(sched, runner)
    assert not out.num_draft_tokens
    runner.acceptance = 0.95
    for step in range(1, 120):
        out, _ = run_step(sched, runner)
        if len(out.num_draft_tokens) >= 4:
            return step
    return 120


def test_a_parked_batch_drafts_again_as_soon_as_its_drafts_would_pay() -> None:
    """Shadowed, the parked requests' own records see their drafts accepted, and they
    draft again; unshadowed (the check that this is real), nothing they do is ever
    verified and the method's rates stay at the rejections: they do not draft again
    in the 120 steps. (The method's per-state rates learn from verified drafts only,
    so it takes the own records some steps to outweigh them.)"""
    shadowed, blind = steps_to_draft_again(True), steps_to_draft_again(False)
    assert shadowed < 60
    assert blind > 2 * shadowed


def test_shadows_are_asked_of_parked_sampling_requests_and_never_served() -> None:
    """Each step asks a shadow only of requests that sample with k = 0; every shadow
    checked counts in the request's record and state, but not in the policy's
    per-state rates, nor in the served acceptance, which count the drafts the target
    verified."""
    sched, runner = parked_workload(True, acceptance=0.3)
    assert sched.policy is not None
    learnt: list[int] = []  # verifications the per-state rates were given
    real_record = sched.policy.acceptance.record

    def record(verified, *args, **kwargs):  # type: ignore[no-untyped-def]
        learnt.extend(verified)
        return real_record(verified, *args, **kwargs)

    sched.policy.acceptance.record = record  # type: ignore[method-assign]
    verified, verifications = 0, 0
    while sched.has_unfinished_requests():
        out, result = run_step(sched, runner)
        sampling = {rid for rid, sampled in zip(result.req_ids, result.sampled_token_ids)
                    if sampled}
        assert set(out.shadow_req_ids) <= sampling - set(out.num_draft_tokens)
        assert set(result.shadow_token_ids) == set(out.shadow_req_ids)
        verified += sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
        verifications += sum(1 for d in out.scheduled_spec_decode_tokens.values() if d)
        for rid in out.shadow_req_ids:
            request = sched.requests.get(rid)
            if request is not None:
                assert request.shadow_token_id == result.shadow_token_ids[rid]
    stats = sched.stats
    assert len(learnt) == verifications and sum(learnt) == verified
    assert stats.goodput.shadow_checks > 50
    assert 0.2 < stats.goodput.shadow_hits / stats.goodput.shadow_checks < 0.4
    assert stats.spec.num_draft_tokens == verified
    assert stats.goodput.as_dict()["shadow_checks"] == stats.goodput.shadow_checks


@pytest.mark.parametrize("method, draft_policy", [("ngram", "fixed"), ("eagle", "goodput"),
                                                  ("suffix", "goodput")])
def test_no_shadow_where_it_costs_or_nobody_learns(method: str, draft_policy: str) -> None:
    """Only the goodput policy learns from shadows, and only a drafter that proposes
    without rows is asked (a head's draft is a pass; suffix builds a tree)."""
    sched, runner = parked_workload(True, method=method, draft_policy=draft_policy)
    while sched.has_unfinished_requests():
        out, result = run_step(sched, runner)
        assert not out.shadow_req_ids and not result.shadow_token_ids
    assert sched.stats.goodput.shadow_checks == 0


def test_a_shadow_check_leaves_the_state_it_found() -> None:
    """A parked request that samples its shadow draft leaves the all-accepted state,
    so the kept choice caps it as a request in a run of accepted drafts."""
    sched, runner = parked_workload(True, acceptance=0.0)
    for _ in range(30):
        run_step(sched, runner)
    runner.acceptance = 1.0
    out, _ = run_step(sched, runner)
    assert out.shadow_req_ids
    run_step(sched, runner)
    assert all(sched.requests[rid].last_outcome == ALL_ACCEPTED for rid in out.shadow_req_ids
               if rid in sched.requests)


def test_a_shadow_the_step_did_not_ask_for_is_refused() -> None:
    sched, runner = parked_workload(True)
    out = sched.schedule()
    result = runner.execute(out)
    forged = dataclasses.replace(result, shadow_token_ids={"r0": 7, "nobody": 3})
    with pytest.raises(ValueError, match=r"shadow drafts for \[.*'nobody'.*\].*shadow_req_ids"):
        check_runner_output(dataclasses.replace(out, shadow_req_ids=["r0"]), forged)
    sched.update_from_output(out, result)
    drain(sched, runner)


def test_at_most_max_shadows_a_step_in_turn() -> None:
    """Eight parked requests, two shadows a step: each step asks two, and every four
    steps each request has been asked once (in turn, not the same two each time)."""
    sched = make_scheduler("ngram", k=K, budget=256, max_num_seqs=8, max_model_len=512,
                           draft_policy="goodput",
                           goodput=GoodputSettings(max_shadows=2, prior_acceptance=0.001,
                                                   explore=0.0))
    runner = SimulatedRunner(sched, acceptance=0.0, seed=5,
                             step_time=synthetic_step_time(0.02, 0.002, 0.001))
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 6, max_tokens=60, ignore_eos=True))
    run_step(sched, runner)  # the prompts
    asked: list[list[str]] = []
    for _ in range(8):
        out, _ = run_step(sched, runner)
        assert not out.num_draft_tokens
        asked.append(out.shadow_req_ids)
    assert all(len(ids) == 2 for ids in asked)
    for start in (0, 4):
        assert sorted(r for ids in asked[start:start + 4] for r in ids) == \
            sorted(f"r{i}" for i in range(8))
    with pytest.raises(ValueError, match="max_shadows must be >= 0"):
        GoodputSettings(max_shadows=-1)
