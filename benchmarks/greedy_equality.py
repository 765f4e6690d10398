"""Greedy speculative decoding against speculation off, token for token, in one dtype.

Every method (each on its own engine, sharing the loaded target) answers the same chat
prompts greedily as speculation off does, at concurrency 1 (one request at a time:
decode passes of one row against verification passes of k + 1) and at concurrency 16
(the same prompts batched: other requests share every pass). The report gives, per
method and concurrency, how many requests matched speculation off exactly and, for
those that did not, where they first diverged. Head methods without a trained head
use an untrained one (`"model": "random"`: it proposes real drafts, nearly all
rejected, so every step still verifies k + 1 rows); draft_model and pard use the
default model drafting for itself (every draft accepted).

    python benchmarks/greedy_equality.py [--quick] [--prompts 50] [--max-tokens 128]
        [--methods ngram,suffix,...] [--concurrency 1,16] [--dtype auto]
        [--quantization none|int8]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.spec_decode import GROUNDED, OPEN  # noqa: E402
from engine import LLM  # noqa: E402
from runner.drafter import find_trained_head  # noqa: E402
from scheduler import SamplingParams  # noqa: E402
from spec_decode import METHODS  # noqa: E402
from spec_decode.methods import get_method  # noqa: E402
from training.prompts import instructions  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "greedy_equality.json"


def prompts(count: int) -> list[str]:
    """Grounded and open prompts first, then held-out and training instructions."""
    pool = GROUNDED + OPEN + instructions("eval") + instructions("train")[::7]
    return pool[:count]


def speculative_config(method: str, k: int, target_path: Path) -> dict[str, Any]:
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if get_method(method).drafter == "head" and find_trained_head(target_path, method) is None:
        config["model"] = "random"
    return config


def generate(llm: LLM, texts: list[str], concurrency: int, max_tokens: int
             ) -> tuple[list[list[int]], float]:
    """Greedy chat answers in prompt order, `concurrency` requests at a time."""
    params = SamplingParams(max_tokens=max_tokens)
    outputs: list[list[int]] = []
    begin = time.perf_counter()
    for i in range(0, len(texts), concurrency):
        batch = [[{"role": "user", "content": t}] for t in texts[i:i + concurrency]]
        outputs += [list(o.outputs[0].token_ids) for o in llm.chat(batch, params,
                                                                    use_tqdm=False)]
    return outputs, time.perf_counter() - begin


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
    divergences = []
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        if ref != out:
            first = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b),
                         min(len(ref), len(out)))
            divergences.append({"prompt": i, "first_differing_token": first})
    return {"requests": len(reference), "equal": len(reference) - len(divergences),
            "match": round(1 - len(divergences) / len(reference), 4),
            "tokens": sum(map(len, reference)), "divergences": divergences}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=("none", "int8"))
    args = parser.parse_args(argv)
    count, max_tokens = (3, 8) if args.quick else (args.prompts, args.max_tokens)
    texts = prompts(count)
    levels = [int(c) for c in args.concurrency.split(",")]
    engine_args = {"dtype": args.dtype, "max_num_seqs": max(levels),
                   "kv_cache_memory_bytes": 1 << 30,
                   "quantization": None if args.quantization == "none" else args.quantization}
    off = LLM(**engine_args)
    runner = off.engine.runner
    report: dict[str, Any] = {
        "benchmark": "greedy_equality", "quick": args.quick,
        "dtype": runner.dtype_description, "linear_kernel": runner.kernel_description,
        "prompts": count, "max_tokens": max_tokens, "k": args.num_speculative_tokens,
        "results": []}
    reference = {c: generate(off, texts, c, max_tokens) for c in levels}
    for c, (_, seconds) in reference.items():
        print(f"off, concurrency {c}: {seconds:.0f} s", flush=True)
    for method in args.methods.split(","):
        spec = speculative_config(method, args.num_speculative_tokens, runner.model_path)
        llm = LLM(speculative_config=spec, loaded_model=runner.model, **engine_args)
        for c in levels:
            outputs, seconds = generate(llm, texts, c, max_tokens)
            row = {"method": method, "drafter": spec.get("model", "default"),
                   "concurrency": c, "seconds": round(seconds, 1),
                   **compare(reference[c][0], outputs)}
            report["results"].append(row)
            print(f"{method:>12} c={c:<3} {row['equal']}/{row['requests']} equal "
                  f"({row['tokens']} tokens, {seconds:.0f} s)", flush=True)
        del llm
    write_report(out_path(args, DEFAULT_OUT), report)
    return report


if __name__ == "__main__":
    main()
