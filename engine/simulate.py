"""Scheduler simulation: a replayable workload driven through the SimulatedRunner.

Used by `specbudget simulate` (a readable per-step budget table), the throttle
benchmark and tests. No model: tokens and acceptance come from a seeded generator.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.simulated import SimulatedRunner
from scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerOutput

EOS = 2


@dataclass(frozen=True)
class WorkloadConfig:
    """Many short requests decoding while long prompts keep arriving."""

    num_decoders: int = 64
    decoder_prompt: tuple[int, int] = (16, 128)
    decoder_max_tokens: tuple[int, int] = (64, 256)
    num_long: int = 8
    long_prompt: tuple[int, int] = (1024, 3072)
    long_max_tokens: tuple[int, int] = (16, 64)
    long_every: int = 10  # steps between long-prompt arrivals
    vocab_size: int = 1000
    seed: int = 0


def make_workload(cfg: WorkloadConfig) -> list[tuple[int, Request]]:
    """(arrival step, request) pairs, sorted by step; the same seed gives the same list."""
    rng = random.Random(cfg.seed)

    def request(rid: str, step: int, prompt: tuple[int, int], out: tuple[int, int]
                ) -> tuple[int, Request]:
        tokens = [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(*prompt))]
        params = SamplingParams(max_tokens=rng.randint(*out))
        return step, Request(rid, tokens, params, eos_token_id=EOS, arrival_time=float(step))

    arrivals = [request(f"dec-{i}", 0, cfg.decoder_prompt, cfg.decoder_max_tokens)
                for i in range(cfg.num_decoders)]
    arrivals += [request(f"long-{i}", cfg.long_every * (i + 1), cfg.long_prompt,
                         cfg.long_max_tokens)
                 for i in range(cfg.num_long)]
    return sorted(arrivals, key=lambda item: item[0])


StepHook = Callable[[int, SchedulerOutput, ModelRunnerOutput], None]


@dataclass
class SimulationResult:
    """Per-step target rows and drafter rows, and how long the workload took."""

    steps: int = 0
    target_rows: list[int] = field(default_factory=list)
    drafter_rows: list[int] = field(default_factory=list)
    num_preemptions: int = 0


def run_simulation(scheduler: Scheduler, runner: SimulatedRunner,
                   arrivals: list[tuple[int, Request]], on_step: StepHook | None = None,
                   max_steps: int = 100_000) -> SimulationResult:
    """Replay `arrivals` step by step until every request has finished."""
    result = SimulationResult()
    pending = list(arrivals)
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        output = scheduler.schedule()
        runner_output = runner.execute(output)
        scheduler.update_from_output(output, runner_output)
        result.target_rows.append(output.total_num_scheduled_tokens)
        result.drafter_rows.append(output.num_drafter_tokens)
        if on_step is not None:
            on_step(step, output, runner_output)
        step += 1
        if step >= max_steps:
            raise RuntimeError(f"simulation did not drain within {max_steps} steps")
    result.steps = step
    result.num_preemptions = scheduler.stats.num_preemptions
    return result
