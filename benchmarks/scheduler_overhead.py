"""Scheduler CPU overhead per step: `schedule()` + `update_from_output()`, in microseconds.

N requests all decode in steady state (prefilled, drafts flowing, none finishing); only
the two scheduler calls are timed, never the SimulatedRunner that produces the outputs.
Speculation off is compared with eagle and dflash at K = 4, to show what the per-pass
throttle (a chunk scan per request, several pass budgets) costs on the CPU.

Each repeat builds a fresh scheduler, warms it up, then times `--steps` decode steps;
the statistics pool every timed step of every repeat. The garbage collector stays on
(its pauses are part of what a real engine pays), so p90 is noisier than the median.

    python benchmarks/scheduler_overhead.py [--quick] [--out PATH]
"""

from __future__ import annotations

import gc
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from runner.simulated import SimulatedRunner  # noqa: E402
from scheduler import (  # noqa: E402
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from spec_decode import SpeculativeConfig  # noqa: E402

METHODS = (None, "eagle", "dflash")
NUM_SPEC = 4
ACCEPTANCE = 0.6
PROMPT_LEN = 32
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_TOKENS = 4096  # far more than any run generates: nothing finishes while timed
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "scheduler_overhead.json"


@dataclass(frozen=True)
class Grid:
    sizes: tuple[int, ...]  # running requests N
    repeats: int  # fresh schedulers per configuration
    steps: int  # timed steps per repeat


FULL = Grid(sizes=(64, 256, 1024), repeats=5, steps=50)
QUICK = Grid(sizes=(16, 64), repeats=2, steps=3)


def make_scheduler(method: str | None, num_reqs: int, num_steps: int,
                   draft_policy: str = "fixed") -> Scheduler:
    # B fits every request's full decode (1 + K rows) at once, so nothing is throttled
    # and every step schedules all N requests: the cost measured is per request.
    budget = max(8192, num_reqs * (1 + NUM_SPEC))
    # Each step adds at most 1 + K tokens plus K lookahead slots per request.
    tokens = PROMPT_LEN + (num_steps + 1) * (1 + NUM_SPEC) + NUM_SPEC
    # The scheduler refuses a request whose max_tokens could not fit the pool: at small
    # N the pool holds at least one whole request.
    num_blocks = max(num_reqs * (tokens // BLOCK_SIZE + 2),
                     (PROMPT_LEN + MAX_TOKENS + NUM_SPEC) // BLOCK_SIZE + 2)
    # "fixed" by default: every request drafts K, the cost this benchmark has always
    # measured (benchmarks/goodput_cost.py compares the goodput policy against it).
    spec = SpeculativeConfig(method, NUM_SPEC, draft_policy=draft_policy) if method else None
    return Scheduler(SchedulerConfig(budget, num_reqs, MAX_MODEL_LEN),
                     CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks), spec)


def add_requests(scheduler: Scheduler, num_reqs: int) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(num_reqs):
        # Distinct prompts: no prefix hits, every request prefills its own blocks.
        prompt = [3 + (i * PROMPT_LEN + j) % 49000 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, arrival_time=float(i)))


def warm_up(scheduler: Scheduler, runner: SimulatedRunner, num_reqs: int) -> int:
    """Step until every request has sampled twice (so drafts are pending); steps taken."""
    steps = 0
    while min((r.num_output_tokens for r in scheduler.requests.values()), default=0) < 2:
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
        steps += 1
        if steps > 1000:
            raise RuntimeError("warm-up did not reach steady state")
    assert len(scheduler.running) == num_reqs, "not every request is running"
    return steps


def time_steps(scheduler: Scheduler, runner: SimulatedRunner, num_reqs: int,
               num_steps: int) -> tuple[list[float], list[float]]:
    """Microseconds of schedule() and of update_from_output() for each timed step."""
    schedule_us, update_us = [], []
    clock = time.perf_counter_ns
    for _ in range(num_steps):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        result = runner.execute(out)  # not timed
        t2 = clock()
        scheduler.update_from_output(out, result)
        t3 = clock()
        # Steady state or the numbers mean nothing: all N decode, none leaves.
        assert len(out.num_scheduled_tokens) == num_reqs, "a request was not scheduled"
        assert not out.preempted_req_ids and not out.finished_req_ids
        schedule_us.append((t1 - t0) / 1000)
        update_us.append((t3 - t2) / 1000)
    return schedule_us, update_us


def run_config(method: str | None, num_reqs: int, repeats: int, num_steps: int,
               seed: int, draft_policy: str = "fixed") -> dict:
    total, sched, update, repeat_medians = [], [], [], []
    for repeat in range(repeats):
        scheduler = make_scheduler(method, num_reqs, num_steps + 64, draft_policy)
        runner = SimulatedRunner(scheduler, acceptance=ACCEPTANCE, seed=seed + repeat)
        add_requests(scheduler, num_reqs)
        warm_up(scheduler, runner, num_reqs)
        gc.collect()  # start each timed window without the warm-up's garbage
        s_us, u_us = time_steps(scheduler, runner, num_reqs, num_steps)
        step_us = [a + b for a, b in zip(s_us, u_us, strict=True)]
        total += step_us
        sched += s_us
        update += u_us
        repeat_medians.append(round(statistics.median(step_us), 1))
    deciles = statistics.quantiles(total, n=10)
    median = statistics.median(total)
    return {
        "n_running": num_reqs,
        "method": method or "off",
        "draft_policy": draft_policy if method else None,
        "num_speculative_tokens": NUM_SPEC if method else 0,
        "median_us": round(median, 1),
        "mean_us": round(statistics.fmean(total), 1),
        "p10_us": round(deciles[0], 1),
        "p90_us": round(deciles[-1], 1),
        "us_per_request": round(median / num_reqs, 3),
        "schedule_median_us": round(statistics.median(sched), 1),
        "update_median_us": round(statistics.median(update), 1),
        "repeat_medians_us": repeat_medians,
        "steps_timed": len(total),
    }


def spec_ratios(records: list[dict]) -> list[dict]:
    """Median spec-on / spec-off, per N."""
    off = {r["n_running"]: r["median_us"] for r in records if r["method"] == "off"}
    return [{"n_running": r["n_running"], "method": r["method"],
             "median_ratio_vs_off": round(r["median_us"] / off[r["n_running"]], 3)}
            for r in records if r["method"] != "off" and r["n_running"] in off]


def print_summary(records: list[dict], ratios: list[dict]) -> None:
    ratio = {(r["n_running"], r["method"]): r["median_ratio_vs_off"] for r in ratios}
    print(f"{'N':>5}  {'method':<7}{'median_us':>11}{'p10_us':>10}{'p90_us':>10}"
          f"{'us/req':>8}{'sched':>9}{'update':>9}{'vs off':>8}")
    for r in records:
        vs_off = ratio.get((r["n_running"], r["method"]))
        print(f"{r['n_running']:>5}  {r['method']:<7}{r['median_us']:>11.1f}"
              f"{r['p10_us']:>10.1f}{r['p90_us']:>10.1f}{r['us_per_request']:>8.2f}"
              f"{r['schedule_median_us']:>9.1f}{r['update_median_us']:>9.1f}"
              f"{'' if vs_off is None else f'{vs_off:.2f}x':>8}")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0, help="SimulatedRunner seed")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else FULL
    args.out = out_path(args, DEFAULT_OUT)
    records = [run_config(method, num_reqs, grid.repeats, grid.steps, args.seed)
               for num_reqs in grid.sizes for method in METHODS]
    ratios = spec_ratios(records)
    report = {
        "benchmark": "scheduler_overhead",
        "quick": args.quick,
        "timed": "schedule() + update_from_output() per step; runner excluded",
        "acceptance": ACCEPTANCE,
        "prompt_len": PROMPT_LEN,
        "repeats": grid.repeats,
        "steps_per_repeat": grid.steps,
        "seed": args.seed,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": records,
        "spec_on_over_off": ratios,
    }
    write_report(args.out, report)
    print_summary(records, ratios)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
