"""engine/stepwise.py: engines stepped side by side, each timed by its own steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest

import engine.stepwise as stepwise
from engine.llm import LLM
from engine.stepwise import run_side_by_side
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
