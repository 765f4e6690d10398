"""Several engines generating the same prompts side by side, one step of each in turn
(`run_side_by_side`) or one request of each in turn (`run_request_by_request`).

This machine's speed drifts by tens of percent over seconds, so runs made one after
another a few seconds apart differ by as much as the configurations being compared;
steps ~50 ms apart see the same machine. Each engine is timed by the sum of its own
steps, and who steps first rotates every round, so no engine always follows another
(a step after a heavier one finds caches cooler). A step of another engine between
two of one engine's still leaves that engine's caches cooler than serving alone
does, and more so the more memory it reads that the others do not (a drafter's
weights): taking turns a whole request at a time (one request at a time, ~1-2 s
apart) serves each engine as it serves alone while still cancelling drift between
requests. Measured side by side, eagle's [4, 2, 1] trees against speculation off:
1.447 / 1.500 / 1.456x stepped, 1.489 / 1.499 / 1.475x request by request, three
runs of each alternated (24 held-out prompts, 64 tokens).
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


def run_request_by_request(engines: Sequence[LLM], prompts: list[str] | list[list[int]],
                           params: SamplingParams
                           ) -> tuple[list[float], list[list[RequestOutput]]]:
    """`run_side_by_side`'s result, taking turns a whole prompt at a time: each prompt
    generated to the end by every engine in turn, who goes first rotating with each
    prompt; each engine timed by its own requests."""
    seconds = [0.0] * len(engines)
    outs: list[list[RequestOutput]] = [[] for _ in engines]
    with frozen_heap():
        for n, prompt in enumerate(prompts):
            shift = n % len(engines)
            for i in [*range(shift, len(engines)), *range(shift)]:
                start = time.perf_counter()
                outs[i] += engines[i].generate([prompt], params, use_tqdm=False)
                seconds[i] += time.perf_counter() - start
    return seconds, outs


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
