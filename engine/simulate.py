"""Scheduler simulation: a replayable workload driven through the SimulatedRunner.

Used by `specbudget simulate` (a readable per-step budget table), the throttle
benchmark and tests. No model: tokens and acceptance come from a seeded generator.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.simulated import SimulatedRunner
from scheduler import (
    CacheConfig,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.config import GoodputSettings
from spec_decode import SpeculativeConfig

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


# ---- `specbudget simulate` ------------------------------------------------------------


class _Table:
    """Prints one line per step: requests, each pass's rows against B, drafts, events."""

    def __init__(self, scheduler: Scheduler, max_rows: int) -> None:
        self.scheduler = scheduler
        self.max_rows = max_rows
        self.budget = scheduler.config.max_num_batched_tokens
        names = scheduler.rule.pass_names
        self.names = names
        cells = [f"{'step':>5}", f"{'run':>4}", f"{'wait':>4}"]
        cells += [f"{name + '/B':>13}" for name in names]
        cells += [f"{'k-sum':>5}", f"{'k-max':>5}", f"{'kv%':>5}", "events"]
        print(" ".join(cells))

    def __call__(self, step: int, out: SchedulerOutput, _: ModelRunnerOutput) -> None:
        if self.max_rows and step >= self.max_rows:
            return
        sched = self.scheduler
        cells = [f"{step:>5}", f"{len(sched.running):>4}", f"{len(sched.waiting):>4}"]
        for name in self.names:
            rows = out.pass_rows[name]
            cells.append(f"{rows:>5}/{self.budget:<4}{rows / self.budget:>4.0%}")
        k = out.num_draft_tokens.values()
        cells += [f"{sum(k):>5}", f"{max(k, default=0):>5}", f"{sched.kv_cache_usage():>5.0%}"]
        events = []
        if out.scheduled_new_reqs:
            events.append(f"+{len(out.scheduled_new_reqs)} admitted")
        if out.preempted_req_ids:
            events.append(f"{len(out.preempted_req_ids)} preempted")
        if out.finished_req_ids:
            events.append(f"{len(out.finished_req_ids)} finished")
        print(" ".join([*cells, ", ".join(events)]))


def synthetic_step_time(seconds_per_pass: float, seconds_per_row: float,
                        seconds_per_drafter_pass: float | None = None,
                        ) -> Callable[[dict[str, int]], float]:
    """A deterministic clock for the simulated runner: each pass that runs costs a
    fixed time plus a time per row (what the goodput policy's time model learns); a
    drafter's pass `seconds_per_drafter_pass` if given (a GPU's: the target's launches
    ~13 ms, a head's ~1.4 ms, measured on an H200), else the same as the target's."""
    drafter_pass = (seconds_per_pass if seconds_per_drafter_pass is None
                    else seconds_per_drafter_pass)

    def step_time(pass_rows: dict[str, int]) -> float:
        ran = sum(1 for name, rows in pass_rows.items() if rows and name != "target")
        target = seconds_per_pass if pass_rows.get("target") else 0.0
        return target + drafter_pass * ran + seconds_per_row * sum(pass_rows.values())
    return step_time


def check_simulate_arguments(args: argparse.Namespace) -> None:
    """Refuse a clock or an acceptance no run could mean, naming the option (the
    scheduler's own configs check the rest when `simulate_scheduler` builds them)."""
    for option in ("seconds_per_pass", "seconds_per_row", "seconds_per_drafter_pass"):
        value = getattr(args, option)
        if value is not None and not value >= 0.0:
            raise ValueError(f"--{option.replace('_', '-')} must be >= 0 seconds, "
                             f"got {value}")
    if not 0.0 <= args.acceptance <= 1.0:
        raise ValueError(f"--acceptance must be a probability in [0, 1], got {args.acceptance}")


def simulate_scheduler(args: argparse.Namespace) -> Scheduler:
    """The scheduler `specbudget simulate` runs (ValueError naming the option if a
    config refuses its value)."""
    spec = (None if args.method == "none"
            else SpeculativeConfig(args.method, args.num_speculative_tokens,
                                   draft_policy=args.draft_policy))
    return Scheduler(
        SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len),
        CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
        spec, goodput=GoodputSettings(step_prior=args.step_prior),
    )


def simulate_command(args: argparse.Namespace, scheduler: Scheduler) -> int:
    """`specbudget simulate`: `scheduler` (`simulate_scheduler`'s, built by the caller
    so a refused config is a user error, not a traceback) alone on a replayed workload."""
    spec = scheduler.speculative_config
    # Strict: the runner holds the scheduler's limits and checks every step as the
    # model runner would (k rule, positions, KV slots, each pass against B).
    clock = synthetic_step_time(args.seconds_per_pass, args.seconds_per_row,
                                args.seconds_per_drafter_pass)
    runner = SimulatedRunner(scheduler, acceptance=args.acceptance, seed=args.seed,
                             step_time=clock)
    workload = make_workload(WorkloadConfig(num_decoders=args.num_decoders,
                                            num_long=args.num_long, seed=args.seed,
                                            long_prompt=(512, 2048)))
    table = None if args.json else _Table(scheduler, args.rows)
    result = run_simulation(scheduler, runner, workload, on_step=table)
    stats = scheduler.stats
    summary = {
        "method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "steps": result.steps, "preemptions": result.num_preemptions,
        "mean_target_rows": sum(result.target_rows) / result.steps,
        "peak_rows_per_pass": stats.peak_pass_rows,
        "acceptance_rate": (stats.num_accepted_drafts / stats.num_verified_drafts
                            if stats.num_verified_drafts else None),
        "draft_policy": spec.draft_policy if spec else None,
        "step_prior": args.step_prior,
        "goodput": stats.goodput.as_dict(),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"\n{result.steps} steps, {result.num_preemptions} preemptions; peak rows per "
              f"pass {stats.peak_pass_rows} (B={args.max_num_batched_tokens}): "
              "no pass ever exceeded B, and every step's built rows matched the charge.")
        chosen = stats.goodput
        if spec is not None and chosen.num_sampling_steps:
            print(f"chosen k (draft_policy={spec.draft_policy}): requests per k "
                  f"{dict(enumerate(chosen.chosen_k))}; steps with k = 0 for every "
                  f"sampling request: {chosen.share_steps_k0:.0%}")
    return 0
