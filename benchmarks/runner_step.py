"""Per-step time of the ModelRunner split into input preparation, forward and sampling.

Decode batches of 1, 8 and 32 requests and one 512-token prefill, on the default
model. Input preparation should be a small fraction of the step. `draft` cases: the
same decode with an EAGLE-3 head drafting K = 4 (a context pass and three one-row
steps), once with a reduced 8,192-token draft vocabulary and once with the target's
whole 49,152-token vocabulary, to show what the reduced LM head saves per draft step.

    python benchmarks/runner_step.py [--quick] [--device cpu|cuda] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import write_report  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.eagle3 import Eagle3Config, Eagle3Head, save_eagle3  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.model_runner import ModelRunner  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402
from spec_decode import SpeculativeConfig  # noqa: E402

BLOCK = 16
PHASES = ("prepare", "forward", "sample")


def _engine(model: LlamaForCausalLM, device: str, budget: int,
            spec: SpeculativeConfig | None = None) -> tuple[Scheduler, ModelRunner]:
    sched_cfg = SchedulerConfig(budget, 64, 2048)
    runner = ModelRunner(RunnerConfig(device=device), sched_cfg, BLOCK, spec, model=model)
    runner.initialize_kv_cache(1024)
    runner.record_timings = True
    return Scheduler(sched_cfg, CacheConfig(BLOCK, 1024), spec), runner


def _step(sched: Scheduler, runner: ModelRunner) -> dict[str, float]:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    drafts = sum(len(t) for t in out.scheduled_spec_decode_tokens.values())
    return {**runner.last_timings, "drafts": drafts}


def _summarise(samples: list[dict[str, float]]) -> dict[str, float]:
    row = {f"{p}_ms": round(1e3 * statistics.median(s[p] for s in samples), 3) for p in PHASES}
    total = sum(row[f"{p}_ms"] for p in PHASES)
    row["step_ms"] = round(total, 3)
    # Six digits: with four, a step slowed by a loaded machine reads a share of 0.
    row["prepare_fraction"] = round(row["prepare_ms"] / total, 6)
    return row


def bench_decode(model: LlamaForCausalLM, device: str, batch: int, steps: int,
                 spec: SpeculativeConfig | None = None, case: str = "decode") -> dict:
    sched, runner = _engine(model, device, 2048, spec)
    # Room for every step to emit K + 1 tokens: the k rule cuts k by the worst case
    # (all drafts accepted) near max_tokens, and a cut step would time fewer drafts.
    params = SamplingParams(max_tokens=8 * (steps + 2), ignore_eos=True)
    for i in range(batch):
        prompt = [(17 * i + j) % 49000 + 100 for j in range(32)]
        sched.add_request(Request(f"r{i}", prompt, params))
    _step(sched, runner)  # prefill all
    samples = [_step(sched, runner) for _ in range(steps)]
    timing = _summarise(samples)
    if spec is not None:
        # A step without drafts would time no drafting at all: refuse it rather than
        # report a drafting cost of nothing.
        if any(s["drafts"] == 0 for s in samples):
            raise RuntimeError(f"{case}: a timed step verified no drafts")
        draft = round(1e3 * statistics.median(s["draft"] for s in samples), 3)
        timing.update(draft_ms=draft, draft_fraction=round(draft / (timing["step_ms"] + draft), 4))
    return {"case": f"{case} x{batch}", "tokens_per_step": batch, **timing}


def bench_draft(model: LlamaForCausalLM, device: str, batch: int, steps: int,
                vocab: int, tmp: Path) -> dict:
    """Decode with an untrained EAGLE-3 head of this draft vocabulary drafting K = 4."""
    head_dir = tmp / f"head{vocab}"
    if not head_dir.exists():
        head = Eagle3Head(Eagle3Config.for_target(model.config, vocab), model, seed=0)
        save_eagle3(head, head_dir)
    # Fixed K: this times the cost of K = 4 drafts, which goodput would stop making
    # for an untrained head as soon as it sees them rejected.
    spec = SpeculativeConfig("eagle", 4, model=str(head_dir), draft_policy="fixed")
    return bench_decode(model, device, batch, steps, spec, f"draft V={vocab}")


def bench_prefill(model: LlamaForCausalLM, device: str, length: int, repeats: int) -> dict:
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
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in (8192, model.config.vocab_size):
            rows += [bench_draft(model, args.device, b, steps, vocab, Path(tmp))
                     for b in (1, 8)]
    report = {"benchmark": "runner_step", "device": args.device, "dtype": "float32",
              "threads": torch.get_num_threads(), "quick": args.quick, "results": rows}
    write_report(out_path, report)
    print(f"{'case':<14}{'prepare ms':>11}{'forward ms':>11}{'sample ms':>10}"
          f"{'step ms':>9}{'prep %':>8}")
    for row in rows:
        print(f"{row['case']:<18}{row['prepare_ms']:>11.2f}{row['forward_ms']:>11.1f}"
              f"{row['sample_ms']:>10.2f}{row['step_ms']:>9.1f}"
              f"{100 * row['prepare_fraction']:>7.2f}%"
              + (f"  draft {row['draft_ms']:.1f} ms" if "draft_ms" in row else ""))
    print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
