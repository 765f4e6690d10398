"""Work per running request per scheduler step, counted instead of timed.

Timings on this shared machine vary by up to 2x between repeats, too much to tell
whether a step's cost grows linearly in the running requests N. This replays the same
trace as benchmarks/scheduler_vs_vllm.py through our scheduler and counts the
function calls (Python and C) made inside `schedule()` and `update_from_output()` in
the steady steps (>= 90 % of N running), divided by the requests running: flat in N
means the work per step is linear in N.

    python benchmarks/scheduler_work.py [--running 64,256,1024] [--methods off,ngram,parallel]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks import sched_trace  # noqa: E402
from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.sched_trace import TraceConfig  # noqa: E402
from benchmarks.scheduler_vs_vllm import OursSide  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "scheduler_work.json"


class CallCounter:
    """Counts every call made while `counting` (a sys.setprofile hook)."""

    def __init__(self) -> None:
        self.calls = 0

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def count(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
        before = self.calls
        sys.setprofile(self._hook)
        try:
            result = fn(*args)
        finally:
            sys.setprofile(None)
        return result, self.calls - before


def calls_per_request(running: int, method: str, requests_per_running: int) -> dict:
    trace = sched_trace.make_trace(TraceConfig(running, num_requests=requests_per_running
                                               * running))
    side = OursSide(trace, method)
    counter = CallCounter()
    per_request: list[float] = []
    step = side.step

    def counted_step() -> sched_trace.TimedStep | None:
        sched = side.sched
        original_schedule, original_update = sched.schedule, sched.update_from_output
        counts = [0, 0]

        def schedule() -> Any:
            out, counts[0] = counter.count(original_schedule)
            return out

        def update(*args: Any) -> Any:
            result, counts[1] = counter.count(original_update, *args)
            return result

        sched.schedule, sched.update_from_output = schedule, update  # type: ignore[method-assign]
        try:
            record = step()
        finally:
            del sched.schedule, sched.update_from_output
        if record is not None and record.running >= 0.9 * running:
            per_request.append(sum(counts) / record.running)
        return record

    side.step = counted_step  # type: ignore[method-assign]
    sched_trace.replay(trace, side)
    return {"n_running": running, "method": method, "steady_steps": len(per_request),
            "calls_per_running_request": round(statistics.median(per_request), 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--running", default="64,256,1024")
    parser.add_argument("--methods", default="off,ngram,parallel")
    args = parser.parse_args(argv)
    sizes = [16] if args.quick else [int(n) for n in args.running.split(",")]
    rows = [calls_per_request(n, method, 2)
            for method in args.methods.split(",") for n in sizes]
    for row in rows:
        print(f"{row['method']:<9} N={row['n_running']:>5}: "
              f"{row['calls_per_running_request']:>7.2f} calls per running request per step")
    report = {"benchmark": "scheduler_work", "requests_per_running": 2, "results": rows}
    write_report(out_path(args, DEFAULT_OUT), report)
    return report


if __name__ == "__main__":
    main()
