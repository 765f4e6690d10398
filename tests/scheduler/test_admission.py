"""Scheduler: admission order (FCFS, priority), no skipping ahead, max_num_seqs, and
the KV a request may hold."""

from __future__ import annotations

import pytest

from runner.simulated import SimulatedRunner
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    assert_idle_and_clean,
    drain_recording,
    ignore_eos_request,
)


def test_max_num_seqs_caps_running() -> None:
    scheduler = make_scheduler(max_num_seqs=3)
    runner = SimulatedRunner(scheduler)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=3, ignore_eos=True,
                                           first_token=10 + 20 * i))
    outputs = drain_recording(scheduler, runner)
    assert len(outputs[0].num_scheduled_tokens) == 3
    assert all(out.num_reqs <= 3 for out in outputs)
    assert_idle_and_clean(scheduler)


def test_fcfs_admits_in_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = SimulatedRunner(scheduler)
    names = ["d", "a", "c", "b", "e"]
    for name in names:
        scheduler.add_request(make_request(name, 4, max_tokens=2, ignore_eos=True))
    admitted = []
    for out in drain_recording(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == names


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = SimulatedRunner(scheduler)
    for i, prio in enumerate([5, 0, 3]):
        scheduler.add_request(ignore_eos_request(f"p{prio}", 4, max_tokens=1, priority=prio,
                                   arrival=float(i)))
    admitted = []
    for out in drain_recording(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == ["p5", "p0", "p3"]


def test_fcfs_no_skipping_ahead_of_a_blocked_head() -> None:
    # The head needs more KV than is free; a small request behind it must wait too.
    scheduler = make_scheduler(block_size=4, num_blocks=10, max_num_seqs=8)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("big0", 20, max_tokens=15, ignore_eos=True))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("big1", 20, max_tokens=15, ignore_eos=True,
                                       first_token=300))
    scheduler.add_request(make_request("small", 2, max_tokens=2, ignore_eos=True,
                                       first_token=700))
    out, _ = run_step(scheduler, runner)
    assert "big1" not in out.num_scheduled_tokens
    assert "small" not in out.num_scheduled_tokens


def test_priority_admits_lower_value_first_ties_by_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    runner = SimulatedRunner(scheduler)
    spec = [("late-1", 1, 3.0), ("p9", 9, 0.0), ("early-1", 1, 1.0), ("p0", 0, 2.0),
            ("p5", 5, 4.0)]
    for rid, prio, arrival in spec:
        scheduler.add_request(ignore_eos_request(rid, 4, max_tokens=1, priority=prio,
                                                 arrival=arrival))
    admitted = []
    for out in drain_recording(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == ["p0", "early-1", "late-1", "p5", "p9"]


@pytest.mark.parametrize("method", [None, "ngram", "suffix", "eagle", "dflash"])
def test_admission_charges_no_more_kv_than_the_request_can_hold(method: str | None) -> None:
    """B=32, 2 blocks of 4: a 4-token prompt with max_tokens 3 holds at most 6 slots
    (its 7th token is sampled, never computed), under any method: drafts and the
    drafter's lookahead stay inside that by the k rule. It used to be refused as
    needing 3 blocks under ngram K=4."""
    sched = make_scheduler(method, k=4, budget=32, max_num_seqs=4, max_model_len=64,
                           block_size=4, num_blocks=2, enable_prefix_caching=False)
    runner = SimulatedRunner(sched, acceptance=1.0, seed=0)
    sched.add_request(make_request("r", 4, max_tokens=3, ignore_eos=True))
    drain(sched, runner)
    with pytest.raises(ValueError, match="may need 3 KV blocks"):
        sched.add_request(make_request("s", 4, max_tokens=6))
