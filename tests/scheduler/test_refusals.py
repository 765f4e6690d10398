"""Scheduler: requests that could never run are refused by name; the rest keep running."""

from __future__ import annotations

import pytest

from runner.simulated import SimulatedRunner
from scheduler import Request
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    assert_idle_and_clean,
)


def test_invalid_requests_refused_and_others_keep_running() -> None:
    scheduler = make_scheduler(max_model_len=64, block_size=4, num_blocks=8)
    runner = SimulatedRunner(scheduler)
    good = make_request("good", 10, max_tokens=5, ignore_eos=True)
    scheduler.add_request(good)
    run_step(scheduler, runner)

    with pytest.raises(ValueError, match=r"request_id 'good'"):
        scheduler.add_request(make_request("good", 5))
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        scheduler.add_request(Request("empty", []))
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add_request(make_request("longer", 200))
    # 8 blocks of 4 slots hold 32 tokens; 20 + 20 can never fit.
    with pytest.raises(ValueError, match="num_blocks=8"):
        scheduler.add_request(make_request("huge", 20, max_tokens=20))

    assert set(scheduler.requests) == {"good"}
    assert scheduler.requests["good"] is good
    drain(scheduler, runner)
    assert len(good.output_token_ids) == 5
    assert_idle_and_clean(scheduler)


def test_prompt_one_below_max_model_len_is_accepted() -> None:
    scheduler = make_scheduler(max_model_len=64)
    scheduler.add_request(make_request("ok", 63))
    assert "ok" in scheduler.requests


def test_request_that_fits_the_pool_exactly_is_accepted_and_finishes() -> None:
    # 8 blocks x 4 = 32 slots: 16 prompt + 15 outputs use 31 known tokens.
    scheduler = make_scheduler(block_size=4, num_blocks=8)
    request = make_request("fit", 16, max_tokens=15, ignore_eos=True)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler))
    assert len(request.output_token_ids) == 15
    assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", ["pard", "dflash", "eagle", "draft_model"])
def test_accepted_request_never_livelocks_on_a_tiny_pool(method: str) -> None:
    """Whatever add_request accepts on a pool that just fits, must finish alone; what
    it refuses is refused for the KV it may need (and something must be admitted, or
    the test would pass without running anything)."""
    scheduler = make_scheduler(method, k=3, block_size=4, num_blocks=10)
    admitted = []
    for prompt, max_tokens in ((8, 40), (20, 10), (4, 20)):
        request = make_request(f"r{prompt}", prompt, max_tokens=max_tokens, ignore_eos=True)
        if prompt + max_tokens > 10 * 4:  # more slots than the whole pool
            with pytest.raises(ValueError, match=r"may need 12 KV blocks"):
                scheduler.add_request(request)
            continue
        scheduler.add_request(request)
        admitted.append(request.request_id)
        drain(scheduler, SimulatedRunner(scheduler, acceptance=1.0), max_steps=500)
        assert len(request.output_token_ids) == max_tokens
        assert_idle_and_clean(scheduler)
    assert admitted == ["r20", "r4"]
