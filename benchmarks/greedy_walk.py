"""An all-greedy step's verification on the host (`greedy_walk`, runner/spec.py) against
the rejection sampler's tensors: speculation off and the same head twice, once per
path, stepped side by side in one process (engine/stepwise.py: one request at a time,
greedy, held-out instructions), so the machine's drift between runs seconds apart
does not enter the ratio. Per round: each path's tok/s over off's and the walk's over
the sampler's, and whether every output equals off's.

    python benchmarks/greedy_walk.py [--quick] [--method eagle] [--k 4]
        [--policy fixed] [--min-draft-confidence C] [--prompts 24] [--max-tokens 64]
        [--rounds 3] [--head DIR] [--out PATH]
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

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "greedy_walk.json"
PATHS = ("off", "sampler", "host_walk")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    served_head_args(parser)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--policy", default="fixed")
    parser.add_argument("--min-draft-confidence", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from engine.stepwise import run_side_by_side
    from scheduler import SamplingParams
    from training.served import served_engine

    model, head, prompts = served_head(args)
    spec: dict[str, Any] = {"method": args.method, "model": head,
                            "num_speculative_tokens": args.k, "draft_policy": args.policy}
    if args.min_draft_confidence is not None:
        spec["min_draft_confidence"] = args.min_draft_confidence
    engines = [served_engine(model, s) for s in (None, spec, spec)]  # warmed up
    try:
        engines[1].engine.runner.spec.host_greedy_walk = False
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        rendered = [engines[0].tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    for p in prompts]
        rounds = [_round(*run_side_by_side(engines, rendered, params))
                  for _ in range(args.rounds)]
    finally:
        for llm in engines:
            llm.close()
    report = {"benchmark": "greedy_walk", "quick": args.quick, "method": args.method,
              "k": args.k, "policy": args.policy,
              "min_draft_confidence": args.min_draft_confidence,
              "head": args.head or "trained default", "prompts": args.prompts,
              "max_tokens": args.max_tokens, "rounds": rounds,
              "walk_over_sampler_median": round(statistics.median(
                  r["walk_over_sampler"] for r in rounds), 3)}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report)
    return report


def _round(seconds: list[float], outs: list[list[Any]]) -> dict[str, Any]:
    tokens = [[list(o.outputs[0].token_ids) for o in got] for got in outs]
    rate = [sum(map(len, t)) / s for t, s in zip(tokens, seconds, strict=True)]
    return {"tokens_per_s_off": round(rate[0], 2),
            **{f"{name}_over_off": round(r / rate[0], 3)
               for name, r in zip(PATHS[1:], rate[1:], strict=True)},
            "walk_over_sampler": round(rate[2] / rate[1], 3),
            "lossless": all(t == tokens[0] for t in tokens[1:])}


if __name__ == "__main__":
    main()
