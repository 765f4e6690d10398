"""Parked requests in the scheduler: under a method whose drafter keeps its own KV (a
head, a draft LM), a request that samples with k = 0 puts no rows in the drafter's
passes, and the step it drafts again charges the rows its drafter catches up. The
`SimulatedRunner` re-derives every row from its own count of each drafter's lag, so
a scheduler that charged otherwise would be refused there."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from runner.simulated import SimulatedRunner
from scheduler import Request, Scheduler
from scheduler.goodput import GoodputPolicy
from tests.helpers import make_request, make_scheduler, run_step

K = 3


def scripted_caps(monkeypatch: pytest.MonkeyPatch, script: Callable[[int], int]) -> None:
    """The goodput policy replaced: step i caps every request at script(i)."""
    calls = [0]

    def caps(self: GoodputPolicy, *args: object, **kwargs: object) -> np.ndarray:
        cap = script(calls[0])
        calls[0] += 1
        self.new_request_cap = cap
        return np.full(len(args[3]), cap)  # type: ignore[arg-type]

    monkeypatch.setattr(GoodputPolicy, "caps", caps)


def goodput_scheduler(method: str = "dflash", budget: int = 64) -> Scheduler:
    return make_scheduler(method, k=K, budget=budget, draft_policy="goodput")


def test_a_parked_request_charges_no_drafter_rows_then_catches_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill drafts, steps 1-4 are parked, step 5 drafts again: its context pass
    carries the 4 skipped positions and its chunk. (A sampling prefill chunk with
    k = 0 would be parked too.)"""
    scripted_caps(monkeypatch, lambda i: K if i in (0, 5) else 0)
    sched = goodput_scheduler()
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    request = make_request("r", 10, max_tokens=30, ignore_eos=True)
    sched.add_request(request)
    out, _ = run_step(sched, runner)  # the prefill: it follows (context rows = 10)
    assert out.pass_rows["context"] == 10 and request.num_drafter_computed == 10
    for step in range(1, 5):
        out, _ = run_step(sched, runner)
        assert out.num_draft_tokens.get("r", 0) == 0
        assert out.pass_rows["context"] == out.pass_rows["query"] == 0
        assert request.num_computed_tokens - request.num_drafter_computed == step
    out, _ = run_step(sched, runner)
    assert out.num_draft_tokens["r"] == K
    assert out.pass_rows["context"] == 4 + 1 and out.pass_rows["query"] == K + 1
    assert request.num_drafter_computed == request.num_computed_tokens
    assert sched.stats.goodput.as_dict()["catch_up_rows"] == 4


def test_a_catch_up_that_does_not_fit_parks_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """B = 16: after 20 parked steps the catch-up (20 rows + the chunk) cannot fit the
    context pass, so the request keeps decoding with k = 0 rather than waiting."""
    scripted_caps(monkeypatch, lambda i: K if i > 20 else 0)
    sched = goodput_scheduler(budget=16)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    request = make_request("r", 4, max_tokens=40, ignore_eos=True)
    sched.add_request(request)
    for _ in range(22):
        out, _ = run_step(sched, runner)
        assert out.num_scheduled_tokens["r"] >= 1
    assert out.num_draft_tokens.get("r", 0) == 0 and out.adapted_draft_tokens["r"] == K
    assert out.pass_rows["context"] == 0


def test_blocks_cached_while_parked_are_caught_up_by_the_next_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Request a decodes 24 tokens parked; b's prompt is a's whole sequence. b reuses
    a's cached blocks, but its drafter holds only the prompt's blocks (a's prefill
    followed: it drafted), so b's first chunk carries the rest as catch-up rows."""
    scripted_caps(monkeypatch, lambda i: K if i == 0 else 0)
    sched = goodput_scheduler(method="eagle")
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    a = make_request("a", 8, max_tokens=24, ignore_eos=True)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        run_step(sched, runner)
    scripted_caps(monkeypatch, lambda i: K)  # b drafts from its first chunk
    b = Request("b", list(a.all_token_ids), a.sampling_params, eos_token_id=2)
    sched.add_request(b)
    out, _ = run_step(sched, runner)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 28  # 7 of its 8 blocks (the last token computed)
    assert new.num_drafter_computed == 8  # the prompt's 2 full blocks only
    assert out.pass_rows["draft"] == out.num_scheduled_tokens["b"] + 20
    assert sched.stats.goodput.catch_up_rows == 20


def test_a_long_stale_prefix_is_taken_up_to_half_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B = 16: at most 8 stale tokens are taken from the cache (2 blocks), the rest
    recomputed, so the first chunk's catch-up always fits."""
    scripted_caps(monkeypatch, lambda i: K if i == 0 else 0)
    sched = goodput_scheduler(method="eagle", budget=16)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    a = make_request("a", 8, max_tokens=24, ignore_eos=True)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        run_step(sched, runner)
    sched.add_request(Request("b", list(a.all_token_ids), a.sampling_params, eos_token_id=2))
    out, _ = run_step(sched, runner)
    (new,) = out.scheduled_new_reqs
    assert (new.num_drafter_computed, new.num_computed_tokens) == (8, 16)
