"""Per-step time of the ModelRunner split into input preparation, forward and sampling.

Decode batches of 1, 8 and 32 requests and one 512-token prefill, on the default
model. Input preparation should be a small fraction of the step.

    python benchmarks/runner_step.py [--quick] [--device cpu|cuda] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import write_report  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.model_runner import ModelRunner  # noqa: E402
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

BLOCK = 16
PHASES = ("prepare", "forward", "sample")


def _engine(model: torch.nn.Module, device: str, budget: int) -> tuple[Scheduler, ModelRunner]:
    sched_cfg = SchedulerConfig(budget, 64, 2048)
    runner = ModelRunner(RunnerConfig(device=device), sched_cfg, BLOCK, model=model)
    runner.initialize_kv_cache(1024)
    runner.record_timings = True
    return Scheduler(sched_cfg, CacheConfig(BLOCK, 1024)), runner


def _step(sched: Scheduler, runner: ModelRunner) -> dict[str, float]:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return dict(runner.last_timings)


def _summarise(samples: list[dict[str, float]]) -> dict[str, float]:
    row = {f"{p}_ms": round(1e3 * statistics.median(s[p] for s in samples), 3) for p in PHASES}
    total = sum(row[f"{p}_ms"] for p in PHASES)
    row["step_ms"] = round(total, 3)
    row["prepare_fraction"] = round(row["prepare_ms"] / total, 4)
    return row


def bench_decode(model: torch.nn.Module, device: str, batch: int, steps: int) -> dict:
    sched, runner = _engine(model, device, budget=2048)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = [(17 * i + j) % 49000 + 100 for j in range(32)]
        sched.add_request(Request(f"r{i}", prompt, params))
    _step(sched, runner)  # prefill all
    samples = [_step(sched, runner) for _ in range(steps)]
    return {"case": f"decode x{batch}", "tokens_per_step": batch, **_summarise(samples)}


def bench_prefill(model: torch.nn.Module, device: str, length: int, repeats: int) -> dict:
    samples = []
    for r in range(repeats):
        sched, runner = _engine(model, device, budget=length)
        prompt = [(31 * r + j) % 49000 + 100 for j in range(length)]
        sched.add_request(Request("p", prompt, SamplingParams(max_tokens=1)))
        samples.append(_step(sched, runner))
    return {"case": f"prefill {length}", "tokens_per_step": length, **_summarise(samples)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    default = "runner_step_quick.json" if args.quick else f"runner_step_{args.device}.json"
    out_path = args.out or ROOT / "benchmarks" / "results" / default
    steps, repeats = (2, 1) if args.quick else (10, 3)
    torch.manual_seed(0)
    model = load_model(resolve_model(None), torch.float32, torch.device(args.device))
    rows = [bench_decode(model, args.device, b, steps) for b in (1, 8, 32)]
    rows.append(bench_prefill(model, args.device, 128 if args.quick else 512, repeats))
    report = {"benchmark": "runner_step", "device": args.device, "dtype": "float32",
              "threads": torch.get_num_threads(), "quick": args.quick, "results": rows}
    write_report(out_path, report)
    print(f"{'case':<14}{'prepare ms':>11}{'forward ms':>11}{'sample ms':>10}"
          f"{'step ms':>9}{'prep %':>8}")
    for row in rows:
        print(f"{row['case']:<14}{row['prepare_ms']:>11.2f}{row['forward_ms']:>11.1f}"
              f"{row['sample_ms']:>10.2f}{row['step_ms']:>9.1f}"
              f"{100 * row['prepare_fraction']:>7.2f}%")
    print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
