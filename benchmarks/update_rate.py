"""Seconds per training update of a drafter head, as `specbudget train-drafter` runs
them (training/train.py: the unrolled steps in the method's serving layout, AdamW,
bfloat16 autocast where the target serves in bfloat16), with only the live rows run
(`layouts.live_rows`: a window's prompt text and the padding past its answer carry no
label, so later steps skip their chains) against every row, on the same batches, in
one run. Both modes give the same loss (checked here on each batch); the data is the
command's own kind: the target's greedy chat answers with their features, first and
second turns, and standard-library code.

    python benchmarks/update_rate.py [--methods eagle,parallel,dflash] [--prompts 48]
        [--updates 8] [--rounds 3] [--quick] [--out PATH]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "update_rate.json"
MODES = ("live", "all")


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--methods", default="eagle,parallel,dflash")
    parser.add_argument("--prompts", type=int, default=48, help="chat conversations")
    parser.add_argument("--updates", type=int, default=8, help="timed updates per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    args.out = out_path(args, DEFAULT_OUT)
    if args.quick:
        args.methods, args.prompts, args.updates, args.rounds = "eagle", 4, 1, 1

    import torch

    from engine.llm import LLM
    from runner.config import RunnerConfig
    from runner.eagle3 import Eagle3Config, Eagle3Head
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from training.data import code_windows
    from training.generate import Windows
    from training.layouts import greedy_run, train_layout
    from training.pipeline import WINDOW, chat_data, code_data
    from training.prompts import first_turns
    from training.train import IGNORE, Batch, draft_vocab, init_from_target, unrolled_loss

    # Autocast hands the head's RMSNorm bf16 input beside its float32 weight; torch then
    # normalises unfused (correct) and says so, as train-drafter hides too.
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    dtype = RunnerConfig().torch_dtype
    model = load_model(resolve_model(None), dtype)
    config = Eagle3Config.for_target(model.config, 8192)
    llm = LLM(loaded_model=model, max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    chat = chat_data(llm, first_turns("train", 0), args.prompts, config.aux_layer_ids)
    code = code_windows(llm.tokenizer, WINDOW, max(1, args.prompts // 3), "train")
    windows = Windows.cat([chat, code_data(model, code, config.aux_layer_ids)])
    d2t, t2d = draft_vocab(windows.labels[windows.labels >= 0], model.config.vocab_size,
                           config.draft_vocab_size)
    mapped = torch.where(windows.labels >= 0, t2d[windows.labels.clamp(min=0)], IGNORE)
    data = Batch(windows.aux, windows.tokens, mapped, greedy_run(windows.tokens, windows.labels))
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    batches = [order[i * 8:(i + 1) * 8] % len(windows) for i in range(args.updates)]
    autocast = dtype == torch.bfloat16

    def seconds_per_update(head: Eagle3Head, method: str, live_only: bool) -> float:
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        begin = time.perf_counter()
        for index in batches:
            batch = Batch(data.aux[index], data.tokens[index], data.labels[index],
                          data.chain[index])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, _ = unrolled_loss(head, batch, 4, train_layout(method), noise=0.05,
                                        live_only=live_only)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - begin) / len(batches)

    runs: dict[str, dict[str, list[float]]] = {}
    same_loss: dict[str, bool] = {}
    for method in args.methods.split(","):
        head = Eagle3Head(config, model, seed=0)
        init_from_target(head, model, d2t)
        with torch.no_grad():  # the two modes' losses on every batch, before any update
            same_loss[method] = all(
                torch.allclose(*(unrolled_loss(head, Batch(data.aux[i], data.tokens[i],
                                                           data.labels[i], data.chain[i]),
                                               4, train_layout(method), live_only=mode)[0]
                                 for mode in (True, False)), rtol=1e-3)
                for i in batches)
        seconds_per_update(head, method, True)  # warm-up
        runs[method] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                runs[method][mode].append(round(seconds_per_update(head, method,
                                                                   mode == "live"), 4))
    medians = {m: {mode: statistics.median(r[mode]) for mode in MODES} for m, r in runs.items()}
    report = {
        "benchmark": "update_rate",
        "quick": args.quick,
        "dtype": str(dtype).removeprefix("torch."),
        "windows": len(windows), "window": WINDOW, "batch": 8, "depth": 4,
        "updates_per_round": args.updates, "rounds": args.rounds,
        "labelled_share": round(float((windows.labels != IGNORE).float().mean()), 3),
        "timed": "seconds per update (forward, backward, AdamW), per round",
        "torch": torch.__version__,
        "runs": runs,
        "median_s_per_update": medians,
        "same_loss": same_loss,
        "live_over_all": {m: round(v["live"] / v["all"], 3) for m, v in medians.items()},
    }
    write_report(args.out, report)
    for method, v in medians.items():
        print(f"{method:>8}: {v['live']:.3f} s/update live rows, {v['all']:.3f} every row "
              f"({v['live'] / v['all']:.2f}x)")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
