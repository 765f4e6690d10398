"""engine/stepwise.py: engines stepped side by side, each timed by its own steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

from engine.llm import LLM
from engine.stepwise import run_side_by_side
from scheduler import SamplingParams


class _Stepper:
    """Stands in for an LLM: `steps` steps, each sleeping `pause` seconds and logging
    its engine's name; yields the step number as its 'outputs'."""

    def __init__(self, name: int, steps: int, pause: float, log: list[int]) -> None:
        self.name, self.steps, self.pause, self.log = name, steps, pause, log

    def generate_stepwise(self, prompts: Any, params: Any) -> Iterator[list[int]]:
        for step in range(self.steps):
            time.sleep(self.pause)
            self.log.append(self.name)
            yield [step]


def test_engines_take_turns_first_and_are_timed_by_their_own_steps() -> None:
    log: list[int] = []
    engines = [_Stepper(0, 3, 0.0, log), _Stepper(1, 2, 0.02, log), _Stepper(2, 3, 0.0, log)]
    seconds, last = run_side_by_side(cast(list[LLM], engines), ["p"], SamplingParams())
    # Round 0 starts with engine 0, round 1 with engine 1, round 2 with engine 2 (where
    # engine 1 finds it has finished); then the two left go on, still rotating.
    assert log == [0, 1, 2, 1, 2, 0, 2, 0]
    assert last == [[2], [1], [2]]  # each engine's last outputs
    # Only engine 1 slept: 40 ms its own, none counted to the others.
    assert seconds[1] >= 0.04 and max(seconds[0], seconds[2]) < seconds[1] / 2
