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
outputs must be identical under every configuration and every round (greedy). Heads:
the trained default when the cache has one, else an untrained head (`"model":
"random"`, labelled) that keeps the passes' shapes but accepts nothing.

Each rule runs with a draft policy (`--configs rule:policy,...`): by default the three
rules with the goodput policy (each request's k chosen per step; a rule charges what it
charges for the chosen k: ours the rows it adds, the flat rule n + S whatever k is), and
ours with the fixed policy (k = K), the scheduler before goodput. Goodput decides from
measured step times, so its rounds may take different steps (reported, not hidden);
the fixed policy's must not.

    python benchmarks/throttle_e2e.py [--quick] [--rounds 3] [--methods dflash:8,...]
        [--configs ours:goodput,...] [--dtype auto]
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
from benchmarks.vllm_rules import (  # noqa: E402
    FlatChargeRule,
    StaticReservationRule,
    vllm_spec,
)
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.drafter import find_trained_head  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402
from scheduler import CacheConfig, Request, SamplingParams, Scheduler  # noqa: E402
from scheduler.budget import ThrottleRule  # noqa: E402
from spec_decode import SpeculativeConfig  # noqa: E402
from spec_decode.config import DRAFT_POLICIES  # noqa: E402
from spec_decode.methods import get_method  # noqa: E402
from training.data import code_windows  # noqa: E402
from training.prompts import instructions  # noqa: E402

RULES = ("ours", "vllm_flat", "vllm_static")
DEFAULT_CONFIGS = "ours:goodput,vllm_flat:goodput,vllm_static:goodput,ours:fixed"
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


def parse_configs(text: str) -> list[tuple[str, str]]:
    """"rule:policy,..." -> [(rule, policy)]; an unknown rule or policy is refused."""
    configs = []
    for item in text.split(","):
        rule, _, policy = item.partition(":")
        if rule not in RULES or policy not in DRAFT_POLICIES:
            raise ValueError(f"--configs: {item!r} is not rule:policy (rules: "
                             f"{', '.join(RULES)}; policies: {', '.join(DRAFT_POLICIES)})")
        configs.append((rule, policy))
    return configs


def run_rule(model: LlamaForCausalLM, spec: SpeculativeConfig, rule_name: str,
             prompts: list[list[int]], work: Workload, eos: int | None) -> dict:
    """One drained run with one rule (and the spec's draft policy); per-request outputs
    included for the check. vLLM's rules run with the drafter following every chunk."""
    if rule_name != "ours":
        spec = vllm_spec(spec)
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
    goodput = core.scheduler.stats.goodput
    return {
        "rule": rule_name, "draft_policy": spec.draft_policy, "status": "ok",
        "chosen_k": goodput.chosen_k, "share_steps_k0": goodput.share_steps_k0,
        "target_budget": core.scheduler.rule
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


def rotated(configs: list[tuple[str, str]], round_index: int) -> list[tuple[str, str]]:
    """The configurations' order in one round: each goes first, middle and last in
    turn, so a drift in this shared machine's speed does not favour one of them."""
    shift = round_index % len(configs)
    return configs[shift:] + configs[:shift]


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


def ratios(a: dict, b: dict) -> dict:
    """a ÷ b: output tokens/s (above 1: a faster) and steps to drain (below 1: a fewer)."""
    return {"tokens_per_s": round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3),
            "steps": round(a["steps"] / b["steps"], 3)}


def run_method(model: LlamaForCausalLM, model_path: Path, method: str, k: int,
               prompts: list[list[int]], work: Workload, eos: int | None,
               rounds: int = 3, configs: list[tuple[str, str]] | None = None) -> list[dict]:
    configs = configs or parse_configs(DEFAULT_CONFIGS)
    head = head_for(method, model_path)
    specs = {policy: SpeculativeConfig(method, k, model=head, draft_policy=policy)
             for policy in {policy for _, policy in configs}}
    warm = Workload(num_requests=1, burst=1, prompt_tokens=(8, 8), max_tokens=2,
                    budget=work.budget, max_num_seqs=work.max_num_seqs,
                    max_model_len=work.max_model_len)
    run_rule(model, specs[configs[0][1]], "ours", prompts[:1], warm, eos)  # first-call costs
    by_config: dict[tuple[str, str], list[dict]] = {config: [] for config in configs}
    for round_index in range(rounds):
        for rule, policy in rotated(configs, round_index):
            by_config[rule, policy].append(run_rule(model, specs[policy], rule, prompts,
                                                    work, eos))
    runs = {config: merge_rounds(by_config[config]) for config in configs}
    first = next(r for r in runs.values() if r["status"] == "ok")
    for (rule, policy), run in runs.items():
        run.update(method=method, k=k, rounds=rounds,
                   head="random" if head else "trained/default")
        if run["status"] != "ok":
            continue
        run["identical_outputs"] = run["outputs"] == first["outputs"]
        # The rule alone differs: ours ÷ this rule, under the same policy.
        ours = runs.get(("ours", policy))
        if rule != "ours" and ours is not None:
            run["ours_vs_this"] = ratios(ours, run)
        # The policy alone differs: this ÷ the same rule under the other policy.
        other = next((r for (ru, po), r in runs.items() if ru == rule and po != policy), None)
        if other is not None and other["status"] == "ok":
            run["vs_other_policy"] = {"policy": other["draft_policy"], **ratios(run, other)}
    for run in runs.values():
        run.pop("outputs", None)
    return list(runs.values())


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["method"], r["k"]) for r in rows}, key=str)
    configs = list(dict.fromkeys((r["rule"], r["draft_policy"]) for r in rows))
    width = 0.8 / len(configs)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("output_tokens_per_s", "ttft_p50_s", "steps"),
                              ("output tokens/s", "TTFT p50 (s)", "steps to drain"),
                              strict=True):
        for j, config in enumerate(configs):
            vals = [next((r.get(key, 0) for r in rows if (r["method"], r["k"]) == c
                          and (r["rule"], r["draft_policy"]) == config), 0) for c in cases]
            ax.bar(np.arange(len(cases)) + (j - (len(configs) - 1) / 2) * width, vals,
                   width=width, label=" ".join(config))
        ax.set_xticks(np.arange(len(cases)), [f"{m} K={k}" for m, k in cases])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--methods", default="dflash:8,parallel:4,draft_model:4")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per configuration, the order rotated each round")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="rule:draft_policy pairs to run")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto")
    args = parser.parse_args(argv)
    configs = parse_configs(args.configs)
    work = QUICK if args.quick else Workload()
    torch.manual_seed(0)
    path = resolve_model(None)
    dtype = RunnerConfig(dtype=args.dtype).torch_dtype
    model = load_model(path, dtype, torch.device("cpu"))
    tokenizer = Tokenizer.from_dir(path)
    prompts = make_prompts(tokenizer, work)
    rows = []
    for item in args.methods.split(","):
        method, k = item.split(":")
        for run in run_method(model, path, method, int(k), prompts, work,
                              tokenizer.eos_token_id, args.rounds, configs):
            rows.append(run)
            print({key: v for key, v in run.items() if key != "reason"}, flush=True)
    out = out_path(args, DEFAULT_OUT)
    report = {"benchmark": "throttle_e2e", "device": "cpu",
              "dtype": str(dtype).removeprefix("torch."),
              "workload": work.__dict__, "quick": args.quick, "results": rows}
    write_report(out, report)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
