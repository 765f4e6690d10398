"""Scheduler: requests stop on eos, stop tokens, max_tokens and max_model_len, and say
so once."""

from __future__ import annotations

import pytest

from runner.simulated import SimulatedRunner
from scheduler import Request, RequestStatus, SamplingParams
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    EOS,
    assert_idle_and_clean,
)


def test_stops_on_eos() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=50)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=EOS, eos_prob=1.0))
    assert request.output_token_ids == [EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.stop_token_id is None
    assert_idle_and_clean(scheduler)


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=7, ignore_eos=True)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=EOS, eos_prob=1.0))
    assert request.output_token_ids == [EOS] * 7
    assert request.finish_reason == "length"
    assert_idle_and_clean(scheduler)


def test_no_eos_id_never_stops_on_token_2() -> None:
    scheduler = make_scheduler()
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=None)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=EOS, eos_prob=1.0))
    assert len(request.output_token_ids) == 4
    assert request.finish_reason == "length"


def test_stops_on_stop_token_id() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=50, stop_token_ids=(77,))
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=77, eos_prob=1.0))
    assert request.output_token_ids == [77]
    assert request.stop_token_id == 77
    assert request.finish_reason == "stop"
    assert_idle_and_clean(scheduler)


def test_stop_token_ignored_before_min_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=50, stop_token_ids=(77,), min_tokens=3)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=77, eos_prob=1.0))
    assert request.output_token_ids == [77, 77, 77]
    assert request.finish_reason == "stop"


def test_eos_inside_accepted_drafts_drops_the_rest() -> None:
    scheduler = make_scheduler("ngram", k=4)
    request = make_request("a", 8, max_tokens=50)
    scheduler.add_request(request)
    runner = SimulatedRunner(scheduler, acceptance=1.0, vocab_size=1000,
                             propose=lambda rid, k: [EOS] * k)
    drain(scheduler, runner)
    # Step 1 samples one token and proposes EOS drafts; step 2 accepts the first one.
    assert len(request.output_token_ids) == 2
    assert request.output_token_ids[-1] == EOS
    assert request.finish_reason == "stop"
    assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "ngram", "eagle", "pard", "dflash", "draft_model"])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9, 17])
def test_stops_at_exactly_max_tokens_with_all_drafts_accepted(method: str | None,
                                                              max_tokens: int) -> None:
    scheduler = make_scheduler(method, k=4)
    request = make_request("a", 6, max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(request)
    runner = SimulatedRunner(scheduler, acceptance=1.0, seed=max_tokens)
    steps = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        steps += 1
        assert len(request.output_token_ids) <= max_tokens
        assert steps < 100
    assert len(request.output_token_ids) == max_tokens
    assert request.finish_reason == "length"
    if method is not None and max_tokens >= 9:
        assert scheduler.stats.num_accepted_drafts > 0
        assert steps < max_tokens  # drafts really sped it up
    assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "ngram", "pard", "dflash", "parallel", "eagle"])
def test_never_exceeds_max_model_len(method: str | None) -> None:
    max_len = 40
    scheduler = make_scheduler(method, k=4, max_model_len=max_len)
    request = make_request("a", 25, max_tokens=100, ignore_eos=True)
    scheduler.add_request(request)
    runner = SimulatedRunner(scheduler, acceptance=1.0)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        assert request.num_tokens <= max_len
        # No row of any pass (target, drafter, mask/query rows) sits at or past the limit.
        assert runner.last_step is not None
        assert runner.last_step.max_position() < max_len
    assert request.num_tokens == max_len
    assert request.finish_reason == "length"
    assert_idle_and_clean(scheduler)


def test_prompt_one_short_of_max_model_len_gets_one_token() -> None:
    scheduler = make_scheduler("pard", k=4, max_model_len=32)
    request = make_request("a", 31, max_tokens=10, ignore_eos=True)
    scheduler.add_request(request)
    out, _ = run_step(scheduler, SimulatedRunner(scheduler, acceptance=1.0))
    assert out.num_draft_tokens.get("a", 0) == 0  # no room for any draft
    assert len(request.output_token_ids) == 1
    assert request.finish_reason == "length"


def test_finished_ids_reported_once_in_next_output() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("short", 4, max_tokens=1, ignore_eos=True))
    scheduler.add_request(make_request("long", 4, max_tokens=5, ignore_eos=True))
    first, _ = run_step(scheduler, runner)
    assert first.finished_req_ids == set()
    second, _ = run_step(scheduler, runner)
    assert second.finished_req_ids == {"short"}
    third, _ = run_step(scheduler, runner)
    assert "short" not in third.finished_req_ids
