"""Our scheduler against vLLM 0.33's real scheduler, side by side on one replayed trace.

The same seeded trace (benchmarks/sched_trace.py: a burst, arrivals above the drain
rate, lognormal prompts, shared prefixes, 1 % at max_model_len, per-request acceptance)
runs through our `scheduler.Scheduler` here and through vLLM's
`vllm.v1.core.sched.scheduler.Scheduler` in .vllm-venv (benchmarks/vllm_sched_driver.py,
a subprocess), at N running requests (max_num_seqs = N, B = 16 N, K = 4) for spec off,
ngram and parallel. Rounds alternate (ours, vLLM, vLLM, ours, ...) so machine drift
lands on both sides; timings are the median over rounds. Only schedule() +
update_from_output() are timed; the fake runners are not. Both sides must emit the
same tokens (`outputs_match`): the trace alone decides what the "model" does.

    bash ../shared/tools/vllm-scheduler-venv.sh      # once: builds ./.vllm-venv
    python benchmarks/scheduler_vs_vllm.py [--quick] [--running 64,256,1024]
        [--methods off,ngram,parallel] [--rounds 2] [--ours-only] [--baseline REV]
        [--policy fcfs|priority] [--no-gc] [--out PATH]

`--baseline REV` adds a third side, "before": our scheduler as of git revision REV
(checked out into a temporary worktree and run in a subprocess on the same trace), so
one run gives the before/after table.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks import sched_trace  # noqa: E402
from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.sched_trace import (  # noqa: E402
    OutputLog,
    TimedStep,
    Trace,
    TraceConfig,
    TraceRequest,
    timed,
)
from scheduler import (  # noqa: E402
    CacheConfig,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from spec_decode import SpeculativeConfig  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "scheduler_vs_vllm.json"
VENV_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
DRIVER = ROOT / "benchmarks" / "vllm_sched_driver.py"
BUILD_HINT = ("vLLM's venv is missing: build it with `bash ../shared/tools/"
              "vllm-scheduler-venv.sh` in the repo root (about two minutes), or pass "
              "--ours-only")
METHODS = ("off", "ngram", "parallel")
FULL_RUNNING, QUICK_RUNNING = (64, 256, 1024), (16,)
# Runs inside the baseline worktree (cwd), with that revision's packages first on the path.
BASELINE_SNIPPET = (
    "import json, sys; sys.path.insert(0, '.'); import scheduler;"
    "from benchmarks.sched_trace import Trace;"
    "from benchmarks.scheduler_vs_vllm import run_ours;"
    "report = run_ours(Trace.load(sys.argv[1]), sys.argv[2].split(','));"
    "report['scheduler_file'] = scheduler.__file__; print(json.dumps(report))"
)
# Timing fields taken as the median over rounds; the rest must agree across rounds.
TIMINGS = ("us_per_step", "us_per_step_all", "schedule_us", "update_us",
           "draft_update_us", "us_per_step_with_draft_update")


def speculative_config(method: str, k: int) -> SpeculativeConfig | None:
    """K drafts per step for every request, as vLLM's side proposes ("fixed"): the two
    schedulers must decide alike for their costs to compare."""
    if method == "off":
        return None
    if method == "ngram":  # the prompt-lookup range vLLM's side is given too
        return SpeculativeConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=4,
                                 draft_policy="fixed")
    return SpeculativeConfig(method, k, draft_policy="fixed")


class OursSide:
    """Our scheduler, with a fake runner that answers from the trace (sched_trace.Side)."""

    def __init__(self, trace: Trace, method: str, policy: str = "fcfs") -> None:
        cfg = trace.config
        self.policy = policy
        self.sched = Scheduler(
            SchedulerConfig(trace.max_num_batched_tokens, trace.max_num_seqs,
                            cfg.max_model_len, enable_chunked_prefill=True, policy=policy),
            CacheConfig(block_size=cfg.block_size, num_blocks=trace.num_blocks,
                        enable_prefix_caching=True),
            speculative_config(method, cfg.num_spec_tokens))
        self.trace_reqs: dict[str, TraceRequest] = {}
        self.log = OutputLog()

    def add(self, req: TraceRequest) -> None:
        self.trace_reqs[req.request_id] = req
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        priority = req.priority() if self.policy == "priority" else 0
        self.sched.add_request(Request(req.request_id, req.prompt_token_ids, params,
                                       priority=priority, arrival_time=float(req.arrival_step)))

    def num_unfinished(self) -> int:
        return len(self.sched.requests)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Tokens per the trace; the k drafts the scheduler asked each request for."""
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        drafts: dict[str, list[int]] = {}
        for rid in req_ids:
            request, behaviour = self.sched.requests[rid], self.trace_reqs[rid]
            # schedule() already advanced num_computed_tokens by the chunk.
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            verified = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            tokens = behaviour.emitted(request.num_output_tokens, verified)
            sampled.append(tokens)
            k = out.num_draft_tokens.get(rid, 0)
            if k:
                drafts[rid] = behaviour.drafts(request.num_output_tokens + len(tokens), k)
        return ModelRunnerOutput(req_ids, sampled, drafts)

    def step(self) -> TimedStep | None:
        out, schedule_us = timed(self.sched.schedule)
        if out.total_num_scheduled_tokens == 0:
            return None
        running = len(self.sched.running)
        result = self._execute(out)
        outputs, update_us = timed(self.sched.update_from_output, out, result)
        for output in outputs:
            self.log.add(output.request_id, output.new_token_ids)
        return TimedStep(schedule_us, update_us, 0.0, out.total_num_scheduled_tokens,
                          out.num_drafter_tokens, running)


def run_ours(trace: Trace, methods: list[str], policy: str = "fcfs",
             collector: bool = True) -> dict:
    results = []
    for method in methods:
        side = OursSide(trace, method, policy)
        records = sched_trace.replay(trace, side, collector=collector)
        results.append({"method": method, **sched_trace.summarize(trace, records, side.log)})
    return {"side": "ours", "trace_fingerprint": trace.fingerprint(), "results": results}


def _check_fingerprint(report: dict, fingerprint: str, side: str) -> dict:
    if report["trace_fingerprint"] != fingerprint:
        raise RuntimeError(f"{side}'s side replayed a different trace "
                           f"({report['trace_fingerprint']} != {fingerprint})")
    return report


def run_vllm(trace_path: Path, methods: list[str], fingerprint: str, policy: str,
             collector: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        proc = subprocess.run([str(VENV_PYTHON), str(DRIVER), "--trace", str(trace_path),
                               "--methods", ",".join(methods), "--policy", policy,
                               "--out", str(out), *([] if collector else ["--no-gc"])],
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        report = json.loads(out.read_text())
    return _check_fingerprint(report, fingerprint, "vLLM")


@contextmanager
def baseline_worktree(rev: str) -> Iterator[Path]:
    """Revision `rev` of this repo checked out in a temporary worktree."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                           capture_output=True)


def run_baseline(worktree: Path, trace_path: Path, methods: list[str],
                 fingerprint: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", BASELINE_SNIPPET, str(trace_path),
                           ",".join(methods)], cwd=worktree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline side failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout.splitlines()[-1])
    if not Path(report["scheduler_file"]).is_relative_to(worktree.resolve()):
        raise RuntimeError(f"baseline imported {report['scheduler_file']}, not the worktree's")
    return _check_fingerprint(report, fingerprint, "baseline")


def merge_rounds(rounds: list[dict]) -> dict:
    """One side's results over rounds: timings by median, the rest from round 0,
    checked equal in every round (the replay is deterministic)."""
    merged = dict(rounds[0])
    for key in TIMINGS:
        merged[key] = {stat: round(statistics.median(r[key][stat] for r in rounds), 1)
                       for stat in ("median", "p10", "p90")}
    for r in rounds[1:]:
        if r["outputs_digest"] != merged["outputs_digest"] or \
                r["steps_to_drain"] != merged["steps_to_drain"]:
            raise RuntimeError(f"{r['method']}: a round replayed differently")
    merged["round_medians_us"] = [r["us_per_step"]["median"] for r in rounds]
    return merged


def measure_point(running: int, methods: list[str], rounds: int, seed: int, sides: list[str],
                  num_requests: int, baseline: Path | None, policy: str,
                  collector: bool) -> dict[str, dict[str, list[dict]]]:
    """Per side, per method, one result per round; the side that goes first rotates
    round by round, so machine drift lands on every side."""
    trace = sched_trace.make_trace(TraceConfig(running, seed=seed, num_requests=num_requests))
    fingerprint = trace.fingerprint()
    samples: dict[str, dict[str, list[dict]]] = {side: {} for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        trace.save(trace_path)
        for rnd in range(rounds):
            for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                if side == "ours":
                    report = run_ours(trace, methods, policy, collector)
                elif side == "vllm":
                    report = run_vllm(trace_path, methods, fingerprint, policy, collector)
                else:
                    assert baseline is not None
                    report = run_baseline(baseline, trace_path, methods, fingerprint)
                for result in report["results"]:
                    samples[side].setdefault(result["method"], []).append(result)
    return samples


def compare(running: int, method: str, results: dict[str, dict]) -> dict:
    """One table row: every side's figures, ours against vLLM and against before."""
    row: dict = {"n_running": running, "method": method}
    for side, result in results.items():
        row[f"{side}_us_per_step"] = result["us_per_step"]["median"]
        for key in ("steps_to_drain", "tokens_per_step", "drafter_rows_per_step",
                    "output_tokens_per_step", "total_ms"):
            row[f"{side}_{key}"] = result[key]
    ours = results["ours"]
    if "vllm" in results:
        vllm = results["vllm"]
        row["vllm_draft_update_us"] = vllm["draft_update_us"]["median"]
        row["ratio"] = round(row["ours_us_per_step"] / row["vllm_us_per_step"], 3)
        row["ratio_with_draft_update"] = round(
            row["ours_us_per_step"] / vllm["us_per_step_with_draft_update"]["median"], 3)
        row["outputs_match"] = ours["outputs_digest"] == vllm["outputs_digest"]
    if "before" in results:
        before = results["before"]
        row["before_ratio"] = round(row["before_us_per_step"] / row["vllm_us_per_step"], 3) \
            if "vllm" in results else None
        row["speedup"] = round(row["before_us_per_step"] / row["ours_us_per_step"], 2)
        row["same_as_before"] = ours["outputs_digest"] == before["outputs_digest"] and \
            ours["steps_to_drain"] == before["steps_to_drain"]
    return row


def scaling(rows: list[dict]) -> dict[str, dict]:
    """Per side and method, µs per step against N, and the log-log slope of that curve
    from the smallest N to the largest: 1 is linear, below 1 better than linear."""
    curves: dict[str, dict] = {}
    for key in ("ours", "vllm", "before"):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = [(r["n_running"], r[f"{key}_us_per_step"]) for r in rows
                      if r["method"] == method and f"{key}_us_per_step" in r]
            if len(points) < 2:
                continue
            (n0, us0), (n1, us1) = points[0], points[-1]
            curves.setdefault(key, {})[method] = {
                "points": points,
                "us_per_running_request": [round(us / n, 2) for n, us in points],
                "loglog_slope": round(math.log(us1 / us0) / math.log(n1 / n0), 3)}
    return curves


def _pair(row: dict, key: str, fmt: str = ".1f") -> str:
    """"ours/vllm" for one field of a result row."""
    return f"{row[f'ours_{key}']:{fmt}}/{row.get(f'vllm_{key}', float('nan')):{fmt}}"


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"{'N':>5} {'method':<9}{'before us':>10}{'ours us':>9}{'vllm us':>9}{'ratio':>7}"
          f"{'before':>7}{'steps o/v':>12}{'tok/step o/v':>15}{'drafter o/v':>15}"
          f"{'same out':>9}")
    for r in rows:
        before_ratio = r.get("before_ratio")
        print(f"{r['n_running']:>5} {r['method']:<9}{r.get('before_us_per_step', nan):>10.1f}"
              f"{r['ours_us_per_step']:>9.1f}{r.get('vllm_us_per_step', nan):>9.1f}"
              f"{r.get('ratio', nan):>7.2f}{nan if before_ratio is None else before_ratio:>7.2f}"
              f"{_pair(r, 'steps_to_drain', '.0f'):>12}"
              f"{_pair(r, 'tokens_per_step'):>15}{_pair(r, 'drafter_rows_per_step'):>15}"
              f"{r.get('outputs_match', '-')!s:>9}")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--running", default=None,
                        help="running requests N, comma-separated (default 64,256,1024)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per side (default 2; --quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs",
                        help="both sides' policy (priority: each request 0-3 from its seed)")
    parser.add_argument("--no-gc", action="store_true",
                        help="Python's cyclic GC off during every side's replay")
    parser.add_argument("--ours-only", action="store_true", help="skip vLLM's side")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="add our scheduler as of git revision REV (fcfs only)")
    args = parser.parse_args(argv)
    if not args.ours_only and not VENV_PYTHON.exists():
        raise SystemExit(BUILD_HINT)
    if args.baseline and (args.policy != "fcfs" or args.no_gc):
        raise SystemExit("--baseline runs the old revision's own side (fcfs, GC on): "
                         "drop --policy and --no-gc")
    sizes = (tuple(int(n) for n in args.running.split(",")) if args.running
             else QUICK_RUNNING if args.quick else FULL_RUNNING)
    rounds = args.rounds or (1 if args.quick else 2)
    num_requests_per_running = 2 if args.quick else 4
    methods = args.methods.split(",")
    sides = ["ours"] + ([] if args.ours_only else ["vllm"]) + (["before"] if args.baseline else [])
    rows, detail = [], []
    with ExitStack() as stack:
        baseline = stack.enter_context(baseline_worktree(args.baseline)) \
            if args.baseline else None
        for running in sizes:
            samples = measure_point(running, methods, rounds, args.seed, sides,
                                    num_requests_per_running * running, baseline, args.policy,
                                    not args.no_gc)
            for method in methods:
                results = {side: merge_rounds(samples[side][method]) for side in sides}
                rows.append(compare(running, method, results))
                detail.append({"n_running": running, "method": method, **results})
    report = {
        "benchmark": "scheduler_vs_vllm", "quick": args.quick, "seed": args.seed,
        "rounds": rounds, "requests_per_running": num_requests_per_running,
        "policy": args.policy, "baseline": args.baseline, "gc": not args.no_gc,
        "timed": "schedule() + update_from_output() per step, median over steps with "
                 ">= 90% of N running, then over rounds; vLLM's update_draft_token_ids "
                 "apart (ratio_with_draft_update adds it)",
        "trace": {k: v for k, v in vars(TraceConfig(0)).items() if k != "num_running"},
        "python": platform.python_version(), "machine": platform.machine(),
        "results": rows, "scaling": scaling(rows), "detail": detail,
    }
    args.out = out_path(args, DEFAULT_OUT)
    write_report(args.out, report)
    print_table(rows)
    for side, curves in report["scaling"].items():
        for method, curve in curves.items():
            print(f"{side} {method}: us per running request {curve['us_per_running_request']}"
                  f", log-log slope {curve['loglog_slope']}")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
