"""The engine at one request, this checkout against an earlier revision: output tok/s
with speculation off and with each named method (fixed K; a head method needs its
trained head in the model cache, which both sides then share, or `--random-heads`: an
untrained head on both sides, every step drafting K and keeping one token, so the
ratio to off is what a step of drafting and verifying costs), on held-out
instructions, greedy.

Each (side, method) runs in its own process, the side's packages first on the path
(REV from a temporary git worktree), rounds alternating which side goes first; the
figure is each side's median over rounds and the ratio of medians. A process per run
keeps one side's compiled kernels and allocator state out of the other's, at the cost
of the machine's drift between runs seconds apart: read the ratios with the rounds'
spread beside them. Also: whether each side's speculative outputs equal its own
speculation off (lossless on both).

    python benchmarks/decode_ab.py --base REV [--methods off,eagle] [--rounds 3]
        [--prompts 6] [--max-tokens 64] [--random-heads] [--quick] [--out PATH]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.scheduler_vs_vllm import baseline_worktree  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "decode_ab.json"

# Run with cwd = the side's tree: its packages first on the path.
_MEASURE = """
import json, sys, time
sys.path.insert(0, '.')
import engine
from engine.llm import LLM
from scheduler import SamplingParams
from spec_decode.methods import get_method
from training.prompts import instructions
method, num, max_tokens, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spec = None if method == 'off' else {'method': method, 'num_speculative_tokens': k,
                                     'draft_policy': 'fixed'}
if spec and sys.argv[5] == 'random' and get_method(method).drafter == 'head':
    spec['model'] = 'random'  # an untrained head: every step drafts, none accepted
llm = LLM(speculative_config=spec, max_num_seqs=1, max_num_batched_tokens=256,
          max_model_len=1024)
llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)
prompts = [llm.tokenizer.apply_chat_template([{'role': 'user', 'content': p}])
           for p in instructions('eval')[:num]]
start = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                    use_tqdm=False)
took = time.perf_counter() - start
tokens = [list(o.outputs[0].token_ids) for o in outs]
print(json.dumps({'tokens_per_s': sum(map(len, tokens)) / took, 'tokens': tokens,
                  'engine_file': engine.__file__}))
"""


def measure(tree: Path, method: str, prompts: int, max_tokens: int, k: int,
            random_heads: bool = False) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, method, str(prompts),
                           str(max_tokens), str(k), "random" if random_heads else "trained"],
                          cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{method} in {tree} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    if not Path(got.pop("engine_file")).is_relative_to(tree.resolve()):
        raise RuntimeError(f"the run in {tree} imported another checkout's engine")
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--base", required=True, metavar="REV")
    parser.add_argument("--methods", default="off,eagle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--random-heads", action="store_true",
                        help="head methods with an untrained head on both sides")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prompts, args.max_tokens = 1, 1, 4
    methods = args.methods.split(",")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"base": {}, "head": {}}
    with baseline_worktree(args.base) as base_tree:
        trees = {"base": base_tree, "head": ROOT}
        for r in range(args.rounds):
            sides = ["base", "head"] if r % 2 == 0 else ["head", "base"]
            for side in sides:
                for method in methods:
                    runs[side].setdefault(method, []).append(
                        measure(trees[side], method, args.prompts, args.max_tokens, args.k,
                                args.random_heads))
    report = {"benchmark": "decode_ab", "quick": args.quick, "base": args.base,
              "head": _rev("HEAD"), "base_commit": _rev(args.base), "rounds": args.rounds,
              "prompts": args.prompts, "max_tokens": args.max_tokens, "k": args.k,
              "random_heads": args.random_heads, "concurrency": 1,
              "results": summarise(runs, methods)}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(json.dumps(report, indent=1))
    return report


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]], methods: list[str]
              ) -> dict[str, Any]:
    """Per method: each side's tok/s per round and median, head over base; per side,
    each method over off and whether its outputs equal off's in every round."""
    out: dict[str, Any] = {}
    for method in methods:
        row: dict[str, Any] = {}
        for side in ("base", "head"):
            rates = [run["tokens_per_s"] for run in runs[side][method]]
            row[side] = {"tokens_per_s": [round(x, 2) for x in rates],
                         "median": round(statistics.median(rates), 2)}
            if method != "off" and "off" in runs[side]:
                row[side]["over_off"] = round(row[side]["median"]
                                              / statistics.median(
                                                  r["tokens_per_s"] for r in runs[side]["off"]),
                                              3)
                row[side]["equal_to_off"] = all(
                    a["tokens"] == b["tokens"]
                    for a, b in zip(runs[side][method], runs[side]["off"], strict=True))
        row["head_over_base"] = round(row["head"]["median"] / row["base"]["median"], 3)
        out[method] = row
    return out


def _rev(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main()
