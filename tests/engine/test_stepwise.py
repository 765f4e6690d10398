"""engine/stepwise.py: engines stepped side by side, each timed by its own steps."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any, cast

import pytest

import engine.stepwise as stepwise
from engine.llm import LLM
from engine.stepwise import run_request_by_request, run_side_by_side
from scheduler import SamplingParams


class _Clock:
    """A clock that moves only when a fake engine says its step took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Stepper:
    """Stands in for an LLM: `steps` steps, each taking `cost` seconds of the clock and
    logging its engine's name; yields the step number as its 'outputs'."""

    def __init__(self, name: int, steps: int, cost: float, log: list[int],
                 clock: _Clock) -> None:
        self.name, self.steps, self.cost, self.log, self.clock = name, steps, cost, log, clock

    def generate_stepwise(self, prompts: Any, params: Any) -> Iterator[list[int]]:
        for step in range(self.steps):
            self.clock.now += self.cost
            self.log.append(self.name)
            yield [step]


def test_engines_take_turns_first_and_are_timed_by_their_own_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock, log = _Clock(), []
    monkeypatch.setattr(stepwise, "time", clock)
    engines = [_Stepper(0, 3, 1.0, log, clock), _Stepper(1, 2, 10.0, log, clock),
               _Stepper(2, 3, 100.0, log, clock)]
    seconds, last = run_side_by_side(cast(list[LLM], engines), ["p"], SamplingParams())
    # Round 0 starts with engine 0, round 1 with engine 1, round 2 with engine 2 (where
    # engine 1 finds it has finished); then the two left go on, still rotating.
    assert log == [0, 1, 2, 1, 2, 0, 2, 0]
    assert last == [[2], [1], [2]]  # each engine's last outputs
    # Each engine is charged its own steps' time and no one else's.
    assert seconds == [3.0, 20.0, 300.0]


class _HeapWatcher:
    """An engine of one step that notes how many objects the collector holds frozen
    while it steps."""

    def __init__(self) -> None:
        self.frozen: list[int] = []

    def generate_stepwise(self, prompts: Any, params: Any) -> Iterator[list[int]]:
        self.frozen.append(gc.get_freeze_count())
        yield [0]


def test_engines_step_over_a_frozen_heap_that_thaws_after() -> None:
    """The heap standing when the run starts is frozen while the engines step (a full
    collection then scans only what they make, as in a served engine core), and thawed
    after, so engines dropped later are collected again; also when a step fails."""
    watcher = _HeapWatcher()
    run_side_by_side(cast(list[LLM], [watcher]), ["p"], SamplingParams())
    assert watcher.frozen[0] > 10_000 and gc.get_freeze_count() == 0

    class Failing:
        def generate_stepwise(self, prompts: Any, params: Any) -> Iterator[list[int]]:
            raise RuntimeError("step failed")
            yield [0]

    with pytest.raises(RuntimeError, match="step failed"):
        run_side_by_side(cast(list[LLM], [Failing()]), ["p"], SamplingParams())
    assert gc.get_freeze_count() == 0


class _Requester:
    """Stands in for an LLM serving whole requests: each prompt costs `cost` seconds
    of the clock a character, logs (engine, prompt, frozen objects) and comes back as
    its own output."""

    def __init__(self, name: int, cost: float, log: list[tuple[int, str, int]],
                 clock: _Clock) -> None:
        self.name, self.cost, self.log, self.clock = name, cost, log, clock

    def generate(self, prompts: list[str], params: Any, use_tqdm: bool) -> list[str]:
        assert len(prompts) == 1 and not use_tqdm
        self.clock.now += self.cost * len(prompts[0])
        self.log.append((self.name, prompts[0], gc.get_freeze_count()))
        return [prompts[0].upper()]


def test_engines_take_turns_a_request_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt is served whole by each engine in turn, who goes first rotating
    prompt by prompt; each engine is timed by its own requests, outputs in prompt
    order, over a frozen heap that thaws after."""
    clock, log = _Clock(), []
    monkeypatch.setattr(stepwise, "time", clock)
    engines = [_Requester(0, 1.0, log, clock), _Requester(1, 10.0, log, clock)]
    seconds, outs = run_request_by_request(cast(list[LLM], engines), ["a", "bb", "ccc"],
                                           SamplingParams())
    assert [(name, prompt) for name, prompt, _ in log] == [
        (0, "a"), (1, "a"), (1, "bb"), (0, "bb"), (0, "ccc"), (1, "ccc")]
    assert seconds == [6.0, 60.0]
    assert outs == [["A", "BB", "CCC"], ["A", "BB", "CCC"]]
    assert all(frozen > 10_000 for _, _, frozen in log) and gc.get_freeze_count() == 0
