"""`specbudget train-drafter`: self-distilled data, target features, a trained head.

1. Data, in the engine's serving dtype. Chat: the target answers training
   instructions greedily, as it answers when a greedy request is served, through the
   engine's batched `LLM.chat`, with its features (three layers' inputs, its final
   hidden state) kept by the runner while it generates (training/generate.py);
   instructions of many task kinds, text from the machine, and second turns that
   hold the target's own first answer (training/prompts.py). Code: standard-library
   modules, teacher-forced (training/features.py). Evaluation is the target's answers
   to held-out first turns only.
2. A reduced draft vocabulary from the training labels, a head whose LM head and
   final norm start as the target's own (rows of the draft vocabulary), then
   training-time-test training in the method's serving layout (training/train.py,
   training/layouts.py) on the target's greedy token or on soft targets (its
   distribution over the draft vocabulary, `--loss kl`), with noise on the fed
   features and checkpoints to resume from.
3. The head is written in the EAGLE-3 layout (runner/eagle3.py) to `--out`, by default
   the model cache's `heads/<model>/<method>/`, where `"method": "eagle"` without a
   `model` finds it. A `metrics.json` beside it gives held-out agreement and the
   served figure: the head served on held-out chat against speculation off
   (training/served.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM
from runner.config import RunnerConfig
from runner.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layers,
    save_eagle3,
    trained_head_dir,
)
from runner.model_loader import load_model, read_config
from runner.model_prep import resolve_model
from runner.models.kernel_select import fastest_linear_kernel
from runner.models.llama import LlamaForCausalLM
from training.data import code_windows
from training.features import target_features
from training.generate import Windows, generate_windows
from training.layouts import greedy_run
from training.options import head_init
from training.prompts import first_turns, follow_up, held_out_turns
from training.served import served_figures_apart
from training.train import (
    IGNORE,
    Batch,
    TrainConfig,
    draft_vocab,
    evaluate,
    expected_length,
    init_from_target,
    train_head,
)

WINDOW = 128
# The data engine's longest context (a follow-up turn holds the first) and KV block.
DATA_MAX_MODEL_LEN, DATA_BLOCK_SIZE = 512, 16
FEATURE_CHUNK = 16  # windows per target forward
# Chat answers are what a served head drafts, and the held-out workload is chat; a
# quarter code keeps the head general. Measured (README, eagle, 1,000 updates, the
# served figure on all 36 held-out instructions): chat only served a mean acceptance
# length of 1.76 against 1.80 with the quarter of code, and 1,536 code windows more
# (0.44 code) served worse on every measure.
CHAT_SHARE = 0.75
# Of the chat windows, second turns whose context holds the target's own first answer.
FOLLOW_SHARE = 0.25
# Held-out windows per training window, every one a chat answer: the held-out
# agreement's sample (a twentieth of the default data, ~17,000 answer positions).
EVAL_SHARE = 0.05


def chat_data(llm: LLM, prompts: list[str], count: int, aux_ids: tuple[int, ...]
              ) -> Windows:
    """`count` windows of the target's own answers, features captured while it
    generates: first turns, and (FOLLOW_SHARE of them) second turns that carry the
    target's own first answer in their context."""
    num_follow = round(count * FOLLOW_SHARE) if len(prompts) > 1 else 0
    firsts = prompts[:count - num_follow]
    first, answers = generate_windows(llm, [[{"role": "user", "content": p}] for p in firsts],
                                      WINDOW, aux_ids)
    if not num_follow:
        return first
    texts = [llm.tokenizer.decode(a) for a in answers[:num_follow]]
    second, _ = generate_windows(llm, [follow_up(p, t, i) for i, (p, t)
                                       in enumerate(zip(firsts, texts, strict=False))],
                                 WINDOW, aux_ids)
    return Windows.cat([first, second])


def code_data(model: LlamaForCausalLM, windows: torch.Tensor, aux_ids: tuple[int, ...]
              ) -> Windows:
    """Features and the target's greedy labels of standard-library code, teacher-forced
    (it is text the target reads, not text it writes)."""
    parts = []
    for start in range(0, len(windows), FEATURE_CHUNK):
        chunk = windows[start:start + FEATURE_CHUNK]
        aux, labels, final = target_features(model, chunk, aux_ids)
        parts.append(Windows(chunk, aux, final, labels))
    return Windows.cat(parts)


def digest(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def data_key(model: LlamaForCausalLM, args: argparse.Namespace, aux_ids: tuple[int, ...]
             ) -> str:
    """What the self-distilled data depends on, hashed (its cache file's name)."""
    return digest(["v6", CHAT_SHARE, FOLLOW_SHARE, EVAL_SHARE, model.config.hidden_size,
                   str(model.lm_head.weight.dtype), args.tokens, args.seed, args.max_prompts,
                   WINDOW, list(aux_ids), str(args.model)])


def self_distilled_data(llm: LLM, model: LlamaForCausalLM, args: argparse.Namespace,
                        aux_ids: tuple[int, ...], cache: Path) -> dict[str, tuple]:
    """(windows, aux, final, labels) per split, kept in `cache/<key>.pt`: the data
    depends only on the target, its dtype, the seed and the sizes, so the heads of
    every method share it, and a resumed run does not generate it again. Evaluation
    is chat only: held-out first turns (`held_out_turns`: topics and files no training
    instruction uses, the benchmarks' held-out workload among them)."""
    file = cache / f"{data_key(model, args, aux_ids)}.pt"
    if file.exists():
        return dict(torch.load(file, weights_only=True))
    windows_total = max(2, args.tokens // WINDOW)
    splits = {}
    for split, count, share, chat_prompts in (
            ("train", windows_total, CHAT_SHARE,
             first_turns("train", args.seed)[:args.max_prompts]),
            ("eval", max(2, round(windows_total * EVAL_SHARE)), 1.0, held_out_turns(args.seed))):
        num_chat = min(max(1, round(count * share)), len(chat_prompts))
        if split == "eval":
            chat = generate_windows(llm, [[{"role": "user", "content": p}]
                                          for p in chat_prompts[:num_chat]], WINDOW,
                                    aux_ids)[0]
        else:
            chat = chat_data(llm, chat_prompts, num_chat, aux_ids)
        parts = [chat]
        if count > len(chat):  # code fills what chat could not (too few instructions)
            code = code_windows(llm.tokenizer, WINDOW, count - len(chat), split)
            parts.append(code_data(model, code, aux_ids))
        splits[split] = Windows.cat(parts).as_tuple()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    torch.save(splits, tmp)
    tmp.replace(file)
    return splits


def data_llm(model: LlamaForCausalLM, batch: int, model_name: str | None = None,
             **overrides: Any) -> LLM:
    """The engine that generates the data: `batch` requests at once, every position run
    (no prefix caching: the capture keeps each one), and a KV block for every position
    each of them can reach, so none is preempted. A preempted request runs its positions
    again: with the default 256 MiB, 128 requests ran 24 % more rows in twice the steps
    (AVX2 EPYC, float32: 166-177 against 210 answer tokens/s)."""
    blocks = batch * -(-DATA_MAX_MODEL_LEN // DATA_BLOCK_SIZE)
    settings: dict[str, Any] = dict(
        model=model_name, loaded_model=model, max_model_len=DATA_MAX_MODEL_LEN,
        max_num_seqs=batch, max_num_batched_tokens=2048, enable_prefix_caching=False,
        block_size=DATA_BLOCK_SIZE, num_kv_blocks=blocks)
    return LLM(**(settings | overrides))


def data_with_fastest_kernel(llm: LLM, model: LlamaForCausalLM, args: argparse.Namespace,
                             aux_ids: tuple[int, ...], cache: Path) -> dict[str, tuple]:
    """`self_distilled_data` with the target's linear layers on the fastest kernel here,
    then back on the engine's row-invariant one (the served figure checks lossless
    against it). The data is made at a fixed batch, so it needs no row to keep its bits
    in calls of other widths: on an Intel CPU with AMX the invariant kernel (oneDNN in
    calls of at most 32 rows) made 477 answer tokens/s where oneDNN's whole calls make
    724 (`benchmarks/results/data_rate_512_kernels.json`; the same kernel elsewhere)."""
    serving = model.kernel_choice
    if serving is None:  # not packed: nothing to hand back, so nothing to swap
        return self_distilled_data(llm, model, args, aux_ids, cache)
    weight = model.lm_head.weight
    model.pack(fastest_linear_kernel(weight.dtype, weight.device, model.config.reduction_widths))
    try:
        return self_distilled_data(llm, model, args, aux_ids, cache)
    finally:
        model.pack(serving)


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot check alone, before minutes of data generation: ValueError
    naming the option. (Ranges of single options are argparse types: training/options.py.)"""
    target = read_config(resolve_model(args.model))
    vocab_size = int(target["vocab_size"])
    if args.draft_vocab_size > vocab_size:
        raise ValueError(f"--draft-vocab-size must be at most the target's vocabulary "
                         f"({vocab_size}), got {args.draft_vocab_size}")
    # Started from the target, the head's layer i is the target's layer L + i - 1.
    num_layers = int(target["num_hidden_layers"])
    top = max(default_aux_layers(num_layers))
    if args.head_layers > num_layers - top and head_init(args.method, args.init) == "target":
        raise ValueError(f"--head-layers must be at most {num_layers - top} for a head that "
                         f"starts as the target's layers from {top} (of {num_layers}; "
                         f"or --init random), got {args.head_layers}")


def run(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    torch.manual_seed(args.seed)
    check_arguments(args)
    path = resolve_model(args.model)
    # The serving dtype: the head learns the features it will read, and bfloat16
    # generates the data several times faster than float32 on a CPU that has it.
    model = load_model(path, RunnerConfig(dtype=args.dtype).torch_dtype)
    config = Eagle3Config.for_target(model.config, args.draft_vocab_size, args.head_layers)
    out = Path(args.out) if args.out else trained_head_dir(path, args.method)
    # the engine, and its KV cache, are dropped once the data is made
    splits = data_with_fastest_kernel(data_llm(model, args.generate_batch, args.model), model,
                                      args, config.aux_layer_ids, out.parent / "data")
    data_s = time.monotonic() - started
    train_labels = splits["train"][3]  # (tokens, aux, final, labels)
    d2t, t2d = draft_vocab(train_labels[train_labels >= 0], model.config.vocab_size,
                           args.draft_vocab_size)

    # The target's LM head rows of the draft vocabulary: its distribution there is
    # what the soft-target loss teaches.
    teacher = (model.lm_head.weight.detach()[torch.arange(len(d2t)) + d2t].float()
               if args.loss == "kl" else None)

    def batch(split: str) -> Batch:
        windows, aux, final, labels = splits[split]
        # t2d gives MISSING (-1) for a token outside the draft vocabulary.
        mapped = torch.where(labels >= 0, t2d[labels.clamp(min=0)], IGNORE)
        return Batch(aux, windows, mapped, greedy_run(windows, labels), final, teacher)

    head = Eagle3Head(config, model, seed=args.seed)
    init = head_init(args.method, args.init)
    init_from_target(head, model, d2t, layer=init == "target")
    out.mkdir(parents=True, exist_ok=True)
    train_config = TrainConfig(updates=args.updates, lr=args.lr,
                               depth=args.num_speculative_tokens,
                               seed=args.seed, method=args.method, noise=args.noise,
                               weight_decay=args.weight_decay,
                               autocast_bf16=model.lm_head.weight.dtype == torch.bfloat16)
    # A checkpoint resumes only the run that wrote it: the same data, draft vocabulary,
    # loss and optimisation settings (another run's head maps its draft ids through
    # another vocabulary, and would serve garbage).
    run_key = digest([data_key(model, args, config.aux_layer_ids), args.method,
                      args.draft_vocab_size, args.loss, init, repr(train_config),
                      config.num_layers])
    train_head(head, batch("train"), train_config, checkpoint=out / "checkpoint.pt",
               progress=not args.no_progress, run_key=run_key)
    loss, accs = evaluate(head, batch("eval"), train_config.depth, args.method)
    metrics = {"method": args.method, "held_out_loss": round(loss, 4),
               "num_speculative_tokens": train_config.depth,
               "held_out_agreement_per_step": [round(a, 4) for a in accs],
               "expected_acceptance_length": round(expected_length(accs), 3),
               "train_windows": len(splits["train"][0]),
               "eval_windows": len(splits["eval"][0]), "window": WINDOW,
               "updates": args.updates, "lr": args.lr, "seed": args.seed, "loss": args.loss,
               "noise": args.noise, "weight_decay": train_config.weight_decay,
               "init": init, "head_layers": config.num_layers,
               "draft_vocab_size": args.draft_vocab_size,
               "data_answer_tokens": int((splits["train"][3] >= 0).sum()),
               "data_s": round(data_s, 1), "wall_s": round(time.monotonic() - started, 1)}
    save_eagle3(head, out, extra={"method": args.method, "trained": metrics})
    if args.served_prompts:
        # The figure a user sees: the head served on held-out chat, in a process of
        # its own (training/served.py).
        metrics["served"] = served_figures_apart(path, args.dtype, out, args.method,
                                                 train_config.depth,
                                                 num_prompts=args.served_prompts,
                                                 max_tokens=args.served_max_tokens)
        metrics["wall_s_with_served"] = round(time.monotonic() - started, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics))
    print(f"wrote {out}")
    return metrics
