"""Scheduler: chunked prefill, whole-prompt prefill and the long-prefill threshold."""

from __future__ import annotations

import math

import pytest

from runner.simulated import SimulatedRunner
from tests.helpers import drain, make_request, make_scheduler, run_step
from tests.scheduler.lifecycle import (
    assert_idle_and_clean,
)


@pytest.mark.parametrize(("prompt_len", "budget"), [(100, 32), (64, 32), (33, 32), (7, 32)])
def test_chunked_prefill_takes_ceil_chunks_and_only_last_samples(prompt_len: int,
                                                                 budget: int) -> None:
    scheduler = make_scheduler(budget=budget)
    runner = SimulatedRunner(scheduler)
    request = make_request("a", prompt_len, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    chunks, sampled = [], []
    while not request.output_token_ids:
        out, result = run_step(scheduler, runner)
        chunks.append(out.num_scheduled_tokens["a"])
        sampled.append(result.sampled_token_ids[result.req_ids.index("a")])
    assert len(chunks) == math.ceil(prompt_len / budget)
    assert sum(chunks) == prompt_len
    assert all(chunk <= budget for chunk in chunks)
    assert all(s == [] for s in sampled[:-1])
    assert len(sampled[-1]) == 1
    drain(scheduler, runner)
    assert_idle_and_clean(scheduler)


def test_no_chunked_prefill_schedules_whole_prompts_only() -> None:
    scheduler = make_scheduler(budget=256, max_model_len=256, enable_chunked_prefill=False)
    runner = SimulatedRunner(scheduler)
    a = make_request("a", 150, max_tokens=3, ignore_eos=True)
    b = make_request("b", 150, max_tokens=3, ignore_eos=True, first_token=300)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 150}  # b does not fit the rest; no chunk
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 150}
    drain(scheduler, runner)
    assert_idle_and_clean(scheduler)


def test_chunked_prefill_fills_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(budget=256, max_model_len=256)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 150, max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("b", 150, max_tokens=3, ignore_eos=True,
                                       first_token=300))
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 150, "b": 106}


@pytest.mark.parametrize(("prompt_len", "threshold"), [(35, 10), (40, 10), (9, 10)])
def test_long_prefill_threshold_caps_chunk_size(prompt_len: int, threshold: int) -> None:
    scheduler = make_scheduler(budget=64, long_prefill_token_threshold=threshold)
    runner = SimulatedRunner(scheduler)
    request = make_request("a", prompt_len, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    chunks = []
    while not request.output_token_ids:
        out, _ = run_step(scheduler, runner)
        chunks.append(out.num_scheduled_tokens["a"])
    assert max(chunks) <= threshold
    assert sum(chunks) == prompt_len
    assert len(chunks) == math.ceil(prompt_len / threshold)


def test_long_prefill_threshold_without_chunking_still_makes_progress() -> None:
    scheduler = make_scheduler(budget=256, max_model_len=256, enable_chunked_prefill=False,
                               long_prefill_token_threshold=8)
    request = make_request("a", 20, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)  # accepted, so it must run (or be refused up front)
    drain(scheduler, SimulatedRunner(scheduler), max_steps=50)
    assert len(request.output_token_ids) == 2
