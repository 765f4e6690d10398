"""Goodput against every fixed K on a simulated clock, under each step-time prior.

No model: the scheduler and a seeded SimulatedRunner, timed by a deterministic clock
(`engine.simulate.synthetic_step_time`). The default clock is a GPU's as measured on an
H200 (README): a target pass 12 ms whatever its rows, a drafter pass 1.3 ms, 5 us a
row. Each cell serves 2 x N requests (64 tokens each) N at a time, each draft accepted
with the method's rate, for several seeds; the figure is simulated output tokens per
simulated second, goodput's over speculation off's and over the best fixed K's of the
same seed, under the CPU's prior and the GPU's (`GoodputSettings.step_prior`).

    python benchmarks/goodput_clock.py [--quick] [--out PATH]
        [--target-pass 0.012] [--drafter-pass 0.0013] [--row 0.000005]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from engine.simulate import synthetic_step_time  # noqa: E402
from runner.simulated import SimulatedRunner  # noqa: E402
from scheduler import (  # noqa: E402
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.config import STEP_PRIORS, GoodputSettings  # noqa: E402
from spec_decode import SpeculativeConfig  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "goodput_clock.json"
# Each method's acceptance per reached draft: near what its trained head or lookup
# serves on held-out chat (README), so the fixed K that wins differs by method.
ACCEPTANCE = {"eagle": 0.42, "ngram": 0.3, "dflash": 0.35}
FIXED_K = (1, 2, 4)
MAX_TOKENS = 64


def serve(method: str | None, policy: str, k: int, running: int, acceptance: float,
          seed: int, prior: str, clock: object) -> float:
    """Simulated output tokens per simulated second of one configuration."""
    spec = SpeculativeConfig(method, k, draft_policy=policy) if method else None
    scheduler = Scheduler(SchedulerConfig(512, running, 1024), CacheConfig(16, 4096), spec,
                          goodput=GoodputSettings(step_prior=prior))
    runner = SimulatedRunner(scheduler, acceptance=acceptance, seed=seed,
                             step_time=clock)  # type: ignore[arg-type]
    for i in range(2 * running):
        prompt = [10 + (i * 31 + j) % 500 for j in range(30 + (i * 7) % 40)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True), eos_token_id=2))
    seconds = 0.0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        result = runner.execute(out)
        scheduler.update_from_output(out, result)
        seconds += result.step_seconds or 0.0
    return 2 * running * MAX_TOKENS / seconds


def cell(method: str, running: int, seeds: range, clock: object) -> dict:
    """Goodput (K <= 4) over off and over the best fixed K, per seed, by prior."""
    acceptance = ACCEPTANCE[method]
    by_prior: dict[str, dict[str, list[float]]] = {
        p: {"over_off": [], "over_best_fixed": []} for p in STEP_PRIORS}
    best_fixed = []
    for seed in seeds:
        off = serve(None, "fixed", 1, running, acceptance, seed, "cpu", clock)
        fixed = {k: serve(method, "fixed", k, running, acceptance, seed, "cpu", clock) / off
                 for k in FIXED_K}
        best = max(fixed.values())
        best_fixed.append(best)
        for prior in STEP_PRIORS:
            got = serve(method, "goodput", max(FIXED_K), running, acceptance, seed, prior,
                        clock) / off
            by_prior[prior]["over_off"].append(round(got, 4))
            by_prior[prior]["over_best_fixed"].append(round(got / best, 4))
    return {"method": method, "running": running, "acceptance": acceptance,
            "best_fixed_over_off": [round(b, 4) for b in best_fixed],
            "goodput": {p: {**v, "mean_over_best_fixed": round(
                statistics.fmean(v["over_best_fixed"]), 3)} for p, v in by_prior.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--target-pass", type=float, default=0.012)
    parser.add_argument("--drafter-pass", type=float, default=0.0013)
    parser.add_argument("--row", type=float, default=0.000005)
    args = parser.parse_args(argv)
    for option in ("target_pass", "drafter_pass", "row"):
        if not getattr(args, option) >= 0.0:
            parser.error(f"--{option.replace('_', '-')} must be >= 0 seconds, "
                         f"got {getattr(args, option)}")
    clock = synthetic_step_time(args.target_pass, args.row, args.drafter_pass)
    seeds = range(2 if args.quick else 6)
    grid = ([("eagle", 4)] if args.quick else
            [(m, n) for m in ACCEPTANCE for n in (1, 4, 16)])
    cells = [cell(method, running, seeds, clock) for method, running in grid]
    for c in cells:
        means = "  ".join(f"{p} prior {v['mean_over_best_fixed']:.3f}"
                          for p, v in c["goodput"].items())
        print(f"{c['method']:7s} N={c['running']:3d}  goodput / best fixed K: {means}")
    report = {"benchmark": "goodput_clock", "quick": args.quick,
              "clock": {"target_pass_s": args.target_pass, "drafter_pass_s": args.drafter_pass,
                        "row_s": args.row},
              "seeds": len(seeds), "max_tokens": MAX_TOKENS, "fixed_k": list(FIXED_K),
              "cells": cells}
    path = out_path(args, DEFAULT_OUT)
    write_report(path, report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
