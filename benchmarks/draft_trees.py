"""Drafted token trees (`draft_top_k`, runner/draft_tree.py) against chains: a trained
head served with several tree shapes of one depth, each stepped side by side with
speculation off (training/served.py `side_by_side`: one request at a time unless
`--concurrency` says more, greedy, held-out instructions), under the fixed policy (or
`--policy`). Per shape: tok/s against off, mean acceptance length (tokens a
verification), how often a verification reached each depth (`reach`: the first is the
acceptance at position 1), verifications won by a leaf, and whether every output
equals off's.

A shape is a list of widths per depth, the last repeating ("1" is the chain, "4,2,1"
lists four candidates at the first depth, two at the second, then a chain); shapes are
separated by ";". K is the shape's node count at `--depth`.

    python benchmarks/draft_trees.py [--quick] [--method eagle] [--depth 4]
        [--shapes "1;2;3;4,2,1"] [--prompts 24] [--max-tokens 64] [--head DIR]
        [--policy fixed|fit|goodput] [--gate G] [--interleave steps|requests]
        [--concurrency N] [--rounds N] [--out PATH]
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
from training.options import at_least  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "draft_trees.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    served_head_args(parser)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--shapes", default="1;2;3;4,2,1")
    parser.add_argument("--policy", default="fixed", help="draft_policy of every run")
    parser.add_argument("--gate", type=float, default=None,
                        help="min_draft_confidence (chain methods; default: the engine's)")
    parser.add_argument("--interleave", choices=("steps", "requests"), default="steps",
                        help="engines take turns a step or a whole request at a time "
                             "(engine/stepwise.py; requests: one running at a time)")
    parser.add_argument("--concurrency", type=at_least(1), default=1,
                        help="requests running at most (all prompts queued at once)")
    parser.add_argument("--rounds", type=at_least(1), default=1,
                        help="side-by-side runs; tok/s ratios are their medians")
    args = parser.parse_args(argv)

    from spec_decode.tree_shape import tree_nodes
    from training.served import side_by_side

    model, head, prompts = served_head(args)
    shapes = [[int(w) for w in shape.split(",")] for shape in args.shapes.split(";")]
    gate = {} if args.gate is None else {"min_draft_confidence": args.gate}
    specs = [{"method": args.method, "model": head, "draft_policy": args.policy, **gate,
              "num_speculative_tokens": tree_nodes(widths, args.depth), "draft_top_k": widths}
             for widths in shapes]
    # [round][configuration]: off first
    rounds = [side_by_side(model, [None, *specs], prompts, args.max_tokens,
                           by_request=args.interleave == "requests",
                           concurrency=args.concurrency) for _ in range(args.rounds)]
    offs = [configs[0] for configs in rounds]
    report = {"benchmark": "draft_trees", "quick": args.quick, "method": args.method,
              "depth": args.depth, "policy": args.policy,
              "head": args.head or "trained default",
              "gate": args.gate, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "interleave": args.interleave, "concurrency": args.concurrency,
              "rounds": args.rounds,
              "tokens_per_s_off": round(statistics.median(o["tokens_per_s"] for o in offs), 2),
              "results": {",".join(map(str, widths)): _row([r[i] for r in rounds], offs, spec,
                                                           args.depth)
                          for i, (widths, spec) in enumerate(zip(shapes, specs, strict=True),
                                                             start=1)}}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report)
    return report


def _row(runs: list[dict[str, Any]], offs: list[dict[str, Any]], spec: dict[str, Any],
         depth: int) -> dict[str, Any]:
    """One shape's figures: tok/s ratios per round and their median; acceptance from the
    first round (greedy drafts and verification are deterministic: every round
    accepts alike)."""
    from training.served import tree_acceptance

    ratios = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(runs, offs, strict=True)]
    return {"k": spec["num_speculative_tokens"],
            "speedup_vs_off": round(statistics.median(ratios), 3),
            "speedup_per_round": [round(x, 3) for x in ratios],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
            **tree_acceptance(runs[:1], depth),
            "lossless": all(r["outputs"] == o["outputs"] for r, o in zip(runs, offs,
                                                                          strict=True))}


if __name__ == "__main__":
    main()
