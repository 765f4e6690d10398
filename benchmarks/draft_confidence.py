"""The confidence gate of chain drafters (runner/draft_gate.py), swept: a trained
head served at several `min_draft_confidence` thresholds, each stepped side by side
with speculation off (training/served.py `side_by_side`: one request at a time,
greedy, held-out instructions), under the fixed policy (every chain allowed K) and
the default one. Per threshold: tok/s against off, mean acceptance length, drafts made
and accepted per position, and whether every output equals off's. The threshold
`default` asks for none: the engine's default, which under the goodput policy is the
gate priced by the policy's step-time model (runner/draft_calibration.py).

    python benchmarks/draft_confidence.py [--quick] [--method eagle] [--k 4]
        [--thresholds 0,0.1,0.2,0.3,default] [--policies fixed,goodput] [--prompts 24]
        [--max-tokens 64] [--rounds 1] [--head DIR] [--out PATH]

With `--rounds N` each policy's side-by-side run is repeated N times: its ratio is
the median, each round's listed (acceptance is deterministic; timing on a shared
machine moves several per cent between rounds, the order within one much less).
"""

from __future__ import annotations

import statistics
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
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)

    from training.served import side_by_side

    model, head, prompts = served_head(args)
    thresholds = args.thresholds.split(",")
    results: dict[str, Any] = {}
    for policy in args.policies.split(","):
        specs = [{"method": args.method, "model": head, "num_speculative_tokens": args.k,
                  "draft_policy": policy,
                  **({} if t == "default" else {"min_draft_confidence": float(t)})}
                 for t in thresholds]
        rounds = [side_by_side(model, [None, *specs], prompts, args.max_tokens)
                  for _ in range(args.rounds)]
        offs = [off for off, *_ in rounds]
        results[policy] = {
            "tokens_per_s_off": round(statistics.median(o["tokens_per_s"] for o in offs), 2),
            **{_key(t): _row([runs[i + 1] for runs in rounds], offs)
               for i, t in enumerate(thresholds)}}
    report = {"benchmark": "draft_confidence", "quick": args.quick, "method": args.method,
              "k": args.k, "rounds": args.rounds, "head": args.head or "trained default",
              "prompts": args.prompts, "max_tokens": args.max_tokens, "results": results}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report)
    return report


def _key(threshold: str) -> str:
    return threshold if threshold == "default" else str(float(threshold))


def _row(runs: list[dict[str, Any]], offs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over the rounds: its ratios to the off run beside it, and the
    counts of the first round (the same in every round: greedy, deterministic)."""
    run = runs[0]
    drafts = run["drafts"]
    ratios = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(runs, offs, strict=True)]
    return {"speedup_vs_off": round(statistics.median(ratios), 3),
            "speedup_vs_off_by_round": [round(x, 3) for x in ratios],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
            "mean_acceptance_length": round(1 + sum(run["accepted"]) / drafts, 3)
            if drafts else None,
            "drafted_per_position": run["drafted"], "accepted_per_position": run["accepted"],
            "verifications": drafts,
            "lossless": all(r["outputs"] == o["outputs"] for r, o in zip(runs, offs, strict=True))}


if __name__ == "__main__":
    main()
