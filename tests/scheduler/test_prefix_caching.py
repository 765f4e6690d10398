"""Scheduler: prefix-cache hits at admission and while running."""

from __future__ import annotations

from runner.simulated import SimulatedRunner
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    assert_idle_and_clean,
)


def test_identical_prompt_hits_prefix_cache_at_admission() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = SimulatedRunner(scheduler)
    first = make_request("first", 18, max_tokens=3, ignore_eos=True)
    scheduler.add_request(first)
    drain(scheduler, runner)
    assert scheduler.stats.num_prefix_hit_tokens == 0
    second = make_request("second", 18, max_tokens=3, ignore_eos=True)
    scheduler.add_request(second)
    out, _ = run_step(scheduler, runner)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 16  # 4 full blocks of the 18-token prompt
    assert scheduler.stats.num_prefix_hit_tokens == 16
    assert out.num_scheduled_tokens["second"] == 2
    drain(scheduler, runner)
    assert len(second.output_token_ids) == 3
    assert_idle_and_clean(scheduler)


def test_prefix_shared_while_both_running() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 12, max_tokens=10, ignore_eos=True))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", 12, max_tokens=10, ignore_eos=True))
    run_step(scheduler, runner)
    # Exactly 3 full blocks: the hit is capped one token short, so 2 are shared.
    assert scheduler.stats.num_prefix_hit_tokens == 8
    shared = scheduler.kv.req_blocks["a"][:2]
    assert scheduler.kv.req_blocks["b"][:2] == shared
    assert all(block.ref_cnt == 2 for block in shared)
    drain(scheduler, runner)
    assert_idle_and_clean(scheduler)


def test_no_prefix_hits_when_caching_disabled() -> None:
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 18, max_tokens=3, ignore_eos=True))
    drain(scheduler, runner)
    scheduler.add_request(make_request("b", 18, max_tokens=3, ignore_eos=True))
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens["b"] == 18
    assert scheduler.stats.num_prefix_hit_tokens == 0


def test_prefix_cached_even_when_request_finishes_on_first_token() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("first", 18, max_tokens=1, ignore_eos=True))
    drain(scheduler, runner)
    scheduler.add_request(make_request("second", 18, max_tokens=1, ignore_eos=True))
    run_step(scheduler, runner)
    assert scheduler.stats.num_prefix_hit_tokens == 16
