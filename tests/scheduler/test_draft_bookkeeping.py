"""Scheduler: drafts verified, rejected and rolled back, and what each update reports."""

from __future__ import annotations

import pytest

from runner.simulated import SimulatedRunner
from scheduler import ModelRunnerOutput
from tests.helpers import make_request, make_scheduler, run_step


@pytest.mark.parametrize("method", ["ngram", "eagle", "pard", "dflash", "draft_model"])
def test_rejected_drafts_roll_back_num_computed_tokens(method: str) -> None:
    scheduler = make_scheduler(method, k=3)
    runner = SimulatedRunner(scheduler, acceptance=0.0)
    request = make_request("a", 9, max_tokens=30, ignore_eos=True)
    scheduler.add_request(request)
    run_step(scheduler, runner)  # prefill: proposes drafts
    assert len(request.spec_token_ids) == 3
    for _ in range(4):
        tokens_before = request.num_tokens
        out = scheduler.schedule()
        verified = len(out.scheduled_spec_decode_tokens["a"])
        assert verified == 3
        assert request.num_computed_tokens == tokens_before + verified
        scheduler.update_from_output(out, runner.execute(out))
        assert request.num_tokens == tokens_before + 1  # all rejected: one token
        assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.stats.num_verified_drafts == 12
    assert scheduler.stats.num_accepted_drafts == 0


def test_accepted_drafts_keep_their_kv() -> None:
    scheduler = make_scheduler("ngram", k=3)
    runner = SimulatedRunner(scheduler, acceptance=1.0)
    request = make_request("a", 9, max_tokens=30, ignore_eos=True)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    tokens_before = request.num_tokens
    run_step(scheduler, runner)
    assert request.num_tokens == tokens_before + 4
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.stats.num_accepted_drafts == 3


def test_runner_proposing_too_many_drafts_raises() -> None:
    scheduler = make_scheduler("ngram", k=2)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=30, ignore_eos=True))
    out = scheduler.schedule()
    assert out.num_draft_tokens["a"] == 2
    result = runner.execute(out)
    bad = ModelRunnerOutput(result.req_ids, result.sampled_token_ids, {"a": [5, 6, 7]})
    with pytest.raises(ValueError, match="num_draft_tokens=2"):
        scheduler.update_from_output(out, bad)


def test_runner_proposing_drafts_when_none_charged_raises() -> None:
    scheduler = make_scheduler(None)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=30, ignore_eos=True))
    out = scheduler.schedule()
    result = runner.execute(out)
    bad = ModelRunnerOutput(result.req_ids, result.sampled_token_ids, {"a": [5]})
    with pytest.raises(ValueError, match="num_draft_tokens=0"):
        scheduler.update_from_output(out, bad)


def test_runner_sampling_more_than_verified_plus_one_raises() -> None:
    scheduler = make_scheduler(None)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=30, ignore_eos=True))
    out = scheduler.schedule()
    result = runner.execute(out)
    bad = ModelRunnerOutput(result.req_ids, [[1, 2]])
    with pytest.raises(ValueError, match="at most 1"):
        scheduler.update_from_output(out, bad)


def test_update_from_output_reports_what_each_request_gained() -> None:
    """The engine learns new tokens only from these outputs: tokens up to the first
    stop condition, with their logprobs trimmed alongside, and the finish."""
    from scheduler import ModelRunnerOutput

    scheduler = make_scheduler("ngram", k=2)
    scheduler.add_request(make_request("a", 6, max_tokens=10))
    out = scheduler.schedule()
    lp = ([1], [-0.1])
    (first,) = scheduler.update_from_output(
        out, ModelRunnerOutput(["a"], [[5]], {"a": [6, 2]}, logprobs={"a": [lp]}))
    assert (first.new_token_ids, first.finished, first.logprobs) == ([5], False, [lp])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [6, 2]}
    (last,) = scheduler.update_from_output(
        out, ModelRunnerOutput(["a"], [[6, 2, 9]], logprobs={"a": [lp, lp, lp]}))
    assert last.new_token_ids == [6, 2]  # eos 2 stops it; 9 is dropped
    assert last.logprobs == [lp, lp]
    assert (last.finished, last.finish_reason) == (True, "stop")
    assert scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput([], [])) == []
