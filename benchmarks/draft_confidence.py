"""The confidence gate of chain drafters (runner/draft_gate.py), swept: a trained
head served at several `min_draft_confidence` thresholds, each stepped side by side
with speculation off (training/served.py `side_by_side`: one request at a time,
greedy, held-out instructions), under the fixed policy (every chain allowed K) and
the default one. Per threshold: tok/s against off, mean acceptance length, drafts made
and accepted per position, and whether every output equals off's.

    python benchmarks/draft_confidence.py [--quick] [--method eagle] [--k 4]
        [--thresholds 0,0.1,0.2,0.3] [--policies fixed,goodput] [--prompts 24]
        [--max-tokens 64] [--head DIR] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    bench_parser,
    out_path,
    served_head,
    served_head_args,
    write_report,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "draft_confidence.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    served_head_args(parser)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--thresholds", default="0,0.1,0.2,0.3")
    parser.add_argument("--policies", default="fixed,goodput")
    args = parser.parse_args(argv)

    from training.served import side_by_side

    model, head, prompts = served_head(args)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    results: dict[str, Any] = {}
    for policy in args.policies.split(","):
        specs = [{"method": args.method, "model": head, "num_speculative_tokens": args.k,
                  "draft_policy": policy, "min_draft_confidence": t} for t in thresholds]
        off, *runs = side_by_side(model, [None, *specs], prompts, args.max_tokens)
        results[policy] = {"tokens_per_s_off": round(off["tokens_per_s"], 2), **{
            str(t): _row(run, off) for t, run in zip(thresholds, runs, strict=True)}}
    report = {"benchmark": "draft_confidence", "quick": args.quick, "method": args.method,
              "k": args.k, "head": args.head or "trained default", "prompts": args.prompts,
              "max_tokens": args.max_tokens, "results": results}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report)
    return report


def _row(run: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    drafts = run["drafts"]
    return {"speedup_vs_off": round(run["tokens_per_s"] / off["tokens_per_s"], 3),
            "tokens_per_s": round(run["tokens_per_s"], 2),
            "mean_acceptance_length": round(1 + sum(run["accepted"]) / drafts, 3)
            if drafts else None,
            "drafted_per_position": run["drafted"], "accepted_per_position": run["accepted"],
            "verifications": drafts, "lossless": run["outputs"] == off["outputs"]}


if __name__ == "__main__":
    main()
