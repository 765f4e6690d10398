"""What the goodput draft policy costs the scheduler per step, against the fixed policy
(every request drafts K, what the scheduler did before it), in one run.

The two alternate round by round (each round a fresh scheduler per policy, the same
steady state: N requests decoding, nothing throttled), so the machine's noise falls
on both; the figure is the ratio of medians of schedule() + update_from_output().

    python benchmarks/goodput_cost.py [--running 256,1024] [--rounds 5] [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.scheduler_overhead import run_config  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "goodput_cost.json"
POLICIES = ("fixed", "goodput")


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
            parts: dict[str, list[dict]] = {p: [] for p in POLICIES}
            for round_ in range(rounds):
                for policy in POLICIES:
                    rec = run_config(method, num, 1, steps, round_, policy)
                    medians[policy].append(rec["median_us"])
                    parts[policy].append(rec)
            fixed, goodput = (statistics.median(medians[p]) for p in POLICIES)
            row = {"method": method, "n_running": num, "fixed_median_us": fixed,
                   "goodput_median_us": goodput, "ratio": round(goodput / fixed, 3),
                   "schedule_us": {p: statistics.median(r["schedule_median_us"]
                                                        for r in parts[p]) for p in POLICIES},
                   "update_us": {p: statistics.median(r["update_median_us"]
                                                      for r in parts[p]) for p in POLICIES}}
            rows.append(row)
            print(f"{method:<7}N={num:<5} fixed {fixed:>9.1f} us  goodput {goodput:>9.1f} us  "
                  f"x{row['ratio']}", flush=True)
    report = {"benchmark": "goodput_cost", "rounds": rounds, "steps": steps, "results": rows}
    write_report(out_path(args, DEFAULT_OUT), report)
    return report


if __name__ == "__main__":
    main()
