"""How tight is the drafter-aware throttle? Our rule vs vLLM's two rules, one workload.

One replayed mixed workload (many requests decoding while long prompts keep arriving,
`engine.simulate`) runs through the same Scheduler with only its ThrottleRule swapped:
ours (DESIGN.md §2), vLLM's static reservation (#34898) and vLLM's flat per-request
charge (#51725), see `benchmarks/vllm_rules.py`. The SimulatedRunner really builds every
pass and asserts each one fits B, so the vLLM rules are checked for safety too.

Acceptance is random (seeded), so once two rules schedule differently their runs draw
different acceptances; each configuration is therefore run with several runner seeds,
the same seeds for every rule, and the per-step statistics are pooled over them.

    python benchmarks/throttle_tightness.py [--quick] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.vllm_rules import (  # noqa: E402
    FlatChargeRule,
    StaticReservationRule,
    per_request_reservation,
    vllm_spec,
)
from engine.simulate import WorkloadConfig, make_workload, run_simulation  # noqa: E402
from runner.simulated import SimulatedRunner  # noqa: E402
from scheduler import CacheConfig, ModelRunnerOutput, Scheduler, SchedulerConfig  # noqa: E402
from scheduler.budget import ThrottleRule  # noqa: E402
from scheduler.outputs import SchedulerOutput  # noqa: E402
from spec_decode import SpeculativeConfig  # noqa: E402

RULES = ("ours", "vllm_static", "vllm_flat")
ACCEPTANCE = 0.6
MAX_MODEL_LEN = 4096
# Ample KV: preemptions would mix the pool's limits into a comparison of throttles.
NUM_BLOCKS = 32768
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "throttle_tightness.json"


@dataclass(frozen=True)
class Grid:
    cases: tuple[tuple[str, int], ...]  # (method, K)
    budgets: tuple[int, ...]  # max_num_batched_tokens B
    max_num_seqs: tuple[int, ...]
    seeds: tuple[int, ...]  # SimulatedRunner seeds, the same for every rule
    workload: WorkloadConfig


FULL = Grid(
    cases=(("dflash", 4), ("pard", 4), ("parallel", 4), ("draft_model", 4), ("dflash", 8)),
    budgets=(2048, 512),
    max_num_seqs=(256, 128),
    seeds=(0, 1, 2),
    # A long prompt arrives every step while 256 requests decode: enough work that B,
    # not the longest request's decode, sets the drain time (throughput-bound).
    workload=WorkloadConfig(num_decoders=256, num_long=96, long_every=1),
)
QUICK = Grid(
    cases=(("dflash", 4), ("pard", 4)),
    budgets=(512,),
    max_num_seqs=(64,),
    seeds=(0,),
    # Throughput-bound like FULL, only smaller: with a few requests the longest one's
    # decode sets the drain time, and steps to drain measure acceptance luck, not B.
    workload=WorkloadConfig(num_decoders=64, num_long=16, long_prompt=(512, 1024),
                            long_every=1),
)


@dataclass
class StepLog:
    """Per-step rows of one run: the real target tokens, not what a rule charged."""

    target_limit: int  # the target budget the rule starts each step with
    target: list[int] = field(default_factory=list)
    drafter: list[int] = field(default_factory=list)
    max_built_target: int = 0
    max_built_drafter: int = 0
    # A rule's own target charge past its budget: must stay 0 (plan_chunk checks it).
    over_budget_steps: int = 0
    max_over_budget: int = 0

    def record(self, step: int, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        self.target.append(sum(out.num_scheduled_tokens.values()))
        self.drafter.append(out.num_drafter_tokens)
        built = result.pass_rows
        self.max_built_target = max(self.max_built_target, built.get("target", 0))
        drafter_built = [rows for name, rows in built.items() if name != "target"]
        self.max_built_drafter = max([self.max_built_drafter, *drafter_built])
        # The flat rule's n + S charge lives in pass_rows["target"]; see FlatChargeRule.
        over = out.pass_rows["target"] - self.target_limit
        if over > 0:
            self.over_budget_steps += 1
            self.max_over_budget = max(self.max_over_budget, over)


def make_rule(name: str, spec: SpeculativeConfig, max_num_seqs: int) -> ThrottleRule | None:
    """The rule to swap in; None lets the Scheduler build ours."""
    if name == "vllm_static":
        return StaticReservationRule(spec, MAX_MODEL_LEN, max_num_seqs)
    if name == "vllm_flat":
        return FlatChargeRule(spec, MAX_MODEL_LEN)
    return None


def run_seed(spec: SpeculativeConfig, budget: int, max_num_seqs: int, rule_name: str,
             workload: WorkloadConfig, seed: int) -> tuple[StepLog, int, int]:
    """One drained run: its step log, steps to drain and preemptions."""
    if rule_name != "ours":
        spec = vllm_spec(spec)
    scheduler = Scheduler(SchedulerConfig(budget, max_num_seqs, MAX_MODEL_LEN),
                          CacheConfig(num_blocks=NUM_BLOCKS), spec,
                          rule=make_rule(rule_name, spec, max_num_seqs))
    runner = SimulatedRunner(scheduler, acceptance=ACCEPTANCE, seed=seed)
    log = StepLog(scheduler.rule.initial_budget(budget)[0])
    result = run_simulation(scheduler, runner, make_workload(workload), on_step=log.record)
    return log, result.steps, result.num_preemptions


def run_config(method: str, k: int, budget: int, max_num_seqs: int, rule_name: str,
               workload: WorkloadConfig, seeds: tuple[int, ...]) -> dict:
    spec = SpeculativeConfig(method, k, draft_policy="fixed")  # K always, as vLLM's rules
    record: dict = {"method": method, "k": k, "max_num_batched_tokens": budget,
                    "max_num_seqs": max_num_seqs, "rule": rule_name,
                    "reservation_S": per_request_reservation(method, k)}
    rule = make_rule(rule_name, spec, max_num_seqs)
    reason = rule.cannot_start(budget) if isinstance(rule, StaticReservationRule) else None
    if reason:
        # It would schedule nothing, forever: report instead of spinning.
        return {**record, "status": "cannot_start", "reason": reason}
    start = time.perf_counter()
    logs, steps, preemptions = [], [], []
    for seed in seeds:
        log, num_steps, num_preempted = run_seed(spec, budget, max_num_seqs, rule_name,
                                                 workload, seed)
        logs.append(log)
        steps.append(num_steps)
        preemptions.append(num_preempted)
    return {**record, "status": "ok", **_pooled(logs, steps, preemptions),
            "wall_s": round(time.perf_counter() - start, 3)}


def _pooled(logs: list[StepLog], steps: list[int], preemptions: list[int]) -> dict:
    target = [rows for log in logs for rows in log.target]
    drafter = [rows for log in logs for rows in log.drafter]
    return {
        "target_budget": logs[0].target_limit,
        "steps_to_drain": statistics.fmean(steps),
        "steps_per_seed": steps,
        "target_tokens_per_step_mean": round(statistics.fmean(target), 2),
        "target_tokens_per_step_median": statistics.median(target),
        "drafter_rows_per_step_mean": round(statistics.fmean(drafter), 2),
        "preemptions": sum(preemptions),
        "max_target_rows_built": max(log.max_built_target for log in logs),
        "max_drafter_rows_built": max(log.max_built_drafter for log in logs),
        "over_budget_steps": sum(log.over_budget_steps for log in logs),
        "max_over_budget": max(log.max_over_budget for log in logs),
    }


def ratios(records: list[dict]) -> list[dict]:
    """Ours / each vLLM rule, per (method, K, B, max_num_seqs); None where one can't run."""
    key = ("method", "k", "max_num_batched_tokens", "max_num_seqs")
    ran = {(tuple(r[name] for name in key), r["rule"]): r
           for r in records if r["status"] == "ok"}
    out: list[dict] = []
    for (case, rule), ours in ran.items():
        if rule != "ours":
            continue
        row = dict(zip(key, case, strict=True))
        for other in RULES[1:]:
            theirs = ran.get((case, other))
            row[f"steps_ratio_vs_{other}"] = _ratio(ours, theirs, "steps_to_drain")
            row[f"tokens_per_step_ratio_vs_{other}"] = _ratio(
                ours, theirs, "target_tokens_per_step_mean")
        out.append(row)
    return out


def _ratio(ours: dict, theirs: dict | None, metric: str) -> float | None:
    return None if theirs is None else round(ours[metric] / theirs[metric], 3)


def print_summary(records: list[dict], ratio_rows: list[dict]) -> None:
    print(f"{'method':<12}{'K':>2}{'B':>6}{'seqs':>5}  {'rule':<12}{'steps':>8}"
          f"{'tgt/step':>10}{'median':>8}{'drafter':>9}{'preempt':>8}  note")
    for r in records:
        head = (f"{r['method']:<12}{r['k']:>2}{r['max_num_batched_tokens']:>6}"
                f"{r['max_num_seqs']:>5}  {r['rule']:<12}")
        if r["status"] != "ok":
            print(f"{head}{'-':>8}  cannot start: {r['reason']}")
            continue
        note = (f"over budget {r['over_budget_steps']} steps (max +{r['max_over_budget']})"
                if r["over_budget_steps"] else "")
        print(f"{head}{r['steps_to_drain']:>8.1f}{r['target_tokens_per_step_mean']:>10.1f}"
              f"{r['target_tokens_per_step_median']:>8.0f}{r['drafter_rows_per_step_mean']:>9.1f}"
              f"{r['preemptions']:>8}  {note}")
    print("\nours / vLLM  (steps < 1: ours drains sooner; tokens/step > 1: ours packs more)")
    for row in ratio_rows:
        cells = [f"{other}: steps {_fmt(row[f'steps_ratio_vs_{other}'])} "
                 f"tokens {_fmt(row[f'tokens_per_step_ratio_vs_{other}'])}"
                 for other in RULES[1:]]
        print(f"{row['method']:<12}K={row['k']} B={row['max_num_batched_tokens']:<5}"
              f"seqs={row['max_num_seqs']:<4} " + " | ".join(cells))


def _fmt(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else FULL
    args.out = out_path(args, DEFAULT_OUT)
    records = [run_config(method, k, budget, seqs, rule, grid.workload, grid.seeds)
               for method, k in grid.cases for budget in grid.budgets
               for seqs in grid.max_num_seqs for rule in RULES]
    ratio_rows = ratios(records)
    report = {
        "benchmark": "throttle_tightness",
        "quick": args.quick,
        "acceptance": ACCEPTANCE,
        "max_model_len": MAX_MODEL_LEN,
        "num_blocks": NUM_BLOCKS,
        "seeds": list(grid.seeds),
        "workload": asdict(grid.workload),
        "results": records,
        "ratios_ours_over_vllm": ratio_rows,
    }
    write_report(args.out, report)
    print_summary(records, ratio_rows)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
