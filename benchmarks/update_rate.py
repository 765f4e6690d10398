"""Seconds per training update of a drafter head, as `specbudget train-drafter` runs
them (training/train.py: the unrolled steps in the method's serving layout, AdamW,
bfloat16 autocast where the target serves in bfloat16), with only the live rows run
(`layouts.live_rows`: a window's prompt text and the padding past its answer carry no
label, so later steps skip their chains) against every row, and AdamW fused (as the
command runs it) against unfused, on the same batches, in one run, the modes in turn.
Both row modes give the same loss (checked here on each batch); the data is the
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "update_rate.json"
# live: what train-drafter runs (live rows, fused AdamW); all: every row; unfused: live
# rows with AdamW's unfused (foreach) step.
MODES = ("live", "all", "unfused")
DEPTH, DRAFT_VOCAB = 4, 8192  # train-drafter's defaults: K and the draft vocabulary


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

    from runner.config import RunnerConfig
    from training.train import IGNORE

    # Autocast hands the head's RMSNorm bf16 input beside its float32 weight; torch then
    # normalises unfused (correct) and says so, as train-drafter hides too.
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    dtype = RunnerConfig().torch_dtype
    model, data, d2t = _training_data(dtype, args.prompts)
    batches = batch_indices(len(data.tokens), args.updates)
    runs: dict[str, dict[str, list[float]]] = {}
    same_loss: dict[str, bool] = {}
    for method in args.methods.split(","):
        same_loss[method], runs[method] = _measure(model, d2t, data, batches, method,
                                                   args.rounds, dtype == torch.bfloat16)
    medians = {m: {mode: statistics.median(r[mode]) for mode in MODES} for m, r in runs.items()}
    report = {
        "benchmark": "update_rate",
        "quick": args.quick,
        "dtype": str(dtype).removeprefix("torch."),
        "windows": len(data.tokens), "window": data.tokens.shape[1], "batch": 8, "depth": DEPTH,
        "updates_per_round": args.updates, "rounds": args.rounds,
        "labelled_share": round(float((data.labels != IGNORE).float().mean()), 3),
        "timed": "seconds per update (forward, backward, AdamW), per round",
        "torch": torch.__version__,
        "runs": runs,
        "median_s_per_update": medians,
        "same_loss": same_loss,
        "live_over_all": {m: round(v["live"] / v["all"], 3) for m, v in medians.items()},
        "fused_over_unfused": {m: round(v["live"] / v["unfused"], 3)
                               for m, v in medians.items()},
    }
    write_report(args.out, report)
    for method, v in medians.items():
        print(f"{method:>8}: {v['live']:.3f} s/update live rows, {v['all']:.3f} every row "
              f"({v['live'] / v['all']:.2f}x), {v['unfused']:.3f} with AdamW unfused")
    print(f"wrote {args.out}")
    return report


def batch_indices(num: int, updates: int, size: int = 8) -> list[Any]:
    """`updates` batches of `size` window indices in a fixed shuffled order that wraps
    round, as train_head's epochs do: with fewer windows than `updates * size` the
    later batches are still full (slicing the order alone left them short or empty,
    and an empty batch crashed the loss)."""
    import torch

    order = torch.randperm(num, generator=torch.Generator().manual_seed(0))
    return [order[torch.arange(i * size, (i + 1) * size) % num] for i in range(updates)]


def _training_data(dtype: Any, prompts: int) -> tuple[Any, Any, Any]:
    """(target, training windows as a `Batch`, d2t): `prompts` chat conversations the
    target answers with their features captured, and a third as many code windows,
    as `specbudget train-drafter` makes them (training/pipeline.py)."""
    import torch

    from engine.llm import LLM
    from runner.eagle3 import Eagle3Config
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from training.data import code_windows
    from training.generate import Windows
    from training.layouts import greedy_run
    from training.pipeline import WINDOW, chat_data, code_data
    from training.prompts import first_turns
    from training.train import IGNORE, Batch, draft_vocab

    model = load_model(resolve_model(None), dtype)
    config = Eagle3Config.for_target(model.config, DRAFT_VOCAB)
    llm = LLM(loaded_model=model, max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    chat = chat_data(llm, first_turns("train", 0), prompts, config.aux_layer_ids)
    code = code_windows(llm.tokenizer, WINDOW, max(1, prompts // 3), "train")
    windows = Windows.cat([chat, code_data(model, code, config.aux_layer_ids)])
    d2t, t2d = draft_vocab(windows.labels[windows.labels >= 0], model.config.vocab_size,
                           DRAFT_VOCAB)
    mapped = torch.where(windows.labels >= 0, t2d[windows.labels.clamp(min=0)], IGNORE)
    return model, Batch(windows.aux, windows.tokens, mapped,
                        greedy_run(windows.tokens, windows.labels)), d2t


def _measure(model: Any, d2t: Any, data: Any, batches: list[Any], method: str, rounds: int,
             autocast: bool) -> tuple[bool, dict[str, list[float]]]:
    """Whether both modes give the same loss on every batch (a fresh head, before any
    update), and each mode's seconds per update in each round, the modes in turn."""
    import torch

    from runner.eagle3 import Eagle3Config, Eagle3Head
    from training.layouts import train_layout
    from training.train import TrainConfig, adamw, init_from_target, select, unrolled_loss

    head = Eagle3Head(Eagle3Config.for_target(model.config, DRAFT_VOCAB), model, seed=0)
    init_from_target(head, model, d2t)
    layout = train_layout(method)
    with torch.no_grad():
        same = all(torch.allclose(*(unrolled_loss(head, select(data, i), DEPTH, layout,
                                                  live_only=mode)[0]
                                    for mode in (True, False)), rtol=1e-3)
                   for i in batches)
    params = [p for p in head.parameters() if p.requires_grad]

    def seconds_per_update(mode: str) -> float:
        opt = adamw(params, TrainConfig(), fused=mode != "unfused")
        begin = time.perf_counter()
        for index in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, _ = unrolled_loss(head, select(data, index), DEPTH, layout, noise=0.05,
                                        live_only=mode != "all")
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - begin) / len(batches)

    seconds_per_update("live")  # warm-up
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            runs[mode].append(round(seconds_per_update(mode), 4))
    return same, runs


if __name__ == "__main__":
    main()
