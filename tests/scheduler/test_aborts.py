"""Scheduler: aborts (waiting, running, between schedule and update, preempted) free everything."""

from __future__ import annotations

import pytest

from runner.simulated import SimulatedRunner
from scheduler import RequestStatus
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    assert_idle_and_clean,
)


def test_abort_waiting_request() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = SimulatedRunner(scheduler)
    running = make_request("run", 8, max_tokens=4, ignore_eos=True)
    waiting = make_request("wait", 8, max_tokens=4, ignore_eos=True)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler, runner)
    assert waiting.status == RequestStatus.WAITING
    scheduler.abort_request("wait")
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    assert waiting.finish_reason == "abort"
    assert "wait" not in scheduler.requests
    out, _ = run_step(scheduler, runner)
    assert "wait" in out.finished_req_ids
    assert "wait" not in out.num_scheduled_tokens
    drain(scheduler, runner)
    assert len(running.output_token_ids) == 4
    assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "pard", "dflash"])
def test_abort_running_request_mid_decode(method: str | None) -> None:
    scheduler = make_scheduler(method, k=3)
    runner = SimulatedRunner(scheduler, acceptance=0.5)
    victim = make_request("victim", 30, max_tokens=40, ignore_eos=True)
    other = make_request("other", 30, max_tokens=10, ignore_eos=True, first_token=300)
    scheduler.add_request(victim)
    scheduler.add_request(other)
    for _ in range(3):
        run_step(scheduler, runner)
    assert victim.status == RequestStatus.RUNNING
    assert scheduler.kv_cache_usage() > 0
    scheduler.abort_request("victim")
    assert victim.spec_token_ids == []
    assert "victim" not in scheduler.kv.req_blocks
    scheduler.kv.pool.check_integrity()
    out, _ = run_step(scheduler, runner)
    assert "victim" in out.finished_req_ids
    assert "victim" not in out.num_scheduled_tokens
    drain(scheduler, runner)
    assert len(other.output_token_ids) == 10
    assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "eagle", "pard"])
def test_abort_between_schedule_and_update(method: str | None) -> None:
    scheduler = make_scheduler(method, k=2)
    runner = SimulatedRunner(scheduler, acceptance=0.5)
    victim = make_request("victim", 10, max_tokens=30, ignore_eos=True)
    other = make_request("other", 10, max_tokens=6, ignore_eos=True, first_token=200)
    scheduler.add_request(victim)
    scheduler.add_request(other)
    run_step(scheduler, runner)
    out = scheduler.schedule()
    assert "victim" in out.num_scheduled_tokens
    scheduler.abort_request("victim")
    result = runner.execute(out)
    scheduler.update_from_output(out, result)  # must skip the aborted request
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert "victim" not in scheduler.requests
    scheduler.kv.pool.check_integrity()
    nxt, _ = run_step(scheduler, runner)
    assert "victim" in nxt.finished_req_ids
    drain(scheduler, runner)
    assert len(other.output_token_ids) == 6
    assert_idle_and_clean(scheduler)


def test_abort_every_request_right_after_admission() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 20, first_token=10 + 40 * i))
    out = scheduler.schedule()
    assert scheduler.kv_cache_usage() > 0
    for i in range(5):
        scheduler.abort_request(f"r{i}")
    scheduler.update_from_output(out, runner.execute(out))
    nxt = scheduler.schedule()
    assert nxt.finished_req_ids == {f"r{i}" for i in range(5)}
    assert nxt.num_scheduled_tokens == {}
    assert_idle_and_clean(scheduler)


def test_abort_preempted_request_frees_everything() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8)
    runner = SimulatedRunner(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=12, ignore_eos=True,
                                           first_token=10 + 50 * i))
    preempted = None
    for _ in range(50):
        out, _ = run_step(scheduler, runner)
        if out.preempted_req_ids:
            preempted = next(iter(out.preempted_req_ids))
            break
    assert preempted is not None
    assert scheduler.requests[preempted].status == RequestStatus.PREEMPTED
    scheduler.abort_request(preempted)
    nxt, _ = run_step(scheduler, runner)
    assert preempted in nxt.finished_req_ids
    drain(scheduler, runner)
    assert_idle_and_clean(scheduler)


def test_abort_unknown_or_finished_id_is_a_no_op() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    request = make_request("a", 4, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    scheduler.abort_request("nope")
    assert scheduler.requests == {"a": request}
    drain(scheduler, runner)
    assert scheduler.schedule().finished_req_ids == {"a"}
    scheduler.abort_request("a")  # already finished
    assert request.finish_reason == "length"
    out = scheduler.schedule()
    assert out.finished_req_ids == set()  # reported once, never again as an abort
    assert_idle_and_clean(scheduler)


def test_request_id_reusable_after_abort() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 8))
    run_step(scheduler, runner)
    scheduler.abort_request("a")
    again = make_request("a", 8, max_tokens=3, ignore_eos=True)
    scheduler.add_request(again)
    drain(scheduler, runner)
    assert len(again.output_token_ids) == 3
    assert_idle_and_clean(scheduler)
