"""The throttle on the real model: ours against vLLM's two drafter-budget rules.

The default model serves one saturated workload three times per method, with only the
scheduler's rule swapped (benchmarks/vllm_rules.py): ours (each request charged the
rows it really adds to every pass), vLLM's flat n + S charge (#51725) and vLLM's
static reservation B - S * max_num_seqs (#34898). Long prompts (a held-out
instruction about a code excerpt, 150-600 tokens) arrive while earlier requests
decode, with B small enough (256) that the drafter's passes bind.

Arrivals are counted in engine steps, not seconds, so every rule sees the same
workload and the same decisions whatever this shared machine's speed; timings are
wall-clock, each rule run `--rounds` times with the order rotated every round (the
median round is reported, every round listed). Per rule: output tokens/s, TTFT
p50/p99 (from a request's arrival step), steps, target and drafter rows per step;
outputs must be identical under all three rules and every round (greedy). Heads: the
trained default when the cache has one, else an untrained head (`"model": "random"`,
labelled) that keeps the passes' shapes but accepts nothing.

    python benchmarks/throttle_e2e.py [--quick] [--rounds 3] [--methods dflash:8,...]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.vllm_rules import FlatChargeRule, StaticReservationRule  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from runner.drafter import find_trained_head  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402
from scheduler import CacheConfig, Request, SamplingParams, Scheduler  # noqa: E402
from scheduler.budget import ThrottleRule  # noqa: E402
from spec_decode import SpeculativeConfig  # noqa: E402
from spec_decode.methods import get_method  # noqa: E402
from training.data import code_windows  # noqa: E402
from training.prompts import instructions  # noqa: E402

RULES = ("ours", "vllm_flat", "vllm_static")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "throttle_e2e.json"


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    burst: int = 12  # arrive at step 0; the rest one every `every` steps
    every: int = 3
    prompt_tokens: tuple[int, int] = (150, 600)  # code excerpt length range
    max_tokens: int = 64
    budget: int = 256
    max_num_seqs: int = 16
    max_model_len: int = 1024


QUICK = Workload(num_requests=3, burst=2, every=2, prompt_tokens=(24, 48), max_tokens=4,
                 budget=64, max_num_seqs=4, max_model_len=256)


def make_prompts(tokenizer: Tokenizer, work: Workload, seed: int = 0) -> list[list[int]]:
    """Chat-templated requests: a held-out instruction about a held-out code excerpt."""
    rng = np.random.default_rng(seed)
    lo, hi = work.prompt_tokens
    code = code_windows(tokenizer, hi, work.num_requests, "eval")
    asks = instructions("eval")
    prompts = []
    for i in range(work.num_requests):
        length = int(rng.integers(lo, hi + 1))
        excerpt = tokenizer.decode(code[i % len(code)][:length].tolist())
        message = f"Here is some Python code:\n\n{excerpt}\n\n{asks[i % len(asks)]}"
        chat = tokenizer.apply_chat_template([{"role": "user", "content": message}])
        prompts.append(tokenizer.encode(chat))
    return prompts


def make_rule(name: str, spec: SpeculativeConfig, work: Workload) -> ThrottleRule | None:
    if name == "vllm_static":
        return StaticReservationRule(spec, work.max_model_len, work.max_num_seqs)
    if name == "vllm_flat":
        return FlatChargeRule(spec, work.max_model_len)
    return None  # the Scheduler builds ours


def head_for(method: str, model_path: Path) -> str | None:
    """The speculative config's "model": the trained head if cached, else random."""
    if get_method(method).drafter != "head":
        return None
    return None if find_trained_head(model_path, method) else "random"


def run_rule(model: LlamaForCausalLM, spec: SpeculativeConfig, rule_name: str,
             prompts: list[list[int]], work: Workload, eos: int | None) -> dict:
    """One drained run with one rule; per-request outputs included for the check."""
    config = EngineConfig(max_num_batched_tokens=work.budget, max_num_seqs=work.max_num_seqs,
                          max_model_len=work.max_model_len, speculative_config=spec,
                          num_kv_blocks=work.max_num_seqs * work.max_model_len // 16 + 16)
    core = EngineCore(config, model=model)
    rule = make_rule(rule_name, spec, work)
    if isinstance(rule, StaticReservationRule) and rule.cannot_start(work.budget):
        return {"rule": rule_name, "status": "cannot_start",
                "reason": rule.cannot_start(work.budget)}
    core.scheduler = Scheduler(config.scheduler_config(),
                               CacheConfig(config.block_size, config.num_kv_blocks or 0,
                                           config.enable_prefix_caching), spec, rule=rule)
    target_rows: list[int] = []
    drafter_rows: list[int] = []
    schedule = core.scheduler.schedule

    def logged_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        target_rows.append(sum(out.num_scheduled_tokens.values()))  # real, not charged
        drafter_rows.append(out.num_drafter_tokens)
        return out

    core.scheduler.schedule = logged_schedule  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=work.max_tokens)
    arrival_step = [0 if i < work.burst else (i - work.burst + 1) * work.every
                    for i in range(len(prompts))]
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    start = time.perf_counter()
    while step == 0 or core.has_unfinished_requests() or len(arrived) < len(prompts):
        for i, due in enumerate(arrival_step):
            if due == step:
                core.add_request(Request(str(i), prompts[i], params, eos_token_id=eos))
                arrived[str(i)] = time.perf_counter()
        for out in core.step() if core.has_unfinished_requests() else []:
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - arrived[out.request_id]
            outputs[out.request_id] += out.new_token_ids
        step += 1
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs.values())
    ttfts = sorted(ttft.values())
    return {
        "rule": rule_name, "status": "ok", "target_budget": core.scheduler.rule
        .initial_budget(work.budget)[0], "seconds": round(seconds, 2),
        "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(float(np.percentile(ttfts, 99)), 3),
        "steps": len(target_rows),
        "target_rows_per_step": round(statistics.fmean(target_rows), 1),
        "drafter_rows_per_step": round(statistics.fmean(drafter_rows), 1),
        "preemptions": core.scheduler.stats.num_preemptions,
        "outputs": outputs,
    }


def rotated(round_index: int) -> tuple[str, ...]:
    """The rules' order in one round: each rule goes first, middle and last in turn,
    so a drift in this shared machine's speed does not favour one rule."""
    shift = round_index % len(RULES)
    return RULES[shift:] + RULES[:shift]


def merge_rounds(runs: list[dict]) -> dict:
    """One rule's rounds as one row: the decisions (steps, rows, outputs) must not
    differ between rounds; timings are the median round, with every round listed."""
    first = dict(runs[0])
    if first["status"] != "ok":
        return first
    for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "seconds"):
        first[key] = round(statistics.median(r[key] for r in runs), 3)
    first["rounds_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    first["same_decisions_every_round"] = all(
        (r["steps"], r["outputs"]) == (runs[0]["steps"], runs[0]["outputs"]) for r in runs)
    return first


def run_method(model: LlamaForCausalLM, model_path: Path, method: str, k: int,
               prompts: list[list[int]], work: Workload, eos: int | None,
               rounds: int = 3) -> list[dict]:
    head = head_for(method, model_path)
    spec = SpeculativeConfig(method, k, model=head)
    warm = Workload(num_requests=1, burst=1, prompt_tokens=(8, 8), max_tokens=2,
                    budget=work.budget, max_num_seqs=work.max_num_seqs,
                    max_model_len=work.max_model_len)
    run_rule(model, spec, "ours", prompts[:1], warm, eos)  # first-call costs, left out
    by_rule: dict[str, list[dict]] = {rule: [] for rule in RULES}
    for round_index in range(rounds):
        for rule in rotated(round_index):
            by_rule[rule].append(run_rule(model, spec, rule, prompts, work, eos))
    runs = [merge_rounds(by_rule[rule]) for rule in RULES]
    ok = [r for r in runs if r["status"] == "ok"]
    ours = ok[0]
    for run in runs:
        run.update(method=method, k=k, rounds=rounds,
                   head="random" if head else "trained/default")
        if run["status"] != "ok":
            continue
        run["identical_outputs"] = run["outputs"] == ours["outputs"]
        run["ours_tokens_per_s_ratio"] = round(
            ours["output_tokens_per_s"] / run["output_tokens_per_s"], 3)
        run["ours_steps_ratio"] = round(ours["steps"] / run["steps"], 3)
    for run in ok:
        del run["outputs"]
    return runs


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["method"], r["k"]) for r in rows}, key=str)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("output_tokens_per_s", "ttft_p50_s", "steps"),
                              ("output tokens/s", "TTFT p50 (s)", "steps to drain"),
                              strict=True):
        for j, rule in enumerate(RULES):
            vals = [next((r.get(key, 0) for r in rows if (r["method"], r["k"]) == c
                          and r["rule"] == rule), 0) for c in cases]
            ax.bar(np.arange(len(cases)) + (j - 1) * 0.27, vals, width=0.27, label=rule)
        ax.set_xticks(np.arange(len(cases)), [f"{m} K={k}" for m, k in cases])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--methods", default="dflash:8,parallel:4,draft_model:4")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per rule, the order rotated each round")
    args = parser.parse_args(argv)
    work = QUICK if args.quick else Workload()
    torch.manual_seed(0)
    path = resolve_model(None)
    model = load_model(path, torch.float32, torch.device("cpu"))
    tokenizer = Tokenizer.from_dir(path)
    prompts = make_prompts(tokenizer, work)
    rows = []
    for item in args.methods.split(","):
        method, k = item.split(":")
        for run in run_method(model, path, method, int(k), prompts, work,
                              tokenizer.eos_token_id, args.rounds):
            rows.append(run)
            print({key: v for key, v in run.items() if key != "reason"}, flush=True)
    out = out_path(args, DEFAULT_OUT)
    report = {"benchmark": "throttle_e2e", "device": "cpu", "dtype": "float32",
              "workload": work.__dict__, "quick": args.quick, "results": rows}
    write_report(out, report)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
