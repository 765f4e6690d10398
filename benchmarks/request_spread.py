"""How far requests' own first-draft acceptance spreads, per method: the figure that
sets how many verifications a request's own record needs before the goodput policy
believes it (scheduler/request_spread.py).

Each method (fixed K = 1, so every verification checks exactly one first draft, and no
policy chooses which) answers the held-out instructions greedily one at a time; the
engine's spec-decode counters before and after each request give its verifications
and accepted first drafts. Those go through the scheduler's own `RequestSpread`,
forecast at the method's pooled rate, and the report gives per method: the pooled
rate, the dispersion of the requests' counts over a binomial's, the sd of a request's
own rate, and the weight the policy would learn.

    python benchmarks/request_spread.py [--quick] [--methods ngram,suffix,eagle,...]
        [--max-tokens 96] [--dtype auto] [--out PATH]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.greedy_equality import speculative_config  # noqa: E402
from engine import LLM  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from scheduler import SamplingParams  # noqa: E402
from scheduler.request_spread import RequestSpread  # noqa: E402
from spec_decode.methods import get_method  # noqa: E402
from training.prompts import instructions  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "request_spread.json"


def per_request(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """[N] verifications and [N] accepted first drafts of each prompt, served alone."""
    verified, accepted = [], []
    params = SamplingParams(max_tokens=max_tokens)
    for text in prompts:
        before = llm.get_metrics()["spec_decode"]
        llm.chat([[{"role": "user", "content": text}]], params, use_tqdm=False)
        after = llm.get_metrics()["spec_decode"]
        verified.append(after["num_drafts"] - before["num_drafts"])
        accepted.append(after["num_accepted_tokens"] - before["num_accepted_tokens"])
    return np.array(verified), np.array(accepted)


def spread_figures(verified: np.ndarray, accepted: np.ndarray) -> dict[str, float | int]:
    """The pooled rate, the counts' dispersion over a binomial's, and the weight the
    scheduler's `RequestSpread` learns from them (every request forecast at the pooled
    rate; requests verified fewer than 4 times say nothing, as there)."""
    keep = verified >= 4
    n, x = verified[keep], accepted[keep]
    p = float(x.sum() / max(n.sum(), 1))
    spread = RequestSpread(prior_weight=4.0, min_requests=2, decay=1.0, max_weight=64.0)
    for ni, xi in zip(n.tolist(), x.tolist(), strict=True):
        spread.record(ni, xi, ni * p)
    binomial = float((n * p * (1 - p)).sum())
    variance = spread.variance
    return {"requests": int(keep.sum()), "mean_verifications": float(n.mean()) if len(n) else 0.0,
            "first_draft_rate": round(p, 4),
            "dispersion": round(float(((x - n * p) ** 2).sum()) / binomial, 3) if binomial else 0.0,
            "sd_of_own_rate": round(p * float(np.sqrt(variance)), 4)
            if variance is not None else None,
            "learnt_weight": round(spread.weight, 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--methods", default="ngram,suffix,eagle,parallel,dflash")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    path = resolve_model(None)
    model = load_model(path, RunnerConfig(dtype=args.dtype).torch_dtype)
    prompts = instructions("eval")[:4 if args.quick else None]
    max_tokens = 24 if args.quick else args.max_tokens
    report: dict = {"benchmark": "request_spread", "dtype": args.dtype, "k": 1,
                    "max_tokens": max_tokens, "prompts": len(prompts), "methods": {}}
    for method in args.methods.split(","):
        begin = time.perf_counter()
        config = speculative_config(method, 1, path)
        config["draft_policy"] = "fixed"
        llm = LLM(loaded_model=model, speculative_config=config, max_num_seqs=1)
        verified, accepted = per_request(llm, prompts, max_tokens)
        llm.close()
        head = (config.get("model", "trained") if get_method(method).drafter == "head"
                else None)
        figures = {**spread_figures(verified, accepted), "head": head,
                   "seconds": round(time.perf_counter() - begin, 1)}
        report["methods"][method] = figures
        print(method, figures, flush=True)
    write_report(out_path(args, DEFAULT_OUT), report)
    return report


if __name__ == "__main__":
    main()
