"""Several engines generating the same prompts side by side, one step of each in turn.

This machine's speed drifts by tens of percent over seconds, so runs made one after
another a few seconds apart differ by as much as the configurations being compared;
steps ~50 ms apart see the same machine. Each engine is timed by the sum of its own
steps, and who steps first rotates every round, so no engine always follows another
(a step after a heavier one finds caches cooler).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.heap import frozen_heap
from engine.llm import LLM, RequestOutput
from scheduler import SamplingParams


def run_side_by_side(engines: Sequence[LLM], prompts: str | list[str] | list[list[int]],
                     params: SamplingParams) -> tuple[list[float], list[list[RequestOutput]]]:
    """(seconds, final outputs in prompt order) of each engine for the same `prompts`,
    stepped in turn (`LLM.generate_stepwise`), over a frozen heap (engine/heap.py) as
    a served engine core's is."""
    with frozen_heap():
        return _stepped(engines, prompts, params)


def _stepped(engines: Sequence[LLM], prompts: str | list[str] | list[list[int]],
             params: SamplingParams) -> tuple[list[float], list[list[RequestOutput]]]:
    steps = [llm.generate_stepwise(prompts, params) for llm in engines]
    seconds = [0.0] * len(engines)
    last: list[list[RequestOutput]] = [[] for _ in engines]
    running = list(range(len(engines)))
    turn = 0
    while running:
        shift = turn % len(running)
        for i in running[shift:] + running[:shift]:
            start = time.perf_counter()
            got = next(steps[i], None)
            seconds[i] += time.perf_counter() - start
            if got is None:
                running.remove(i)
            else:
                last[i] = got
        turn += 1
    return seconds, last
