"""Tokens per second with speculation off and with each method, on the default model.

Two workloads: input-grounded (edit / rewrite text whose answer repeats the input,
where lookup drafters shine) and open-ended. Concurrency 1 and 16 (at most that many
requests running at once; at least 8 requests per run, so concurrency 1 serves 8
requests one after another). For each run:
output tokens per second, the ratio against speculation off from the same run, the
acceptance figures, and the theoretical tokens per step (1 - a^(k+1)) / (1 - a) for
the measured per-draft acceptance a. Requests go through the chat template and stop at
EOS or max_tokens; a warm-up request runs first and is left out of every figure.
Heads (eagle, mtp, parallel, dflash) run as trained by `specbudget train-drafter`
when the model cache has one (`head: trained`); each also runs once with an untrained
head (`"model": "random"`, `head: random`), a labelled lower bound: it accepts
nothing, so it shows the cost of drafting inside the budget. A third workload,
`held-out`, asks the instructions that drafter training keeps out of its data. With
`--serve-first`, each engine first serves as many training-split instructions, left out
of every figure: the goodput policy is measured as a running server has it, its
estimates learnt, rather than from a fresh engine's prior.

    python benchmarks/spec_decode.py [--quick] [--methods ngram,suffix,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import write_report  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.stepwise import run_side_by_side  # noqa: E402
from runner.drafter import find_trained_head  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402
from scheduler import SamplingParams  # noqa: E402
from spec_decode import METHODS  # noqa: E402
from spec_decode.methods import get_method  # noqa: E402
from training.prompts import instructions  # noqa: E402

# Chat requests to the instruct model. Grounded: the answer repeats the input (edit,
# rewrite, fix), where lookup drafters find their drafts. Open: nothing to copy.
GROUNDED = [
    "Rewrite this function with type hints and nothing else:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)",
    "Fix the spelling mistakes and repeat the sentence: The commitee will meet on "
    "Tuesday to reveiw the budjet and the schedual.",
    "Convert to uppercase: the quick brown fox jumps over the lazy dog near the river bank.",
    "Add a docstring to this function:\n\ndef greet(name):\n    return 'Hello, ' + name",
]
OPEN = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "Give three tips for a job interview.",
    "Describe your ideal weekend.",
]


def theoretical_tokens_per_step(alpha: float | None, k: int) -> float | None:
    if alpha is None:
        return None
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def is_head_method(method: str | None) -> bool:
    return method is not None and get_method(method).drafter == "head"


def head_variants(method: str, model_path: Path, random_heads: bool) -> list[str | None]:
    """The `model` values to run: the trained head if cached, and the random one."""
    if not is_head_method(method):
        return [None]
    trained = [None] if find_trained_head(model_path, method) else []
    return trained + (["random"] if random_heads or not trained else [])


Config = tuple[str | None, str, int, str | None]  # method, policy, K, head


Served = tuple[list[str], int]  # prompts an engine serves before it is measured, max_tokens


def served_first(size: int, max_tokens: int) -> Served:
    """`size` training-split instructions, spread over its topics: what an engine that
    has been serving this kind of traffic saw before the measured batch (held-out
    instructions never appear there)."""
    train = instructions("train")
    return train[::max(len(train) // size, 1)][:size], max_tokens


def engine_for(model: LlamaForCausalLM, config: Config, concurrency: int,
               warm: Served | None = None) -> LLM:
    """A fresh engine for one configuration, warmed up by one short request and, with
    `warm`, by serving those prompts (left out of every figure): the goodput policy
    then starts from the estimates a running server has, not from its prior."""
    method, policy, k, head = config
    spec: dict | None = ({"method": method, "num_speculative_tokens": k,
                          "draft_policy": policy} if method else None)
    if spec is not None and head is not None:
        spec["model"] = head
    device = next(model.parameters()).device.type  # the engine runs where the model is
    llm = LLM(loaded_model=model, speculative_config=spec, max_num_batched_tokens=256,
              max_num_seqs=concurrency, max_model_len=1024, device=device)
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    if warm is not None:
        prompts, max_tokens = warm
        llm.chat([[{"role": "user", "content": p}] for p in prompts],
                 SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return llm


def run_one(model: LlamaForCausalLM, method: str | None, prompts: list[str], k: int,
            max_tokens: int, head: str | None = None, concurrency: int = 16,
            policy: str = "goodput", warm: Served | None = None) -> dict:
    config = (method, policy, k, head)
    llm = engine_for(model, config, concurrency, warm)
    before = llm.get_metrics()
    chats = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    outs = llm.chat(chats, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return record(llm, config, before, outs, time.perf_counter() - start)


def run_together(model: LlamaForCausalLM, configs: list[Config], prompts: list[str],
                 max_tokens: int, concurrency: int,
                 warm: Served | None = None) -> list[dict]:
    """Each configuration's record for the same prompts, all stepped in turn, each
    timed by the sum of its own steps (engine/stepwise.py: separate runs a few seconds
    apart differ by as much as the configurations here)."""
    engines = [engine_for(model, c, concurrency, warm) for c in configs]
    befores = [llm.get_metrics() for llm in engines]
    rendered = [engines[0].tokenizer.apply_chat_template([{"role": "user", "content": p}])
                for p in prompts]
    seconds, last = run_side_by_side(engines, rendered, SamplingParams(max_tokens=max_tokens))
    return [record(llm, c, b, out, s) for llm, c, b, out, s in
            zip(engines, configs, befores, last, seconds, strict=True)]


def run_pair(model: LlamaForCausalLM, config: Config, prompts: list[str], max_tokens: int,
             concurrency: int, warm: Served | None = None) -> tuple[dict, dict]:
    """Speculation off and `config` on the same prompts, stepped alternately
    (`run_together`). Returns (off's record, the configuration's)."""
    off, on = run_together(model, [(None, "off", config[2], None), config], prompts,
                           max_tokens, concurrency, warm)
    return off, on


def record(llm: LLM, config: Config, before: dict, outs: list, seconds: float) -> dict:
    """One run's figures from its engine's metrics since `before`."""
    method, policy, k, head = config
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = llm.get_metrics()
    spec_stats, was = metrics["spec_decode"], before["spec_decode"]
    drafted = spec_stats["num_draft_tokens"] - was["num_draft_tokens"]
    accepted = spec_stats["num_accepted_tokens"] - was["num_accepted_tokens"]
    drafts = spec_stats["num_drafts"] - was["num_drafts"]
    alpha = accepted / drafted if drafted else None
    return {
        "method": method or "off", "num_speculative_tokens": k if method else 0,
        "draft_policy": policy if method else None,
        "chosen_k": (_since(metrics["draft_policy"]["chosen_k"],
                            before["draft_policy"]["chosen_k"]) if method else None),
        "head": (head or "trained") if is_head_method(method) else None,
        "output_tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "steps": metrics["num_steps"] - before["num_steps"],
        "acceptance_rate": alpha,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_pos_since_start": spec_stats["acceptance_per_pos"],
        "theoretical_tokens_per_step": theoretical_tokens_per_step(alpha, k) if method else 1.0,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def _since(counts: list[int], before: list[int]) -> list[int]:
    """A histogram's counts since `before` (which may have fewer bins)."""
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(counts)]


def pass_order(num_configs: int, repeat: int, repeats: int) -> list[int]:
    """The configurations' order in pass `repeat`: rotated by an even share of the list
    each pass, so over the passes each configuration runs early, midway and late."""
    shift = (repeat * num_configs) // max(repeats, 1)
    return [(i + shift) % num_configs for i in range(num_configs)]


def _median_row(runs: list[dict]) -> dict:
    """The first run's record with the median tokens/s of all runs (and each run's)."""
    rates = [r["tokens_per_s"] for r in runs]
    return {**runs[0], "tokens_per_s": round(statistics.median(rates), 2),
            "tokens_per_s_runs": rates}


def paired_speedup(runs: list[dict], off_runs: list[dict]) -> float:
    """The median over passes of each pass's tok/s against speculation off's in the same
    pass: this machine's speed drifts by tens of percent between minutes (off at 64
    running measured 290-417 tok/s in three passes), and a pass runs its
    configurations within a minute or two of each other."""
    return round(statistics.median(r["tokens_per_s"] / o["tokens_per_s"]
                                   for r, o in zip(runs, off_runs, strict=True)), 3)


def summarize(rows: list[dict]) -> list[dict]:
    """Per workload, concurrency and method: goodput against speculation off and
    against the best fixed K of the same run."""
    out = []
    keys = {(r["workload"], r["concurrency"], r["method"], r["head"]) for r in rows
            if r["method"] != "off"}
    for workload, conc, method, head in sorted(keys, key=str):
        same = [r for r in rows if (r["workload"], r["concurrency"], r["method"],
                                    r["head"]) == (workload, conc, method, head)]
        fixed = {r["num_speculative_tokens"]: r["speedup_vs_off"] for r in same
                 if r["draft_policy"] == "fixed"}
        best_k = max(fixed, key=lambda k: fixed[k]) if fixed else None
        # One entry per K goodput ran with (`--goodput-k`): goodput picks k <= K.
        for r in [r for r in same if r["draft_policy"] == "goodput"] or [None]:
            goodput = r["speedup_vs_off"] if r else None
            out.append({"workload": workload, "concurrency": conc, "method": method,
                        "head": head, "goodput_k": r["num_speculative_tokens"] if r else None,
                        "goodput_vs_off": goodput, "fixed_vs_off": fixed,
                        "best_fixed_k": best_k,
                        "goodput_vs_best_fixed": (round(goodput / fixed[best_k], 3)
                                                  if goodput and best_k is not None
                                                  else None)})
    return out


def run_passes(model: LlamaForCausalLM, configs: list[Config], batch: list[str],
               max_tokens: int, concurrency: int, repeats: int, warm: bool,
               paired_steps: bool = False, serve: Served | None = None,
               together: bool = False) -> tuple[dict[int, list[dict]],
                                                     dict[int, list[dict]]]:
    """Every configuration's runs, by its index, and the runs of speculation off each
    is compared with: round-robin over the configurations, `repeats` times, each pass
    starting elsewhere in the list (this machine's speed drifts within a pass too, so
    a fixed order favours whoever runs in its fast stretch). With `paired_steps`, each
    configuration runs step by step beside its own run of speculation off
    (`run_pair`); with `together`, every configuration, off included, runs step by
    step beside all the others in each pass (`run_together`), so goodput against a
    fixed K is paired too; otherwise every configuration is compared with the pass's
    one run of off (configuration 0). With `warm`, a first pass, unmeasured, meets every shape
    once: oneDNN builds a kernel per new row count, so in a cold process whoever runs
    first would pay the building for everyone after it. `serve`: what each engine
    serves, unmeasured, before its measured run (`engine_for`)."""
    runs_of: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    twins_of: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    if together:
        for repeat in range(-1 if warm else 0, repeats):
            records = run_together(model, configs, batch, max_tokens, concurrency, serve)
            for i, run in enumerate(records if repeat >= 0 else []):
                runs_of[i].append(run)
        return runs_of, {i: runs_of[0] for i in range(len(configs))}
    measured = range(1, len(configs)) if paired_steps else range(len(configs))
    for repeat in range(-1 if warm else 0, repeats):
        for i in pass_order(len(configs), max(repeat, 0), repeats):
            if i not in measured:
                continue
            method, policy, k, head = configs[i]
            if paired_steps:
                off, run = run_pair(model, configs[i], batch, max_tokens, concurrency, serve)
            else:
                run = run_one(model, method, batch, k, max_tokens, head, concurrency, policy,
                              serve)
            if repeat >= 0:
                runs_of[i].append(run)
                if paired_steps:
                    twins_of[i].append(off)
                    runs_of[0].append(off)
    for i in range(len(configs)):
        if not paired_steps or i == 0:
            twins_of[i] = runs_of[0]
    return runs_of, twins_of


def result_rows(configs: list[Config], runs_of: dict[int, list[dict]],
                twins_of: dict[int, list[dict]], workload: str, conc: int) -> list[dict]:
    """One row per configuration (its median run, its ratios to off, whether every run
    matched off's tokens), each printed as it is made."""
    base = _median_row(runs_of[0])
    rows = []
    for i, (_, policy, k, _head) in enumerate(configs):
        row = base if i == 0 else _median_row(runs_of[i])
        row.update(workload=workload, concurrency=conc,
                   speedup_vs_off=paired_speedup(runs_of[i], twins_of[i]),
                   speedup_of_medians=round(row["tokens_per_s"] / base["tokens_per_s"], 3),
                   lossless=all(r["outputs"] == base["outputs"] for r in runs_of[i]))
        rows.append(row)
        print(f"{workload:<9}{conc:>3}  {row['method']:<10}{policy:<8}K={k} "
              f"{row['head'] or '':<8}"
              f"{row['tokens_per_s']:>8.1f} tok/s  x{row['speedup_vs_off']:<6}"
              f" runs={row['tokens_per_s_runs']}"
              f" len={row['mean_acceptance_length']} lossless={row['lossless']}",
              flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--no-random-heads", action="store_true",
                        help="skip the untrained-head rows where a trained head exists")
    parser.add_argument("--workloads", default="grounded,open,held-out")
    parser.add_argument("--min-requests", type=int, default=None,
                        help="requests per run even at concurrency 1, one at a time "
                             "(default 8; --quick: 1)")
    parser.add_argument("--policies", default="goodput,fixed",
                        help="draft policies to run; fixed runs once per K in --k-grid")
    parser.add_argument("--k-grid", default=None,
                        help="K values for the fixed policy (default: -k only)")
    parser.add_argument("--goodput-k", default=None,
                        help="K values goodput runs with, each its own row: goodput "
                             "picks each request's k from 0 to K (default: -k only)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated (default 1,16; --quick: 1,4)")
    parser.add_argument("--dtype", default="auto",
                        help="the model's dtype: float32, bfloat16 or auto (default: "
                             "auto, the engine's own default, what a user serves with)")
    parser.add_argument("--no-warm-pass", dest="warm_pass", action="store_false",
                        help="skip the unmeasured first pass over every configuration")
    parser.add_argument("--repeats", type=int, default=1,
                        help="round-robin passes over every configuration (medians)")
    parser.add_argument("--paired-steps", action="store_true",
                        help="run each configuration step by step beside its own run "
                             "of speculation off (tok/s ratios immune to the machine's "
                             "drift over seconds)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run every configuration, off included, step by step "
                             "beside all the others in each pass: goodput against "
                             "each fixed K is paired as well as each against off")
    parser.add_argument("--serve-first", action="store_true",
                        help="each engine first serves, unmeasured, as many training-split "
                             "instructions as the measured batch holds: the goodput "
                             "policy starts from a running server's estimates (default: "
                             "a fresh engine's prior)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model and every engine run (default cpu)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out_path = args.out or ROOT / "benchmarks" / "results" / (
        "spec_decode_quick.json" if args.quick else "spec_decode.json")
    methods = [m for m in args.methods.split(",") if m]
    concurrencies = (tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency
                     else (1, 4) if args.quick else (1, 16))
    policies = [p for p in args.policies.split(",") if p]
    k_grid = [int(k) for k in args.k_grid.split(",")] if args.k_grid else [args.k]
    goodput_ks = ([int(k) for k in args.goodput_k.split(",")] if args.goodput_k
                  else [args.k])
    runs = [(p, k) for p in policies
            for k in (k_grid if p == "fixed" else goodput_ks if p == "goodput" else [args.k])]
    max_tokens = 8 if args.quick else 64
    min_requests = args.min_requests or (1 if args.quick else 8)
    torch.manual_seed(0)
    path = resolve_model(None)
    from runner.config import RunnerConfig

    dtype = RunnerConfig(device=args.device, dtype=args.dtype).torch_dtype
    model = load_model(path, dtype, torch.device(args.device))
    rows = []
    workloads = {"grounded": GROUNDED, "open": OPEN, "held-out": instructions("eval")}
    for workload in args.workloads.split(","):
        prompts = workloads[workload]
        for conc in concurrencies:
            # At least `min_requests` requests, at most `conc` running at once.
            batch = (prompts * conc)[:max(conc, min(min_requests, len(prompts)))]
            configs: list[Config] = [(None, "off", args.k, None)]
            configs += [(method, policy, k, head)
                        for method in methods for policy, k in runs
                        for head in head_variants(method, path, not args.no_random_heads)]
            serve = served_first(len(batch), max_tokens) if args.serve_first else None
            runs_of, twins_of = run_passes(model, configs, batch, max_tokens, conc,
                                           args.repeats, args.warm_pass and not args.quick,
                                           args.paired_steps, serve, args.side_by_side)
            rows += result_rows(configs, runs_of, twins_of, workload, conc)
    for row in rows:
        del row["outputs"]
    report = {"benchmark": "spec_decode", "device": args.device,
              "dtype": str(dtype).removeprefix("torch."),
              "num_speculative_tokens": args.k, "max_tokens": max_tokens,
              "quick": args.quick, "paired_steps": args.paired_steps,
              "side_by_side": args.side_by_side,
              "served_first": args.serve_first, "results": rows,
              "policy_summary": summarize(rows)}
    write_report(out_path, report)
    print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
