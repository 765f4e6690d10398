"""`specbudget train-drafter`: self-distilled data, target features, a trained head.

1. Data. Chat: the target answers the built-in instructions (training/prompts.py)
   greedily, as it answers when a greedy request is served, through the engine's
   batched `LLM.chat`. Code: standard-library modules, teacher-forced. Both are cut
   into fixed windows; evaluation uses held-out topics and files only.
2. Features and labels from the target's own paged forward (training/features.py).
3. A reduced draft vocabulary from the training labels, a head whose LM head and
   final norm start as the target's own (rows of the draft vocabulary), then
   training-time-test training in the method's serving layout (training/train.py,
   training/layouts.py), with checkpoints to resume from.
4. The head is written in the EAGLE-3 layout (runner/eagle3.py) to `--out`, by default
   the model cache's `heads/<model>/<method>/`, where `"method": "eagle"` without a
   `model` finds it. A `metrics.json` beside it gives held-out agreement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from engine.llm import LLM
from runner.eagle3 import Eagle3Config, Eagle3Head, save_eagle3, trained_head_dir
from runner.model_loader import load_model, read_config
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from scheduler import SamplingParams
from training.data import code_windows
from training.features import target_features
from training.layouts import greedy_run
from training.prompts import instructions
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
FEATURE_CHUNK = 16  # windows per target forward
# Chat answers are what a served head drafts, and the held-out workload is chat; a
# quarter code keeps the head general. (Not tuned: against half and half, served
# first-draft acceptance moved only from 0.30 to 0.31.)
CHAT_SHARE = 0.75


def chat_windows(llm: LLM, prompts: list[str], max_windows: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's own answers, prompt included: [N, WINDOW] ids, real lengths and
    prompt lengths."""
    params = SamplingParams(max_tokens=WINDOW, temperature=0.0, seed=seed)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts[:max_windows]],
                    params)
    eos = llm.tokenizer.eos_token_id or 0
    windows, lengths, prompt_lengths = [], [], []
    for out in outs:
        ids = (out.prompt_token_ids + list(out.outputs[0].token_ids))[:WINDOW]
        lengths.append(len(ids))
        prompt_lengths.append(len(out.prompt_token_ids))
        windows.append(ids + [eos] * (WINDOW - len(ids)))
    return (torch.tensor(windows, dtype=torch.int64), torch.tensor(lengths),
            torch.tensor(prompt_lengths))


def build_batch(model: LlamaForCausalLM, windows: torch.Tensor, lengths: torch.Tensor,
                prompt_lengths: torch.Tensor, aux_ids: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and target labels (target ids) for every window. Padding, and the
    labels of prompt text (position t labels the token at t + 1, which serving never
    drafts inside a prompt), are IGNORE; the prompt stays as context."""
    feats, labels = [], []
    for start in range(0, len(windows), FEATURE_CHUNK):
        aux, lab = target_features(model, windows[start:start + FEATURE_CHUNK], aux_ids)
        feats.append(aux)
        labels.append(lab)
    label = torch.cat(labels)
    pos = torch.arange(WINDOW)[None, :]
    unlabelled = (pos >= lengths[:, None]) | (pos + 1 < prompt_lengths[:, None])
    return torch.cat(feats), label.masked_fill(unlabelled, IGNORE)


def self_distilled_data(llm: LLM, model: LlamaForCausalLM, args: argparse.Namespace,
                        aux_ids: tuple[int, ...], cache: Path) -> dict[str, tuple]:
    """(windows, aux, labels) per split, kept in `cache/<key>.pt`: the data depends
    only on the target, the seed and the sizes, so the heads of every method share
    it, and a resumed run does not generate it again."""
    key = hashlib.sha256(json.dumps(["v4", CHAT_SHARE, model.config.hidden_size,
                                     args.tokens, args.seed, args.max_prompts, WINDOW,
                                     list(aux_ids), str(args.model)]).encode()
                         ).hexdigest()[:16]
    file = cache / f"{key}.pt"
    if file.exists():
        return dict(torch.load(file, weights_only=True))
    windows_total = max(2, args.tokens // WINDOW)
    splits = {}
    for split, count, chat_prompts in (("train", windows_total,
                                        instructions("train")[:args.max_prompts]),
                                       ("eval", max(2, windows_total // 10),
                                        instructions("eval"))):
        num_chat = max(1, round(count * CHAT_SHARE))
        chat, chat_len, chat_prompt = chat_windows(llm, chat_prompts, num_chat, args.seed)
        # Code fills what chat could not (fewer instructions than chat windows).
        code = code_windows(llm.tokenizer, WINDOW, max(1, count - len(chat)), split)
        windows = torch.cat((chat, code))
        lengths = torch.cat((chat_len, torch.full((len(code),), WINDOW)))
        prompts = torch.cat((chat_prompt, torch.zeros(len(code), dtype=torch.int64)))
        aux, labels = build_batch(model, windows, lengths, prompts, aux_ids)
        splits[split] = (windows, aux, labels)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    torch.save(splits, tmp)
    tmp.replace(file)
    return splits


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot check alone, before minutes of data generation: ValueError
    naming the option. (Ranges of single options are argparse types: training/options.py.)"""
    vocab_size = int(read_config(resolve_model(args.model))["vocab_size"])
    if args.draft_vocab_size > vocab_size:
        raise ValueError(f"--draft-vocab-size must be at most the target's vocabulary "
                         f"({vocab_size}), got {args.draft_vocab_size}")


def run(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    torch.manual_seed(args.seed)
    check_arguments(args)
    path = resolve_model(args.model)
    model = load_model(path)
    llm = LLM(model=args.model, loaded_model=model, max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=2048)
    config = Eagle3Config.for_target(model.config, args.draft_vocab_size)
    out = Path(args.out) if args.out else trained_head_dir(path, args.method)
    splits = self_distilled_data(llm, model, args, config.aux_layer_ids, out.parent / "data")
    data_s = time.monotonic() - started
    train_labels = splits["train"][2]
    d2t, t2d = draft_vocab(train_labels[train_labels >= 0], model.config.vocab_size,
                           args.draft_vocab_size)

    def batch(split: str) -> Batch:
        windows, aux, labels = splits[split]
        # t2d gives MISSING (-1) for a token outside the draft vocabulary.
        mapped = torch.where(labels >= 0, t2d[labels.clamp(min=0)], IGNORE)
        return Batch(aux, windows, mapped, greedy_run(windows, labels))

    head = Eagle3Head(config, model, seed=args.seed)
    init_from_target(head, model, d2t)
    out.mkdir(parents=True, exist_ok=True)
    train_config = TrainConfig(updates=args.updates, depth=args.num_speculative_tokens,
                               seed=args.seed, method=args.method)
    train_head(head, batch("train"), train_config, checkpoint=out / "checkpoint.pt",
               progress=not args.no_progress)
    loss, accs = evaluate(head, batch("eval"), train_config.depth, args.method)
    metrics = {"method": args.method, "held_out_loss": round(loss, 4),
               "num_speculative_tokens": train_config.depth,
               "held_out_agreement_per_step": [round(a, 4) for a in accs],
               "expected_acceptance_length": round(expected_length(accs), 3),
               "train_windows": len(splits["train"][0]),
               "eval_windows": len(splits["eval"][0]), "window": WINDOW,
               "updates": args.updates, "seed": args.seed,
               "data_s": round(data_s, 1), "wall_s": round(time.monotonic() - started, 1)}
    save_eagle3(head, out, extra={"method": args.method, "trained": metrics})
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics))
    print(f"wrote {out}")
    return metrics
