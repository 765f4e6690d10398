"""The training data's rate: chat answer tokens per second, features included, as
`specbudget train-drafter` generates them (training/generate.py: the engine's batched
greedy `LLM.chat` with the runner's feature capture on), per attention backend, in one
run. Each round runs every backend on the same instructions, in turn, so a slow minute
of this shared machine falls on all of them.

`--kernels`: the target's linear kernel, `fastest` (what the command generates with:
runner/models/kernel_select.py `fastest_linear_kernel`) and/or `serving` (the engine's
row-invariant choice); each configuration is a backend and a kernel.

    python benchmarks/data_rate.py [--prompts 128] [--batch 64] [--rounds 2]
        [--backends cpu,torch] [--kernels fastest,serving] [--quick] [--out PATH]
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

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "data_rate.json"
WINDOW = 128  # training/pipeline.py's window: answers of up to 96 tokens


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64, help="requests answered at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backends", default="cpu,torch")
    parser.add_argument("--kernels", default="fastest")
    args = parser.parse_args(argv)
    args.out = out_path(args, DEFAULT_OUT)
    if args.quick:
        args.prompts, args.batch, args.rounds = 4, 4, 1

    import torch

    from runner.config import RunnerConfig
    from runner.eagle3 import Eagle3Config
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from runner.models.kernel_select import fastest_linear_kernel, select_linear_kernel
    from training.generate import generate_windows
    from training.pipeline import data_llm
    from training.prompts import first_turns

    config = RunnerConfig()
    model = load_model(resolve_model(None), config.torch_dtype)
    aux_ids = Eagle3Config.for_target(model.config, 8192).aux_layer_ids
    conversations = [[{"role": "user", "content": p}]
                     for p in first_turns("train", 0)[:args.prompts]]
    widths = model.config.reduction_widths
    dtype = model.lm_head.weight.dtype
    choices = {"fastest": fastest_linear_kernel(dtype, "cpu", widths),
               "serving": select_linear_kernel(dtype, "cpu", widths)}
    kernels = {name: choices[name] for name in args.kernels.split(",")}
    engines, packs = {}, {}
    for kernel_name, choice in kernels.items():
        for backend in args.backends.split(","):
            name = backend if kernel_name == "fastest" else f"{backend}/{kernel_name}"
            llm = data_llm(model, args.batch, attention_backend=backend)  # the command's
            model.pack(choice)  # the engines share the model: packed again per run
            generate_windows(llm, conversations[:2], WINDOW, aux_ids)  # warm-up
            engines[name], packs[name] = llm, choice
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            model.pack(packs[name])
            begin = time.perf_counter()
            windows, answers = generate_windows(llm, conversations, WINDOW, aux_ids)
            seconds = time.perf_counter() - begin
            tokens = sum(len(a) for a in answers)
            runs[name].append({"seconds": round(seconds, 2), "answer_tokens": tokens,
                               "tokens_per_s": round(tokens / seconds, 1),
                               "labelled": int((windows.labels >= 0).sum())})
    rates = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    first = next(iter(rates))
    report = {
        "benchmark": "data_rate",
        "quick": args.quick,
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        "prompts": args.prompts, "batch": args.batch, "rounds": args.rounds,
        "timed": "generate_windows (greedy chat, features captured) per round, seconds",
        "torch": torch.__version__,
        "kernels": {name: choice.description for name, choice in packs.items()},
        "runs": runs,
        "median_tokens_per_s": rates,
        f"ratio_to_{first}": {name: round(rate / rates[first], 3) for name, rate in rates.items()},
    }
    write_report(args.out, report)
    for name, rate in rates.items():
        print(f"{name:>6}: {rate:7.1f} answer tokens/s (features included), "
              f"{rate / rates[first]:.2f}x {first}")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
