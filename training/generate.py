"""Self-distilled training windows, with the target's features kept while it generates.

The target answers each conversation greedily through the engine's batched `LLM.chat`
(as a greedy request is served), with a `FeatureCapture` on the runner: the three
layers' inputs and the final hidden state of every position it runs come out of the
same passes, so no teacher-forced pass over the answers follows. The labels are the
answers themselves: under greedy decoding the token after position p is the target's
argmax there.

A window holds a quarter window of the prompt's end (the context the first drafts
read) and as much of the answer as fits; positions outside the answer are context
only (IGNORE), as serving never drafts inside a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.llm import LLM
from runner.feature_capture import CapturedFeatures, FeatureCapture
from scheduler import SamplingParams
from training.train import IGNORE


@dataclass(frozen=True)
class Windows:
    """Training windows, padded to one length."""

    tokens: torch.Tensor  # [N, W] ids (padding: eos)
    aux: torch.Tensor  # [N, W, 3H] the aux layers' inputs (padding: 0)
    final: torch.Tensor  # [N, W, H] final normed hidden states (padding: 0)
    labels: torch.Tensor  # [N, W] the target's greedy token after each position, or IGNORE

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def cat(parts: list[Windows]) -> Windows:
        return Windows(*(torch.cat([getattr(p, f) for p in parts])
                         for f in ("tokens", "aux", "final", "labels")))

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.aux, self.final, self.labels


def answer_window(full: list[int], prompt_len: int, got: CapturedFeatures, width: int,
                  pad: int) -> Windows:
    """One window of a generated conversation: from a quarter window before the answer
    starts, `width` positions. Features exist up to the last token but one (no pass
    has read the last token); labels from the last prompt position to there."""
    start = max(0, prompt_len - width // 4)
    stop = min(len(full) - 1, start + width)  # positions with features (and a next token)
    tokens = torch.full((1, width), pad, dtype=torch.int64)
    window = full[start:start + width]
    tokens[0, :len(window)] = torch.tensor(window)
    aux = torch.zeros((1, width, got.aux.shape[1]), dtype=got.aux.dtype)
    final = torch.zeros((1, width, got.final.shape[1]), dtype=got.final.dtype)
    aux[0, :stop - start] = got.aux[start:stop]
    final[0, :stop - start] = got.final[start:stop]
    labels = torch.full((1, width), IGNORE, dtype=torch.int64)
    first = max(start, prompt_len - 1)
    if stop > first:
        labels[0, first - start:stop - start] = torch.tensor(full[first + 1:stop + 1])
    return Windows(tokens, aux, final, labels)


def generate_windows(llm: LLM, conversations: list[list[dict[str, Any]]], width: int,
                     aux_layer_ids: tuple[int, ...]) -> tuple[Windows, list[list[int]]]:
    """The target's greedy answers to `conversations` (at most 3/4 `width` tokens each),
    cut into windows with their features; also each answer's token ids (a follow-up
    turn puts them in its context)."""
    if llm.config.enable_prefix_caching:
        raise ValueError("generating training data needs an LLM with "
                         "enable_prefix_caching=False: a prefix-cache hit skips the "
                         "positions it covers, and their features with them")
    capture = FeatureCapture(aux_layer_ids)
    runner = llm.engine.runner
    runner.attach_capture(capture)
    try:
        params = SamplingParams(max_tokens=width - width // 4, temperature=0.0)
        outs = llm.chat(conversations, params, use_tqdm=False)
    finally:
        runner.attach_capture(None)
    pad = llm.tokenizer.eos_token_id or 0
    windows, answers = [], []
    for out in outs:
        answer = list(out.outputs[0].token_ids)
        full = list(out.prompt_token_ids) + answer
        windows.append(answer_window(full, len(out.prompt_token_ids),
                                     capture.take(out.request_id), width, pad))
        answers.append(answer)
    return Windows.cat(windows), answers
