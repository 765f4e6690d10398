"""What the goodput draft policy costs the scheduler per step, against the fixed policy
(every request drafts K, what the scheduler did before it), in one run.

The two alternate round by round (each round a fresh scheduler per policy, the same
steady state: N requests decoding, nothing throttled), so the machine's noise falls
on both; the figure is the ratio of medians of schedule() + update_from_output(), and
the ratio of their means.
Goodput usually drafts less, which makes the rest of its step cheaper; so the policy's
own calls (its caps and what it learns from a step, N requests with mixed histories)
are also timed alone, against the fixed policy's whole step: what goodput adds where
it drafts as much as fixed.

    python benchmarks/goodput_cost.py [--running 256,1024] [--rounds 5] [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.scheduler_overhead import NUM_SPEC, make_scheduler, run_config  # noqa: E402
from scheduler.request import NUM_OUTCOMES  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "goodput_cost.json"
POLICIES = ("fixed", "goodput")


def policy_cost_us(method: str, num: int, calls: int = 200, seed: int = 0) -> float:
    """Median µs of one step's policy calls (caps + observe_step) for N requests."""
    policy = make_scheduler(method, num, 1, "goodput").policy
    assert policy is not None
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 50, (num, NUM_OUTCOMES))
    first = (history.sum(axis=1) * rng.random(num)).astype(np.int64)
    states = rng.integers(0, NUM_OUTCOMES, num)
    rule_k = np.full(num, NUM_SPEC)
    verified, accepted = [NUM_SPEC] * num, rng.integers(0, NUM_SPEC + 1, num).tolist()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        policy.caps(history, first, states, rule_k)
        rows = num * (1 + NUM_SPEC)
        policy.observe_step(verified, accepted, states.tolist(), (rows, rows, 0, 0), 0.05)
        times.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--running", default="256,1024")
    parser.add_argument("--methods", default="ngram,dflash")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    running = [16] if args.quick else [int(n) for n in args.running.split(",")]
    rounds, steps = (1, 5) if args.quick else (args.rounds, args.steps)
    rows = []
    for method in args.methods.split(","):
        for num in running:
            medians: dict[str, list[float]] = {p: [] for p in POLICIES}
            means: dict[str, list[float]] = {p: [] for p in POLICIES}
            parts: dict[str, list[dict]] = {p: [] for p in POLICIES}
            for round_ in range(rounds):
                for policy in POLICIES:
                    rec = run_config(method, num, 1, steps, round_, policy)
                    medians[policy].append(rec["median_us"])
                    means[policy].append(rec["mean_us"])
                    parts[policy].append(rec)
            fixed, goodput = (statistics.median(medians[p]) for p in POLICIES)
            # The mean too: a step that searches costs more than one that keeps the
            # last search's threshold (scheduler/goodput.py, `_searched`), and a median
            # of steps would hide the searches.
            fixed_mean, goodput_mean = (statistics.median(means[p]) for p in POLICIES)
            policy_us = statistics.median(policy_cost_us(method, num, seed=round_)
                                          for round_ in range(rounds))
            row = {"method": method, "n_running": num, "fixed_median_us": fixed,
                   "goodput_median_us": goodput, "ratio": round(goodput / fixed, 3),
                   "fixed_mean_us": fixed_mean, "goodput_mean_us": goodput_mean,
                   "mean_ratio": round(goodput_mean / fixed_mean, 3),
                   "policy_us": round(policy_us, 1),
                   "fixed_plus_policy_ratio": round((fixed + policy_us) / fixed, 3),
                   "schedule_us": {p: statistics.median(r["schedule_median_us"]
                                                        for r in parts[p]) for p in POLICIES},
                   "update_us": {p: statistics.median(r["update_median_us"]
                                                      for r in parts[p]) for p in POLICIES}}
            rows.append(row)
            print(f"{method:<7}N={num:<5} fixed {fixed:>9.1f} us  goodput {goodput:>9.1f} us  "
                  f"x{row['ratio']} (means x{row['mean_ratio']})  policy alone {policy_us:.1f} us "
                  f"(fixed + policy x{row['fixed_plus_policy_ratio']})", flush=True)
    report = {"benchmark": "goodput_cost", "rounds": rounds, "steps": steps, "results": rows}
    write_report(out_path(args, DEFAULT_OUT), report)
    return report


if __name__ == "__main__":
    main()
