"""Scheduler: preemption under KV pressure: the victim, resuming, and refunds offered back."""

from __future__ import annotations

import pytest

from runner.simulated import SimulatedRunner
from scheduler import Request, SamplingParams
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    assert_idle_and_clean,
    drain_recording,
    ignore_eos_request,
)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_victim_under_kv_pressure(policy: str) -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8, policy=policy)
    runner = SimulatedRunner(scheduler)
    # Admitted in two steps so the lowest priority is not the newest running request.
    scheduler.add_request(ignore_eos_request("low", 3, max_tokens=12, priority=5, arrival=0.0))
    run_step(scheduler, runner)
    scheduler.add_request(ignore_eos_request("high", 3, max_tokens=12, priority=0, arrival=1.0,
                               first_token=100))
    scheduler.add_request(ignore_eos_request("mid", 3, max_tokens=12, priority=2, arrival=2.0,
                               first_token=200))
    first_victim = None
    for out in drain_recording(scheduler, runner):
        if out.preempted_req_ids and first_victim is None:
            assert len(out.preempted_req_ids) == 1
            first_victim = next(iter(out.preempted_req_ids))
    assert scheduler.stats.num_preemptions > 0
    # priority: the highest value goes first; fcfs: the newest running request.
    assert first_victim == ("low" if policy == "priority" else "mid")
    assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "ngram", "eagle", "pard", "dflash"])
def test_preempted_requests_resume_with_outputs_intact(method: str | None) -> None:
    scheduler = make_scheduler(method, k=2, block_size=4, num_blocks=14)
    runner = SimulatedRunner(scheduler, acceptance=0.6, seed=3)
    requests = [make_request(f"r{i}", 10, max_tokens=20, ignore_eos=True,
                             first_token=10 + 60 * i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    snapshots: dict[str, list[list[int]]] = {}
    steps = 0
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, runner)
        scheduler.kv.pool.check_integrity()
        for rid in out.preempted_req_ids:
            request = next(r for r in requests if r.request_id == rid)
            assert request.num_computed_tokens == 0
            assert rid not in scheduler.kv.req_blocks
            snapshots.setdefault(rid, []).append(list(request.output_token_ids))
        steps += 1
        assert steps < 1000
    assert scheduler.stats.num_preemptions > 0
    assert snapshots
    for request in requests:
        assert len(request.output_token_ids) == 20
        assert request.finish_reason == "length"
        assert request.all_token_ids == request.prompt_token_ids + request.output_token_ids
        for snap in snapshots.get(request.request_id, []):
            assert request.output_token_ids[:len(snap)] == snap
    assert sum(r.num_preemptions for r in requests) == scheduler.stats.num_preemptions
    assert_idle_and_clean(scheduler)


def test_resumed_request_recomputes_prompt_and_outputs() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8, enable_prefix_caching=False)
    runner = SimulatedRunner(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=12, ignore_eos=True,
                                           first_token=10 + 50 * i))
    outputs = drain_recording(scheduler, runner)
    victims = set().union(*(out.preempted_req_ids for out in outputs))
    assert victims
    resumed = [new for out in outputs for new in out.scheduled_new_reqs
               if new.req_id in victims and new.output_token_ids]
    assert resumed
    for new in resumed:
        assert new.num_computed_tokens == 0  # no prefix caching: all recomputed
        out = next(o for o in outputs if new in o.scheduled_new_reqs)
        known = len(new.prompt_token_ids) + len(new.output_token_ids)
        assert out.num_scheduled_tokens[new.req_id] == known


def test_fcfs_preempted_request_resumes_before_newer_arrivals() -> None:
    # Two requests of 15 tokens need 8 blocks of 4; the pool has 7.
    scheduler = make_scheduler(block_size=4, num_blocks=7, max_num_seqs=2)
    runner = SimulatedRunner(scheduler)
    for i, rid in enumerate(["a", "b", "c"]):
        scheduler.add_request(make_request(rid, 3, max_tokens=12, ignore_eos=True,
                                           first_token=10 + 50 * i))
    outputs = drain_recording(scheduler, runner)
    at = next(i for i, out in enumerate(outputs) if out.preempted_req_ids)
    assert outputs[at].preempted_req_ids == {"b"}  # the newest running request
    admitted_after = [new.req_id for out in outputs[at + 1:] for new in out.scheduled_new_reqs]
    assert admitted_after[0] == "b"
    assert "c" in admitted_after
    assert_idle_and_clean(scheduler)


def test_priority_preemption_offers_the_refund_to_requests_already_planned() -> None:
    """pard K=2, B=7, 7 blocks of 2: at step 3 r1 (priority 1) is planned with the rows
    r0 (priority 2) was charged first, then r0 is preempted for KV and refunded: r1
    must get the refund (n=3, both drafts verified), not keep the n=2 it was planned
    with (what the scheduler did before)."""
    sched = make_scheduler("pard", k=2, budget=7, max_num_seqs=4, max_model_len=16,
                           block_size=2, num_blocks=7, policy="priority",
                           enable_prefix_caching=False)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    sched.add_request(Request("r0", list(range(10, 16)), SamplingParams(max_tokens=4),
                              priority=2))
    run_step(sched, runner)
    sched.add_request(Request("r1", [20, 21], SamplingParams(max_tokens=8), priority=1))
    run_step(sched, runner)
    out, _ = run_step(sched, runner)
    assert out.preempted_req_ids == {"r0"}
    assert out.num_scheduled_tokens == {"r1": 3}
    assert len(out.scheduled_spec_decode_tokens["r1"]) == 2
    assert all(rows <= 7 for rows in out.pass_rows.values())
    sched.kv.pool.check_integrity()
    drain(sched, runner)
