"""Output tokens per second through the offline API, speculation off, per attention backend
(the compiled CPU kernel against the torch path), at several concurrencies, in one run.

Greedy chat on the held-out instructions (the benchmarks' held-out workload), at most
`--max-tokens` each, EOS on; at each concurrency `max(2 * concurrency, 8)` requests, at
most `concurrency` running. Each round runs every backend on the same requests in turn,
so a slow minute of this shared machine falls on all of them; the figure is the median
over rounds, and the outputs of the two backends are compared token for token (they may
part where their last bits round a near-tie differently: both are the model's greedy).

    python benchmarks/attention_engine.py [--concurrency 1,16,64] [--rounds 2]
        [--max-tokens 64] [--quick] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "attention_engine.json"
BACKENDS = ("cpu", "torch")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    args.out = out_path(args, DEFAULT_OUT)
    if args.quick:
        args.concurrency, args.rounds, args.max_tokens = "1,2", 1, 4

    import torch

    from engine.llm import LLM
    from runner.config import RunnerConfig
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from scheduler import SamplingParams
    from training.prompts import instructions

    config = RunnerConfig()
    model = load_model(resolve_model(None), config.torch_dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    held_out = instructions("eval")
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        count = 2 if args.quick else max(2 * concurrency, 8)
        chats = [[{"role": "user", "content": held_out[i % len(held_out)]}]
                 for i in range(count)]
        engines = {name: LLM(loaded_model=model, max_num_seqs=concurrency,
                             attention_backend=name) for name in BACKENDS}
        for llm in engines.values():  # warm-up, left out
            llm.chat(chats[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        rates: dict[str, list[float]] = {name: [] for name in BACKENDS}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                begin = time.perf_counter()
                outs = llm.chat(chats, params, use_tqdm=False)
                seconds = time.perf_counter() - begin
                outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
                rates[name].append(sum(map(len, outputs[name])) / seconds)
        for llm in engines.values():
            llm.close()
        medians = {name: statistics.median(r) for name, r in rates.items()}
        same = sum(a == b for a, b in zip(outputs["cpu"], outputs["torch"], strict=True))
        rows.append({"concurrency": concurrency, "requests": count,
                     "tok_s": {n: [round(r, 1) for r in rs] for n, rs in rates.items()},
                     "median_tok_s": {n: round(m, 1) for n, m in medians.items()},
                     "cpu_over_torch": round(medians["cpu"] / medians["torch"], 3),
                     "identical_outputs": f"{same}/{count}"})
    report = {
        "benchmark": "attention_engine",
        "quick": args.quick,
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "timed": "LLM.chat over the requests, speculation off, per backend per round",
        "torch": torch.__version__,
        "results": rows,
    }
    write_report(args.out, report)
    for row in rows:
        print(f"concurrency {row['concurrency']:>3}: cpu {row['median_tok_s']['cpu']:7.1f} "
              f"torch {row['median_tok_s']['torch']:7.1f} tok/s  "
              f"{row['cpu_over_torch']:.2f}x  identical {row['identical_outputs']}")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
