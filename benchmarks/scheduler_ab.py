"""Scheduler overhead of this tree against an earlier commit, interleaved in one run.

On a shared, noisy machine two separate runs of `scheduler_overhead.py` can differ by
2x; alternating the two trees round by round (each round a fresh subprocess timing
`schedule()` and `update_from_output()` for spec off, eagle and dflash) puts the same
noise on both sides, so the ratio means something.

    python benchmarks/scheduler_ab.py --base REV [--running 256] [--rounds 6] [--out PATH]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "scheduler_ab.json"
STEPS = 40
# Runs inside either tree: its own scheduler_overhead.run_config, one repeat per round.
PROBE = ("import json, sys; sys.path.insert(0, '.'); "
         "from benchmarks.scheduler_overhead import run_config; "
         "print(json.dumps([run_config(m, int(sys.argv[1]), 1, int(sys.argv[2]), "
         "int(sys.argv[3])) for m in (None, 'eagle', 'dflash')]))")


def probe(tree: Path, running: int, seed: int) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(running), str(STEPS), str(seed)],
                         cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def compare(base: Path, running: int, rounds: int) -> list[dict]:
    trees = {"base": base, "head": ROOT}
    samples: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(rounds):
        order = ("base", "head") if rnd % 2 == 0 else ("head", "base")
        for side in order:
            for record in probe(trees[side], running, rnd):
                samples.setdefault((side, record["method"]), []).append(record)
    rows = []
    for method in ("off", "eagle", "dflash"):
        row: dict = {"method": method, "n_running": running}
        for side in trees:
            records = samples[(side, method)]
            for key in ("median_us", "schedule_median_us", "update_median_us"):
                row[f"{side}_{key}"] = round(statistics.median(r[key] for r in records), 1)
        for key in ("median_us", "schedule_median_us", "update_median_us"):
            row[f"ratio_{key}"] = round(row[f"head_{key}"] / row[f"base_{key}"], 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--running", type=int, default=256, help="running requests")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.running, args.rounds = 16, 2
    args.out = out_path(args, DEFAULT_OUT)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base],
                       cwd=ROOT, check=True)
        try:
            rows = compare(base, args.running, args.rounds)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=True)
    report = {"benchmark": "scheduler_ab", "base": args.base, "rounds": args.rounds,
              "steps_per_round": STEPS, "results": rows}
    write_report(args.out, report)
    for r in rows:
        print(f"{r['method']:<7} N={r['n_running']}: total {r['base_median_us']:.0f} -> "
              f"{r['head_median_us']:.0f} us ({r['ratio_median_us']:.2f}x); schedule "
              f"{r['ratio_schedule_median_us']:.2f}x, update {r['ratio_update_median_us']:.2f}x")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
